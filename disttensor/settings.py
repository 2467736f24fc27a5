"""Library options, and the collective-consistency check mode.

The classic MPI deadlock is one rank passing a different argument to a
collective call than the others (a rank-dependent shape, root, axis, halo
width, index or target distribution): the ranks then post different
messages and wait for each other forever, or, worse, exchange the wrong
data. In *check mode* every collective entry point of disttensor (the
functions decorated with :func:`collective`) first gathers a description of
its arguments from every rank of the communicator and compares them; if
any differs, every rank raises the same :class:`CollectiveMismatchError`,
naming the function, the argument and the two values. This is the spirit
of PETSc's debug checks and of MPI correctness tools, at the level of the
library's own calls.

Check mode is off by default and costs one flag test per call then; on, it
costs one small ``allgather`` per outermost collective call (calls made
from inside another checked call are not checked again). Turn it on with
:func:`set_options` (``check_collective=True``), for a block of code with
:func:`options`, or for a whole launch with the environment variable
``DISTTENSOR_CHECK_COLLECTIVE=1``, read once at import. Set it alike on
every rank.

What is compared: metadata, never the data. A DistArray is described by its
global shape, dtype and distribution, a Distribution and a ProcessGrid by
their repr, a NumPy (or other local) array by shape and dtype (and its
values when it has at most 32 elements: indices and fill values are small),
numbers, strings, slices and None by value, containers element by element.
Arguments that legitimately differ between ranks (a local block, the array
of a non-root rank) are left out by each entry point.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

__all__ = [
    "CollectiveMismatchError",
    "check_arguments",
    "collective",
    "get_options",
    "options",
    "set_options",
]

ENV_CHECK = "DISTTENSOR_CHECK_COLLECTIVE"

F = TypeVar("F", bound=Callable[..., Any])


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected 0 or 1")


_check = _env_flag(ENV_CHECK)
_pool_bytes = 2**24  # buffer_pool_bytes
_nesting = threading.local()
_SMALL = 32  # local arrays up to this many elements are compared by value
_SHOWN = 160  # characters of a value shown in a mismatch message


class CollectiveMismatchError(ValueError):
    """Ranks passed different arguments to one collective call (check mode only).

    Raised on every rank of the communicator with the same message, which
    names the function, the first argument that differs, and its value on
    rank 0 and on the first rank that differs from it.
    """


def get_options() -> dict[str, Any]:
    """The current options, as a dict (``{"check_collective": bool, "buffer_pool_bytes": int}``)."""
    return {"check_collective": _check, "buffer_pool_bytes": _pool_bytes}


def set_options(*, check_collective: bool | None = None,
                buffer_pool_bytes: int | None = None) -> dict[str, Any]:
    """Change options; returns the previous ones (the form :func:`get_options` gives).

    Parameters
    ----------
    check_collective : bool, optional
        Check mode (see the module docstring): every collective entry point
        compares its arguments across the communicator first. ``None``
        leaves it as it is. Set it alike on every rank.
    buffer_pool_bytes : int, optional
        The most bytes of message and scratch buffers that halo exchanges,
        redistributions and reductions keep for reuse, per array module
        (default 16 MiB). Buffers are kept least recently used first out; a
        buffer larger than the cap is freed after use. 0 keeps none.
        ``None`` leaves it as it is.

    Returns
    -------
    dict
        The options before the change; ``set_options(**previous)`` restores them.

    Raises
    ------
    TypeError
        If ``check_collective`` is not a bool.
    """
    global _check, _pool_bytes
    if check_collective is not None and not isinstance(check_collective, (bool, np.bool_)):
        raise TypeError(f"check_collective must be a bool, got {check_collective!r}")
    if buffer_pool_bytes is not None and (
            isinstance(buffer_pool_bytes, (bool, np.bool_)) or
            not isinstance(buffer_pool_bytes, (int, np.integer)) or buffer_pool_bytes < 0):
        raise ValueError(f"buffer_pool_bytes must be an integer >= 0, got {buffer_pool_bytes!r}")
    previous = get_options()
    if check_collective is not None:
        _check = bool(check_collective)
    if buffer_pool_bytes is not None:
        _pool_bytes = int(buffer_pool_bytes)
    return previous


@contextmanager
def options(*, check_collective: bool | None = None,
            buffer_pool_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Context manager form of :func:`set_options`, like :func:`numpy.errstate`.

    Examples
    --------
    >>> import disttensor as dt
    >>> with dt.options(check_collective=True):   # doctest: +SKIP
    ...     y = x.redistribute(target)   # CollectiveMismatchError if target differs by rank
    """
    previous = set_options(check_collective=check_collective,
                           buffer_pool_bytes=buffer_pool_bytes)
    try:
        yield get_options()
    finally:
        set_options(**previous)


# ---------------------------------------------------------------- descriptions
# Duck-typed, so that every module of the package (grid and distribution included) can
# use this one without an import cycle.
def _is_distribution(value: Any) -> bool:
    return hasattr(value, "global_shape") and hasattr(value, "grid_shape")


