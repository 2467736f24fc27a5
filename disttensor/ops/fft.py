"""The array API ``fft`` extension on DistArrays: distributed N-D FFTs by the pencil method.

A transform along an axis needs that axis whole on every rank that holds
any of it. :class:`FFTPlan` therefore runs a chain of stages: transform
every pending axis that is local in the current layout (with the array
module's own FFT, ``numpy.fft`` for NumPy blocks), then redistribute so that
the next pending axis becomes local, by moving the grid axes that split it
onto another dimension (one already transformed or never transformed when
there is one, the one with the most elements per block otherwise), and so
on. A slab-split 3-D array (one split axis) needs one redistribution, a
pencil-split one (two split axes) two, as in mpi4py-fft; but any
Distribution works, with uneven or empty blocks, replicas, or several grid
axes on one dimension. Each redistribution is the library's own
:class:`~disttensor.redistribute.RedistributionPlan` (one ``Alltoallw`` or
``Alltoallv``). A split 1-D array has no other dimension to move its grid
axes to: ``fft``/``ifft`` of composite length ``n = n1 * n2`` run as a 2-D
transform of the array viewed as ``(n1, n2)``, with twiddle factors between
the two stages (the four-step method); other 1-D transforms of a split
array, and prime lengths, gather the axis onto every rank of its grid axes
(a :class:`~disttensor.ops.gathering.GatherWarning` above
:data:`~disttensor.ops.gathering.GATHER_WARN_BYTES`).

**Where the result lives** (``out_dist``, beyond the standard):

* ``None`` (default): the input's layout: the same grid axes per dimension
  and the same block boundaries along dimensions whose length did not
  change (the block rule along those that did). ``ifftn(fftn(x))`` has
  ``x``'s distribution. Costs one more redistribution when the chain ended
  elsewhere.
* ``"transposed"``: wherever the last stage left it (no final move; for a
  pencil-split input the grid axes end up shifted by one dimension, as
  mpi4py-fft's forward transforms leave them). An inverse transform of such
  an array starts with its local axes, so a forward/inverse pair with
  ``"transposed"`` moves the data least.
* a :class:`~disttensor.distribution.Distribution` of the result's shape
  on the same processes.

Plans are built from metadata only and cached per (input Distribution,
the resolved 1-D transforms, output choice); the dtype does not change a
plan. Results, dtypes and exceptions are NumPy's (``numpy.fft`` follows the
standard in NumPy 2, complex64 stays complex64); bad arguments raise on
every rank before any message. ``fftshift``/``ifftshift`` are rolls
(:func:`disttensor.ops.shape.roll`), which move only the pieces that cross
block boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

import disttensor.creation as creation
import disttensor.ops.shape as _shape

from ..array import DistArray
from ..distribution import Distribution
from ..redistribute import redistribution_plan
from ..settings import collective
from ._util import axis_index, is_dist, same_comm, wrap
from .gathering import warn_gather, whole_axes

STANDARD_NAMES = [
    "fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft",
    "fftfreq", "rfftfreq", "fftshift", "ifftshift",
]

__all__ = [
    "fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft",
    "fftfreq", "rfftfreq", "fftshift", "ifftshift", "FFTPlan", "fft_plan", "Transform", "Stage",
]

_NORMS = ("backward", "ortho", "forward")
_SWAP = {"backward": "forward", "forward": "backward", "ortho": "ortho"}


class Transform(NamedTuple):
    """One 1-D transform of a chain: ``numpy.fft.<kind>(a, n=n, axis=axis)``."""

    axis: int
    kind: str  # "fft", "ifft", "rfft" or "irfft"
    n: int


class Stage(NamedTuple):
    """Move to ``before``, run ``transforms`` on the local block: the result has ``after``."""

    before: Distribution
    transforms: tuple[Transform, ...]
    after: Distribution


def _split(dist: Distribution, d: int) -> bool:
    return dist.nblocks[d] > 1


def _with_length(dist: Distribution, axis: int, n: int) -> Distribution:
    """``dist`` after a transform changed the (local) ``axis`` to length ``n``."""
    if dist.global_shape[axis] == n:
        return dist
    shape = list(dist.global_shape)
    shape[axis] = n
    splits = list(dist.splits)
    splits[axis] = None
    return dist.replace(global_shape=shape, axes=dist.axes, splits=splits)


def _out_length(t: Transform) -> int:
    return t.n // 2 + 1 if t.kind == "rfft" else t.n


class FFTPlan:
    """A chain of local transforms and redistributions (see the module's description).

    Parameters
    ----------
    dist : Distribution
        The input's layout.
    transforms : tuple of Transform
        The 1-D transforms in NumPy's order (``rfft`` first, ``irfft`` last),
        each with its length resolved.
    out : None, "transposed" or Distribution
        Where the result lives (see the module's description).

    Attributes
    ----------
    stages : tuple of Stage
        Each stage's layout before and after its local transforms.
    out_dist : Distribution
        The result's layout.
    gathers : bool
        Whether a stage gathers a split axis (split 1-D arrays only; ``fft``
        and ``ifft`` of composite length avoid this plan, see above).
    """

    def __init__(self, dist: Distribution, transforms: tuple[Transform, ...], out: Any = None):
        self.src = dist
        stages: list[Stage] = []
        pending = list(transforms)
        cur = dist
        gathers = False
        while pending:
            taken: list[Transform] = []
            blocked: set[int] = set()
            for i, t in enumerate(pending):
                real = t.kind in ("rfft", "irfft")
                runnable = not _split(cur, t.axis) and t.axis not in blocked
                if real and (len(taken) < i or not runnable or (
                        t.kind == "irfft" and i != len(pending) - 1)):
                    break  # rfft must come first, irfft last
                if runnable:
                    taken.append(t)
                else:
                    blocked.add(t.axis)
            if taken:
                after = cur
                for t in taken:
                    after = _with_length(after, t.axis, _out_length(t))
                stages.append(Stage(cur, tuple(taken), after))
                cur = after
                for t in taken:
                    pending.remove(t)
            else:
                nxt = whole_axes(cur, [pending[0].axis], {t.axis for t in pending[1:]})
                gathers = gathers or cur.ndim == 1
                stages.append(Stage(nxt, (), nxt))
                cur = nxt
        # merge each move into the stage of transforms after it
        merged: list[Stage] = []
        for s in stages:
            if merged and not merged[-1].transforms:
                merged[-1] = Stage(s.before, s.transforms, s.after)
            else:
                merged.append(s)
        self.stages = tuple(merged)
        if out is None:
            shape = cur.global_shape
            splits = [s if n == m else None
                      for s, n, m in zip(dist.splits, shape, dist.global_shape)]
            out = Distribution(shape, dist.grid_arg, dist.axes, splits)
        elif isinstance(out, str):
            out = cur
        self.out_dist = out
        self.gathers = gathers

    @property
    def redistributions(self) -> int:
        """How many redistributions a run makes (those with messages and local copies)."""
        n, cur = 0, self.src
        for s in self.stages:
            n += s.before != cur
            cur = s.after
        return n + (self.out_dist != cur)

    def __call__(self, x: DistArray, norm: str = "backward") -> DistArray:
        """Run the plan on ``x`` (which has the plan's input layout)."""
        if self.gathers:
            warn_gather("an FFT of a split 1-D array", x.size * x.dtype.itemsize, stacklevel=4)
        xp = x.xp
        for s in self.stages:
            if x.dist != s.before:
                x = redistribution_plan(x.dist, s.before)(x)
            local = x.local
            for t in s.transforms:
                local = getattr(xp.fft, t.kind)(local, n=t.n, axis=t.axis, norm=norm)
            if s.transforms:
                x = wrap(local, s.after, xp)
        if x.dist != self.out_dist:
            x = redistribution_plan(x.dist, self.out_dist)(x)
        return x


@lru_cache(maxsize=128)
def fft_plan(dist: Distribution, transforms: tuple[Transform, ...], out: Any = None) -> FFTPlan:
    """The cached :class:`FFTPlan` (pure metadata; the same on every rank)."""
    return FFTPlan(dist, transforms, out)


# ------------------------------------------------------------------ argument handling


def _check_array(x: Any, name: str) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"fft.{name}: expected a DistArray, got {type(x).__name__}")
    return x


def _check_norm(norm: Any) -> str:
    if norm is None:
        return "backward"
    if norm not in _NORMS:
        raise ValueError(f'Invalid norm value {norm}; should be "backward","ortho" or "forward".')
    return norm


def _resolve(x: DistArray, spec: Sequence[tuple[int, str, int | None]], norm: str
             ) -> tuple[tuple[Transform, ...], np.dtype]:
    """The transforms with their lengths, and the result dtype; NumPy's errors otherwise.

    A dry run of each 1-D transform on one line of its axis (zeros of the
    input's dtype) raises NumPy's exceptions for bad lengths and dtypes, on
    every rank alike, before any communication.
    """
    shape = list(x.shape)
    dtype = x.dtype
    out = []
    for axis, kind, n in spec:
        m = shape[axis]
        if n is None:
            n = 2 * (m - 1) if kind == "irfft" else m
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n must be an integer, got {n!r}")
        n = int(n)
        line = [1] * len(shape)
        line[axis] = m
        probe = getattr(np.fft, kind)(np.zeros(line, dtype), n=n, axis=axis, norm=norm)
        dtype = probe.dtype
        shape[axis] = probe.shape[axis]
        out.append(Transform(axis, kind, n))
    return tuple(out), dtype


def _check_out(out_dist: Any, x: DistArray, shape: tuple[int, ...]) -> Any:
    if out_dist is None or out_dist == "transposed":
        return out_dist
    if not isinstance(out_dist, Distribution):
        raise TypeError('out_dist must be None, "transposed" or a Distribution, '
                        f"got {out_dist!r}")
    if out_dist.global_shape != shape:
        raise ValueError(f"out_dist has shape {out_dist.global_shape}, the result {shape}")
    if out_dist.grid is None or not same_comm(out_dist, x.dist):
        raise ValueError("out_dist must live on the input's processes")
    return out_dist


def _factor(n: int) -> int:
    """The largest divisor of ``n`` not above its square root (1 for primes)."""
    for f in range(math.isqrt(n), 1, -1):
        if n % f == 0:
            return f
    return 1


def _four_step(x: DistArray, t: Transform, norm: str, out: Any) -> DistArray:
    """A complex FFT of a split 1-D array of length ``n1 * n2`` as a distributed 2-D one.

    With ``j = n2 * j1 + j2`` and ``k = k1 + n1 * k2``: transform ``x`` viewed
    as ``(n1, n2)`` along its first axis, multiply by the twiddles
    ``w^(j2 k1)`` (``w = exp(-+2 pi i / n)``), transform along the second
    axis, and read the ``(n1, n2)`` result in column-major order. Each
    transform is a stage of the pencil method, so nothing is gathered.
    """
    n = t.n
    n1 = _factor(n)
    n2 = n // n1
    a = _shape.reshape(x, (n1, n2))
    b = fft_plan(a.dist, (Transform(0, t.kind, n1),), "transposed")(a, norm)
    sl = b.dist.local_slices()
    k1 = np.arange(sl[0].start, sl[0].stop)[:, None]
    j2 = np.arange(sl[1].start, sl[1].stop)[None, :]
    sign = -1 if t.kind == "fft" else 1
    twiddle = np.exp(sign * 2j * np.pi * ((k1 * j2) % n) / n).astype(b.dtype)
    b.local[...] *= b.xp.asarray(twiddle)
    c = fft_plan(b.dist, (Transform(1, t.kind, n2),), "transposed")(b, norm)
    y = _shape.reshape(_shape.transpose(c), (n,))
    target = x.dist if out is None else (y.dist if isinstance(out, str) else out)
    return y if y.dist == target else redistribution_plan(y.dist, target)(y)


def _run(x: DistArray, spec: Sequence[tuple[int, str, int | None]], norm: Any,
         out_dist: Any) -> DistArray:
    norm = _check_norm(norm)
    transforms, _ = _resolve(x, spec, norm)
    shape = list(x.shape)
    for t in transforms:
        shape[t.axis] = _out_length(t)
    out = _check_out(out_dist, x, tuple(shape))
    if not transforms:
        return x.copy()
    t = transforms[0]
    if (x.ndim == 1 and _split(x.dist, 0) and len(transforms) == 1 and t.kind in ("fft", "ifft")
            and t.n == x.shape[0] and _factor(t.n) > 1):
        return _four_step(x.astype(np.result_type(x.dtype, np.complex64)), t, norm, out)
    return fft_plan(x.dist, transforms, out)(x, norm)


def _one(x: DistArray, n: Any, axis: Any, kind: str, name: str) -> list:
    _check_array(x, name)
    return [(axis_index(axis, x.ndim), kind, n)]


def _many(x: DistArray, s: Any, axes: Any, kind: str, name: str) -> list:
    """The 1-D transforms of an N-D one, in NumPy's order (the last axis first)."""
    _check_array(x, name)
    if axes is None:
        axes = range(x.ndim) if s is None else range(x.ndim - len(s), x.ndim)
    axes = [axis_index(a, x.ndim) for a in axes]
    if s is None:
        s = [x.shape[a] for a in axes]
        if kind == "irfft" and axes:
            s[-1] = 2 * (x.shape[axes[-1]] - 1)
    s = list(s)
    if len(s) != len(axes):
        raise ValueError("Shape and axes have different lengths.")
    s = [x.shape[a] if n == -1 else n for n, a in zip(s, axes)]
    if not axes:
        return []
    c2c = "ifft" if kind in ("ifft", "irfft") else "fft"
    if kind == "rfft":  # the last axis first (real to complex), then the others
        return [(axes[-1], "rfft", s[-1])] + [(a, c2c, n) for a, n in
                                              zip(axes[-2::-1], s[-2::-1])]
    if kind == "irfft":  # the others first, the last axis last (complex to real)
        return [(a, c2c, n) for a, n in zip(axes[:-1], s[:-1])] + [(axes[-1], "irfft", s[-1])]
    return [(a, kind, n) for a, n in zip(axes[::-1], s[::-1])]


# ------------------------------------------------------------------ the standard's functions


@collective
def fft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
        out_dist: Any = None) -> DistArray:
    """One-dimensional discrete Fourier transform, like :func:`numpy.fft.fft`.

    Parameters
    ----------
    x : DistArray
        Input (any distribution).
    n : int, optional
        Length of the transform (the input is cropped or zero-padded).
    axis : int
        The transformed axis.
    norm : {"backward", "ortho", "forward"}
        Normalisation, as in NumPy.
    out_dist : None, "transposed" or Distribution
        Where the result lives (beyond the standard; see :mod:`disttensor.ops.fft`).

    Returns
    -------
    DistArray
        NumPy's result and dtype.
    """
    return _run(x, _one(x, n, axis, "fft", "fft"), norm, out_dist)


@collective
def ifft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
         out_dist: Any = None) -> DistArray:
    """One-dimensional inverse DFT, like :func:`numpy.fft.ifft` (arguments as :func:`fft`)."""
    return _run(x, _one(x, n, axis, "ifft", "ifft"), norm, out_dist)


