"""``__array_ufunc__``: every element-wise NumPy ufunc on DistArrays, block by block.

``np.exp(x)``, ``x + y``, ``np.add(x, y, out=z, where=m)`` all come here.
Operands are lined up by the rule of :mod:`disttensor.ops.align`; the ufunc
then runs on each rank's block, with no further communication. Errors that
NumPy would raise (shapes that do not broadcast, unsupported dtypes, bad
casts, Python integers out of range) are raised on every rank before any
communication, by a dry run of the ufunc on empty arrays of the operands'
dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..array import DistArray
from ..settings import collective
from ._util import is_dist, wrap
from .align import (
    align_locals,
    as_operand,
    broadcast_shape,
    is_array,
    result_distribution,
    shape_of,
)
from .linalg import matmul_ufunc, vecdot
from .reductions import ufunc_accumulate, ufunc_reduce

__all__ = ["array_ufunc", "elementwise", "local_function", "dummy"]

# keywords passed to the local ufunc call as they are; order/subok only affect memory layout
_PASS = ("dtype", "casting", "signature")
_IGNORE = ("order", "subok")


def dummy(v: Any) -> Any:
    """A stand-in with ``v``'s dtype and no elements, for dry runs (scalars stay as they are)."""
    if is_dist(v):
        return np.empty((0,), dtype=v.dtype)
    if is_array(v):
        return np.empty((0,), dtype=np.dtype(v.dtype))
    return v


def _outs(out: Any, nout: int) -> tuple[Any, ...]:
    if out is None:
        return (None,) * nout
    if not isinstance(out, tuple):
        out = (out,)
    if len(out) != nout:
        raise ValueError(f"the ufunc has {nout} outputs but out= has {len(out)} entries")
    for o in out:
        if o is not None and not is_dist(o):
            raise TypeError(
                f"out= of a ufunc on DistArrays must hold DistArrays, got {type(o).__name__}"
            )
    return out


def xp_of(operands: Sequence[Any]) -> Any:
    """The array module of the first DistArray among ``operands``."""
    for o in operands:
        if is_dist(o):
            return o.xp
    return np


def elementwise(ufunc: np.ufunc, inputs: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Apply an element-wise ufunc (``method == '__call__'``) to DistArray operands."""
    kwargs = dict(kwargs)
    outs = _outs(kwargs.pop("out", None), ufunc.nout)
    where = kwargs.pop("where", True)
    for k in _IGNORE:
        kwargs.pop(k, None)
    unknown = set(kwargs) - set(_PASS)
    if unknown:
        raise TypeError(f"{ufunc.__name__} on DistArrays does not take {sorted(unknown)}")
    operands = [as_operand(v) for v in inputs]
    where = where if isinstance(where, bool) else as_operand(where)
    given = [o for o in outs if o is not None]

    shapes = [shape_of(o) for o in operands]
    if not isinstance(where, bool):
        shapes.append(shape_of(where))
    shape = broadcast_shape(*shapes, *(o.shape for o in given))
    for o in given:
        if o.shape != shape:
            raise ValueError(
                f"non-broadcastable output operand with shape {o.shape} doesn't match the "
                f"broadcast shape {shape}"
            )
        if o.dist != given[0].dist:
            raise ValueError("all out= arrays of a ufunc must have the same distribution")

    # dry run: NumPy's own errors, the same on every rank, before any message
    with np.errstate(all="ignore"):
        res = ufunc(
            *(dummy(o) for o in operands),
            out=tuple(None if o is None else np.empty((0,), o.dtype) for o in outs),
            where=where if isinstance(where, bool) else dummy(where),
            **kwargs,
        )
    res = res if isinstance(res, tuple) else (res,)
    dtypes = [np.asarray(r).dtype for r in res]

    target = result_distribution(
        [*operands, *([] if isinstance(where, bool) else [where])], shape,
        given[0] if given else None,
    )
    xp = given[0].xp if given else xp_of(operands)
    every = operands if isinstance(where, bool) else [*operands, where]
    locals_ = align_locals(every, target, xp)
    where_local = where if isinstance(where, bool) else locals_.pop()
    local_shape = target.local_shape()
    out_locals = tuple(
        xp.empty(local_shape, dtype=dt) if o is None else o.local for o, dt in zip(outs, dtypes)
    )
    ufunc(*locals_, out=out_locals, where=where_local, **kwargs)
    results = tuple(
        wrap(loc, target, xp) if o is None else o for o, loc in zip(outs, out_locals)
    )
    return results[0] if ufunc.nout == 1 else results


def local_function(func: Callable[..., Any], operands: Sequence[Any], *,
                   out: DistArray | None = None, **kwargs: Any) -> DistArray:
    """Apply an element-wise (non-ufunc) function, such as ``np.where`` or ``np.clip``.

    ``func(*local_parts, **kwargs)`` must return an array of the broadcast
    shape of its arguments. The operands are lined up as for ufuncs; a dry run
    on empty arrays gives the dtype and raises NumPy's errors before any
    communication. With ``out``, the result is written into it.
    """
    operands = [None if o is None else as_operand(o) for o in operands]
    present = [o for o in operands if o is not None]
    shape = broadcast_shape(*(shape_of(o) for o in present),
                            *([] if out is None else [out.shape]))
    if out is not None and out.shape != shape:
        raise ValueError(f"out has shape {out.shape} but the result has shape {shape}")
    with np.errstate(all="ignore"):
        dry = func(*(None if o is None else dummy(o) for o in operands), **kwargs)
    dtype = np.asarray(dry).dtype
    target = result_distribution(present, shape, out)
    xp = out.xp if out is not None else xp_of(present)
    parts = iter(align_locals(present, target, xp))
    args = [None if o is None else next(parts) for o in operands]
    local = xp.asarray(func(*args, **kwargs))
    local_shape = target.local_shape()
    if tuple(local.shape) != local_shape:
        local = xp.broadcast_to(local, local_shape)
    if out is not None:
        out.local[...] = local
        return out
    return wrap(local.astype(dtype, copy=False), target, xp)


@collective
def array_ufunc(ufunc: np.ufunc, method: str, inputs: Sequence[Any],
                kwargs: dict[str, Any]) -> Any:
    """The body of ``DistArray.__array_ufunc__``."""
    for v in (*inputs, *(kwargs.get("out") or ())):
        if not (is_dist(v) or v is None or isinstance(v, (np.ndarray, np.generic, int, float,
                                                           complex, bool, list, tuple))):
            if hasattr(v, "__array_ufunc__"):
                return NotImplemented  # another array library: let it (or NumPy) decide
    if method == "__call__":
        if ufunc is np.matmul:
            return matmul_ufunc(inputs, kwargs)
        if ufunc.signature is not None:
            if ufunc is getattr(np, "vecdot", None):
                return vecdot(*inputs, **kwargs)
            return NotImplemented
        return elementwise(ufunc, inputs, kwargs)
    if method == "reduce":
        return ufunc_reduce(ufunc, inputs, kwargs)
    if method == "accumulate":
        return ufunc_accumulate(ufunc, inputs, kwargs)
    return NotImplemented