def _describe(value: Any, depth: int = 0) -> str:
    """A rank-independent text for ``value`` that equal arguments share (metadata only)."""
    if value is None or value is Ellipsis or isinstance(
        value, (bool, int, float, complex, str, bytes, np.generic, np.dtype)
    ):
        return repr(value)
    if isinstance(value, type) or inspect.isroutine(value) or inspect.ismodule(value):
        name = getattr(value, "__qualname__", value.__name__)
        return f"{getattr(value, '__module__', '')}.{name}"
    if isinstance(value, slice):
        return f"slice({value.start!r}, {value.stop!r}, {value.step!r})"
    if isinstance(value, MPI.Comm):
        return f"{type(value).__name__}(size={value.Get_size()})"
    if _is_distribution(value) or (isinstance(getattr(value, "comm", None), MPI.Comm)
                                   and type(value).__repr__ is not object.__repr__):
        return repr(value)  # Distribution, ProcessGrid, DistArray: metadata-only reprs
    src, dst = getattr(value, "src", None), getattr(value, "dst", None)
    if _is_distribution(src) and _is_distribution(dst):  # a redistribution plan
        return f"{type(value).__name__}({src!r} -> {dst!r})"
    dist = getattr(value, "dist", None)
    if _is_distribution(dist):  # a halo plan
        return (f"{type(value).__name__}({dist!r}, widths={getattr(value, 'widths', None)!r}, "
                f"mode={getattr(value, 'mode', None)!r})")
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a local array of any module
        shape = tuple(value.shape)
        if int(np.prod(shape)) <= _SMALL and isinstance(value, np.ndarray):
            return f"array({value.tolist()!r}, dtype={value.dtype})"
        return f"array(shape={shape}, dtype={value.dtype})"
    if depth < 4 and isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v, depth + 1) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if depth < 4 and isinstance(value, Mapping):
        items = sorted((str(k), _describe(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, np.ufunc):
        return f"ufunc {value.__name__}"
    return type(value).__qualname__  # other objects: their type only


def _comm_of(value: Any, depth: int = 0) -> MPI.Comm | None:
    """The communicator ``value`` lives on (a DistArray, Distribution, grid, plan...), if any."""
    if isinstance(value, MPI.Comm):
        return value
    comm = getattr(value, "comm", None)  # DistArray, ProcessGrid, redistribution plan
    if isinstance(comm, MPI.Comm):
        return comm
    if _is_distribution(value):
        return None if value.grid is None else value.grid.comm
    dist = getattr(value, "dist", None)  # a halo plan
    if _is_distribution(dist) and dist.grid is not None:
        return dist.grid.comm
    if depth < 2 and isinstance(value, (tuple, list)):
        values = value
    elif depth < 2 and isinstance(value, Mapping):
        values = list(value.values())
    else:
        return None
    for v in values:
        comm = _comm_of(v, depth + 1)
        if comm is not None:
            return comm
    return None


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def check_arguments(name: str, arguments: Mapping[str, Any], comm: MPI.Comm | None = None
                    ) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank unless all pass equal ``arguments``.

    The helper behind :func:`collective`, for entry points that check by
    hand. Collective over ``comm`` (by default the communicator of the first
    argument that has one, else ``COMM_WORLD``), whether or not check mode
    is on.

    Parameters
    ----------
    name : str
        The call, as the message names it.
    arguments : mapping
        Argument names to values.
    comm : mpi4py.MPI.Comm, optional
        The communicator of the call.
    """
    if comm is None:
        comm = next((c for c in map(_comm_of, arguments.values()) if c is not None),
                    MPI.COMM_WORLD)
    if comm.Get_size() == 1:
        return
    mine = (name, [(k, _describe(v)) for k, v in arguments.items()])
    gathered = comm.allgather(mine)
    # every rank reads the same gathered list, so every rank raises the same message
    first = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs == first:
            continue
        if not (isinstance(theirs, tuple) and isinstance(first, tuple)) or theirs[0] != first[0]:
            calls = [g[0] if isinstance(g, tuple) else "another collective" for g in gathered]
            raise CollectiveMismatchError(
                f"ranks are in different collective calls: rank 0 in {calls[0]}, rank {rank} in "
                f"{calls[rank]}; every rank must make the same calls in the same order"
            )
        call, args0, args = first[0], first[1], theirs[1]
        if [k for k, _ in args0] != [k for k, _ in args]:
            raise CollectiveMismatchError(
                f"{call}: ranks 0 and {rank} pass different arguments ({[k for k, _ in args0]} "
                f"and {[k for k, _ in args]}); every rank must make the same collective call"
            )
        for (k, v0), (_, v) in zip(args0, args):
            if v0 != v:
                raise CollectiveMismatchError(
                    f"{call}: argument {k!r} differs across ranks: rank 0 passes "
                    f"{_short(v0)}, rank {rank} passes {_short(v)}; every rank must pass "
                    "the same value to a collective call"
                )


def collective(func: F | None = None, *, ignore: tuple[str, ...] = ()) -> Any:
    """Mark ``func`` as a collective entry point: in check mode its arguments are compared.

    With check mode off the wrapper tests one flag and calls ``func``. With
    it on, the outermost decorated call compares the description of every
    bound argument (except those in ``ignore``) across the communicator of
    its arguments, then calls ``func``; decorated calls made inside it are
    not compared again.

    Parameters
    ----------
    func : callable
        The entry point (use as ``@collective`` or ``@collective(ignore=(...))``).
    ignore : tuple of str
        Arguments that may differ between ranks (local blocks, root-only data).

    Returns
    -------
    callable
        The wrapped function (or a decorator, without ``func``).
    """

    def decorate(f: F) -> F:
        signature = inspect.signature(f)
        name = f.__qualname__
        var_kw = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _check or getattr(_nesting, "depth", 0):
                return f(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a wrong call: f raises its own TypeError, alike everywhere
                return f(*args, **kwargs)
            arguments = {k: v for k, v in bound.arguments.items()
                         if k not in ignore and k not in var_kw}
            for k in var_kw:  # **keywords compared one by one, under their own names
                arguments.update(sorted(bound.arguments.get(k, {}).items()))
            check_arguments(name, arguments)
            _nesting.depth = 1
            try:
                return f(*args, **kwargs)
            finally:
                _nesting.depth = 0

        return wrapper  # type: ignore[return-value]

    return decorate if func is None else decorate(func)