@collective
def fftn(x: DistArray, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
         norm: str = "backward", out_dist: Any = None) -> DistArray:
    """N-dimensional DFT, like :func:`numpy.fft.fftn`.

    Parameters
    ----------
    x : DistArray
        Input (any distribution).
    s : sequence of int, optional
        Transform lengths per axis of ``axes`` (-1: the input's length).
    axes : sequence of int, optional
        The transformed axes (all by default; the last ``len(s)`` with ``s``).
    norm : {"backward", "ortho", "forward"}
        Normalisation, as in NumPy.
    out_dist : None, "transposed" or Distribution
        Where the result lives (beyond the standard; see :mod:`disttensor.ops.fft`).

    Returns
    -------
    DistArray
        NumPy's result and dtype.
    """
    return _run(x, _many(x, s, axes, "fft", "fftn"), norm, out_dist)


@collective
def ifftn(x: DistArray, /, *, s: Sequence[int] | None = None,
          axes: Sequence[int] | None = None, norm: str = "backward",
          out_dist: Any = None) -> DistArray:
    """N-dimensional inverse DFT, like :func:`numpy.fft.ifftn` (arguments as :func:`fftn`)."""
    return _run(x, _many(x, s, axes, "ifft", "ifftn"), norm, out_dist)


@collective
def rfft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
         out_dist: Any = None) -> DistArray:
    """DFT of real input (``n // 2 + 1`` outputs), like :func:`numpy.fft.rfft`."""
    return _run(x, _one(x, n, axis, "rfft", "rfft"), norm, out_dist)


