"""The NumPy-style methods and protocols of DistArray, attached from outside the type.

:mod:`disttensor.array` defines DistArray's storage and metadata only. This
module defines :class:`ArrayOperators` (operators, ``__array_ufunc__``,
``__array_function__``, ``__array_namespace__``, indexing, reductions and
shape methods, ...) and copies its members onto DistArray when imported, so
the imports run one way: ops imports the array, never the reverse.
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

import disttensor.ops.elementwise as elementwise
import disttensor.ops.linalg as linalg
import disttensor.ops.namespace as namespace
import disttensor.ops.reductions as reductions
import disttensor.ops.shape as shape

from ..array import DistArray
from ..backend import is_cupy, is_numpy
from .advanced import assign, index
from .functions import array_function
from .ufuncs import array_ufunc

__all__ = ["ArrayOperators"]


def _check_modules(*objs: Any) -> None:
    """Raise TypeError for DistArrays whose blocks the NumPy-style operations cannot handle.

    These operations are written for NumPy and CuPy blocks. Blocks of other
    array API libraries support the core operations (creation, redistribution,
    halo exchange, gathering), not these, and get a clear error instead of a
    wrong answer. Checks ``objs`` and the items of sequences among them.
    """
    for obj in objs:
        items = obj if isinstance(obj, (list, tuple)) else (obj,)
        for item in items:
            xp = getattr(item, "xp", None) if isinstance(item, DistArray) else None
            if xp is not None and not (is_numpy(xp) or is_cupy(xp)):
                raise TypeError(
                    "NumPy-style operations on DistArrays need NumPy or CuPy blocks; these "
                    f"blocks are {xp.__name__} arrays. Use .local with {xp.__name__}, or the "
                    "core operations (redistribute, exchange_halo, to_global, ...)"
                )


def _r(x: Any) -> Any:
    _check_modules(x)
    return reductions


def _s(x: Any) -> Any:
    _check_modules(x)
    return shape


class ArrayOperators(NDArrayOperatorsMixin, metaclass=ABCMeta):
    """Operators, NumPy protocols and NumPy-style methods that DistArray gets.

    Arithmetic, comparison, bitwise and ``@`` operators come from
    :class:`numpy.lib.mixins.NDArrayOperatorsMixin`, which routes them through
    the ufuncs. ``==`` therefore returns a DistArray, and DistArrays are not
    hashable, like NumPy arrays.

    :class:`~disttensor.DistArray` does not inherit this class: importing this
    module copies its members onto DistArray and registers DistArray as a
    virtual subclass, so ``isinstance(x, ArrayOperators)`` holds.
    """

    __slots__ = ()

    # ------------------------------------------------------------ protocols
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _check_modules(self, inputs, kwargs.get("out"))
        return array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        _check_modules(self, args, *args, *kwargs.values())
        return array_function(func, types, args, kwargs)

    def __array_namespace__(self, *, api_version: str | None = None) -> Any:
        """The Python array API namespace for DistArrays (:mod:`disttensor.ops.namespace`)."""
        if api_version is not None and api_version not in ("2022.12", "2023.12"):
            raise ValueError(f"unsupported array API version {api_version!r}")
        _check_modules(self)
        return namespace

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError(
            "a DistArray is not converted to a NumPy array implicitly (that would gather it "
            "on every rank); call x.to_global() to gather it, or x.local for this rank's block"
        )

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """Export through DLPack when this rank holds the whole array (one rank, or every
        dimension unsplit: replicated); the capsule shares this rank's memory.

        A DistArray split over ranks has no single buffer: that raises BufferError
        (the standard's error for arrays that cannot be exported) on the ranks
        that hold a part, pointing to ``x.local``, whose blocks exchange with
        NumPy, CuPy and PyTorch without copying (``torch.from_dlpack(x.local)``).
        """
        if self.dist.local_shape() != self.shape or any(n > 1 for n in self.dist.nblocks):
            raise BufferError(
                "a DistArray split over ranks cannot be exported through DLPack as one "
                "array; export this rank's block instead: x.local.__dlpack__() (for example "
                "torch.from_dlpack(x.local) or numpy.from_dlpack(x.local), no copy), or "
                "gather it first with x.to_global()")
        kw = {k: v for k, v in (("stream", stream), ("max_version", max_version),
                                ("dl_device", dl_device), ("copy", copy)) if v is not None}
        return self.local.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[Any, int]:
        """The DLPack device of this rank's block."""
        return self.local.__dlpack_device__()

    # ------------------------------------------------------------ indexing
    def __getitem__(self, key: Any) -> Any:
        _check_modules(self)
        return index(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_modules(self, value)
        assign(self, key, value)

    # ------------------------------------------------------------ scalars
    def _scalar(self) -> Any:
        _check_modules(self)
        if self.size != 1:  # type: ignore[attr-defined]
            raise TypeError("only DistArrays with one element can be converted to Python "
                            "scalars")
        x = self if self.ndim == 0 else self.reshape(())  # type: ignore[attr-defined]
        return x.local[()]

    def item(self) -> Any:
        """The single element as a Python scalar (collective when the array is split)."""
        return self._scalar().item()

    def __bool__(self) -> bool:
        if self.size != 1:  # type: ignore[attr-defined]
            raise ValueError(
                f"The truth value of a DistArray with {self.size} elements is ambiguous. "  # type: ignore[attr-defined]
                "Use a.any() or a.all()"
            )
        return bool(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def __complex__(self) -> complex:
        return complex(self._scalar())

    def __index__(self) -> int:
        if self.dtype.kind not in "iu":  # type: ignore[attr-defined]
            raise TypeError("only integer DistArrays can be used as an index")
        return int(self._scalar())

    def tolist(self) -> Any:
        """The gathered array as nested Python lists (collective)."""
        return self.to_global().tolist()  # type: ignore[attr-defined]

    # ------------------------------------------------------------ reductions
    def sum(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False,
            **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.sum`."""
        return _r(self).sum(self, axis, dtype, out, keepdims, **kw)

    def prod(self, axis: Any = None, dtype: Any = None, out: Any = None,
             keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.prod`."""
        return _r(self).prod(self, axis, dtype, out, keepdims, **kw)

    def mean(self, axis: Any = None, dtype: Any = None, out: Any = None,
             keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.mean`."""
        return _r(self).mean(self, axis, dtype, out, keepdims, **kw)

    def var(self, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0,
            keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.var`."""
        return _r(self).var(self, axis, dtype, out, ddof, keepdims, **kw)

    def std(self, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0,
            keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.std`."""
        return _r(self).std(self, axis, dtype, out, ddof, keepdims, **kw)

    def min(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.min`."""
        return _r(self).min(self, axis, out, keepdims, **kw)

    def max(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.max`."""
        return _r(self).max(self, axis, out, keepdims, **kw)

    def argmin(self, axis: Any = None, out: Any = None, *, keepdims: bool = False) -> Any:
        """See :func:`disttensor.ops.reductions.argmin`."""
        return _r(self).argmin(self, axis, out, keepdims=keepdims)

    def argmax(self, axis: Any = None, out: Any = None, *, keepdims: bool = False) -> Any:
        """See :func:`disttensor.ops.reductions.argmax`."""
        return _r(self).argmax(self, axis, out, keepdims=keepdims)

    def all(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.all`."""
        return _r(self).all(self, axis, out, keepdims, **kw)

    def any(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kw: Any) -> Any:
        """See :func:`disttensor.ops.reductions.any`."""
        return _r(self).any(self, axis, out, keepdims, **kw)

    def cumsum(self, axis: Any = None, dtype: Any = None, out: Any = None) -> Any:
        """See :func:`disttensor.ops.reductions.cumsum`."""
        return _r(self).cumsum(self, axis, dtype, out)

    def cumprod(self, axis: Any = None, dtype: Any = None, out: Any = None) -> Any:
        """See :func:`disttensor.ops.reductions.cumprod`."""
        return _r(self).cumprod(self, axis, dtype, out)

    # ------------------------------------------------------------ shape
    def reshape(self, *shape: Any, order: str = "C", copy: Any = None) -> Any:
        """See :func:`disttensor.ops.shape.reshape` (``x.reshape(2, 3)`` works too)."""
        if len(shape) == 1:  # x.reshape((2, 3)) or x.reshape(6): the one argument is the shape
            shape = shape[0]
        return _s(self).reshape(self, shape, order, copy=copy)

    def transpose(self, *axes: Any) -> Any:
        """See :func:`disttensor.ops.shape.transpose` (``x.transpose(1, 0)`` works too)."""
        if len(axes) == 1 and (axes[0] is None or not isinstance(axes[0], int)):
            axes = axes[0]
        return _s(self).transpose(self, axes or None)

    @property
    def T(self) -> Any:
        """The array with its dimensions reversed."""
        return _s(self).transpose(self)

    @property
    def mT(self) -> Any:
        """The array with its last two dimensions swapped."""
        return _s(self).matrix_transpose(self)

    def swapaxes(self, axis1: int, axis2: int) -> Any:
        """See :func:`disttensor.ops.shape.swapaxes`."""
        return _s(self).swapaxes(self, axis1, axis2)

    def ravel(self, order: str = "C") -> Any:
        """The flattened array (a copy)."""
        return _s(self).ravel(self, order)

    def flatten(self, order: str = "C") -> Any:
        """The flattened array (a copy)."""
        return _s(self).ravel(self, order)

    def squeeze(self, axis: Any = None) -> Any:
        """See :func:`disttensor.ops.shape.squeeze`."""
        return _s(self).squeeze(self, axis)

    # ------------------------------------------------------------ element-wise
    def clip(self, min: Any = None, max: Any = None, out: Any = None, **kw: Any) -> Any:
        """See :func:`disttensor.ops.elementwise.clip`."""
        _check_modules(self)
        return elementwise.clip(self, min, max, out, **kw)

    def round(self, decimals: int = 0, out: Any = None) -> Any:
        """See :func:`disttensor.ops.elementwise.round`."""
        _check_modules(self)
        return elementwise.round(self, decimals, out)

    def conj(self) -> Any:
        """The complex conjugate."""
        return np.conjugate(self)

    conjugate = conj

    @property
    def real(self) -> Any:
        """The real part (a new array)."""
        _check_modules(self)
        return elementwise.real(self)

    @property
    def imag(self) -> Any:
        """The imaginary part (a new array)."""
        _check_modules(self)
        return elementwise.imag(self)

    def dot(self, b: Any, out: Any = None) -> Any:
        """See :func:`disttensor.ops.linalg.dot`."""
        _check_modules(self, b)
        return linalg.dot(self, b, out)

    # ------------------------------------------------------------ array API attributes
    @property
    def device(self) -> str:
        """``"cpu"`` (array API attribute; CuPy blocks report ``"gpu"``)."""
        return "cpu" if is_numpy(self.xp) else "gpu"  # type: ignore[attr-defined]

    def to_device(self, device: Any, /, *, stream: Any = None) -> Any:
        """Array API ``to_device``: only the current device is supported."""
        if device != self.device:
            raise ValueError(f"cannot move a DistArray to {device!r}")
        return self


# type's bookkeeping entries, which DistArray has of its own
_OWN = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__",
        "__abstractmethods__", "_abc_impl"}


def _attach(cls: type) -> None:
    """Copy the members of :class:`ArrayOperators` (and of NumPy's mixin) onto ``cls``."""
    for base in (NDArrayOperatorsMixin, ArrayOperators):
        for name, value in vars(base).items():
            if name not in _OWN:
                setattr(cls, name, value)
    ArrayOperators.register(cls)


_attach(DistArray)