@collective
def irfft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
          out_dist: Any = None) -> DistArray:
    """Inverse of :func:`rfft` (``n`` real outputs, ``2 * (m - 1)`` by default),
    like :func:`numpy.fft.irfft`."""
    return _run(x, _one(x, n, axis, "irfft", "irfft"), norm, out_dist)


@collective
def rfftn(x: DistArray, /, *, s: Sequence[int] | None = None,
          axes: Sequence[int] | None = None, norm: str = "backward",
          out_dist: Any = None) -> DistArray:
    """N-dimensional DFT of real input (the last axis halved), like :func:`numpy.fft.rfftn`."""
    return _run(x, _many(x, s, axes, "rfft", "rfftn"), norm, out_dist)


@collective
def irfftn(x: DistArray, /, *, s: Sequence[int] | None = None,
           axes: Sequence[int] | None = None, norm: str = "backward",
           out_dist: Any = None) -> DistArray:
    """Inverse of :func:`rfftn`, like :func:`numpy.fft.irfftn`."""
    return _run(x, _many(x, s, axes, "irfft", "irfftn"), norm, out_dist)


@collective
def hfft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
         out_dist: Any = None) -> DistArray:
    """DFT of a Hermitian-symmetric signal (real output), like :func:`numpy.fft.hfft`:
    ``irfft(conj(x))`` with the normalisation swapped."""
    spec = _one(x, n, axis, "irfft", "hfft")
    norm = _SWAP[_check_norm(norm)]
    _resolve(x, spec, norm)  # NumPy's errors before the conjugation
    return _run(np.conjugate(x), spec, norm, out_dist)


@collective
def ihfft(x: DistArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward",
          out_dist: Any = None) -> DistArray:
    """Inverse of :func:`hfft`, like :func:`numpy.fft.ihfft`: ``conj(rfft(x))`` with the
    normalisation swapped."""
    y = _run(x, _one(x, n, axis, "rfft", "ihfft"), _SWAP[_check_norm(norm)], out_dist)
    return np.conjugate(y, out=y)


def _freq_dtype(dtype: Any) -> np.dtype:
    dtype = np.dtype(np.float64 if dtype is None else dtype)
    if dtype.kind != "f":
        raise ValueError(f"fftfreq: dtype must be a real floating dtype, got {dtype}")
    return dtype


def _check_n(n: Any, name: str) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name}: n should be an integer, got {n!r}")
    if n < 1:
        raise ValueError(f"{name}: n must be positive, got {n}")
    return int(n)


@collective
def fftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None,
            **dist_kw: Any) -> DistArray:
    """Sample frequencies of :func:`fft`, like :func:`numpy.fft.fftfreq`.

    ``[0, 1, ..., (n - 1) // 2, -(n // 2), ..., -1] / (d * n)``, computed from
    each rank's global indices (no communication), on the default grid or the
    layout given by ``grid=``/``axes=``/``splits=``/``dist=`` (as
    :func:`disttensor.zeros`). ``dtype`` (a real floating dtype, float64 by
    default) is beyond the 2023.12 standard (it is in 2024.12's).
    """
    n = _check_n(n, "fftfreq")
    dtype = _freq_dtype(dtype)
    val = 1.0 / (n * d)
    out = creation.empty((n,), dtype, device=device, **dist_kw)
    sl = out.dist.local_slices()[0]
    k = np.arange(sl.start, sl.stop)
    k = np.where(k < (n - 1) // 2 + 1, k, k - n)
    out.local[...] = out.xp.asarray((k * val).astype(dtype, copy=False))
    return out


@collective
def rfftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None,
             **dist_kw: Any) -> DistArray:
    """Sample frequencies of :func:`rfft`, like :func:`numpy.fft.rfftfreq`:
    ``[0, 1, ..., n // 2] / (d * n)`` (layout keywords as :func:`fftfreq`)."""
    n = _check_n(n, "rfftfreq")
    dtype = _freq_dtype(dtype)
    val = 1.0 / (n * d)
    out = creation.empty((n // 2 + 1,), dtype, device=device, **dist_kw)
    sl = out.dist.local_slices()[0]
    out.local[...] = out.xp.asarray((np.arange(sl.start, sl.stop) * val).astype(dtype,
                                                                             copy=False))
    return out


def _shift(x: DistArray, axes: Any, sign: int, name: str) -> DistArray:
    _check_array(x, name)
    if axes is None:
        axes = tuple(range(x.ndim))
    elif isinstance(axes, (int, np.integer)) and not isinstance(axes, (bool, np.bool_)):
        axes = (axes,)
    axes = tuple(axis_index(a, x.ndim) for a in axes)
    if not axes:
        return x.copy()
    return _shape.roll(x, [sign * (x.shape[a] // 2) for a in axes], axes)


@collective
def fftshift(x: DistArray, /, *, axes: int | Sequence[int] | None = None) -> DistArray:
    """Move the zero frequency to the centre, like :func:`numpy.fft.fftshift`.

    A roll by ``n // 2`` along each of ``axes`` (all by default); the
    result keeps ``x``'s distribution and only pieces that cross block
    boundaries move.
    """
    return _shift(x, axes, 1, "fftshift")


@collective
def ifftshift(x: DistArray, /, *, axes: int | Sequence[int] | None = None) -> DistArray:
    """Inverse of :func:`fftshift`, like :func:`numpy.fft.ifftshift` (a roll by
    ``-(n // 2)``)."""
    return _shift(x, axes, -1, "ifftshift")
