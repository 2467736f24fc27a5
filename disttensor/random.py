"""Counter-based random numbers: the same global array whatever the distribution."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .array import DistArray
from .backend import astype, device_kw, reshape
from .creation import make_distribution
from .settings import collective

__all__ = ["Generator", "default_rng", "splitmix64"]

# Python ints: uint64 arrays of any module combine with them without changing type
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def splitmix64(x: Any, key: int) -> Any:
    """SplitMix64 finaliser of ``x * golden + key``: a stateless 64-bit hash.

    The counter-based generator of this module applies it twice to the
    global index of each element; layers and data sets that need random
    numbers which do not depend on the distribution can hash their own
    counters with it.

    Parameters
    ----------
    x : array of uint64 (any array module) or int
        The counters.
    key : int
        The stream key (a Python int or ``numpy.uint64``).

    Returns
    -------
    array of uint64
        The hash of every counter, of ``x``'s module and shape; the
        multiplications wrap modulo 2**64.
    """
    with np.errstate(over="ignore"):  # wrapping multiplication is the point
        z = x * _GOLDEN + key
        z ^= z >> 30
        z *= _M1
        z ^= z >> 27
        z *= _M2
        z ^= z >> 31
    return z


def _flat_index(out: DistArray) -> Any:
    """Global row-major index of every element of this rank's block (uint64)."""
    xp = out.xp
    shape = out.shape
    place = device_kw(out.local)
    idx = xp.zeros((1,) * len(shape), dtype=xp.uint64, **place)
    stride = 1
    for d in reversed(range(len(shape))):
        sl = out.dist.local_slices()[d]
        r = xp.arange(sl.start, sl.stop, dtype=xp.uint64, **place) * stride
        idx = idx + reshape(r, (1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
        stride *= shape[d]
    return xp.broadcast_to(idx, out.local_shape)


class Generator:
    """Random DistArrays whose values depend only on the seed and the global index.

    Element ``i`` (row-major global index) of the ``k``-th array drawn from a
    generator is a hash of ``(seed, k, i)``, so any distribution of the same
    shape, on any number of ranks, gives the same global array. Every rank
    must make the same sequence of calls. ``xp``/``device`` place the blocks
    as for :func:`disttensor.empty`; the values do not depend on them. The
    hash is SplitMix64's finaliser, applied twice; its streams pass BigCrush,
    which is ample for test data and weight initialisation but not for
    cryptography.

    Parameters
    ----------
    seed : int
        Any non-negative integer.
    """

    def __init__(self, seed: int = 0):
        self._seq = np.random.SeedSequence(seed)
        self._calls = 0

    def __collective_repr__(self) -> str:
        """What check mode compares across ranks: the seed and the arrays drawn so far.

        A generator seeded differently on some rank, or one that has drawn
        another number of arrays there, would give blocks of different global
        arrays; in check mode that raises on every rank
        (:mod:`disttensor.settings`).
        """
        return f"Generator(seed={self._seq.entropy!r}, drawn={self._calls})"

    def _keys(self, n: int) -> list[int]:
        state = np.random.SeedSequence(self._seq.entropy, spawn_key=(self._calls,))
        self._calls += 1
        return [int(k) for k in state.generate_state(n, np.uint64)]

    def _bits(self, out: DistArray, n: int = 1) -> list[Any]:
        idx = _flat_index(out)
        return [splitmix64(splitmix64(idx, k), k) for k in self._keys(n)]

    @collective
    def random(self, shape: Any, dtype: Any = np.float64, *, xp: ModuleType | None = None,
               device: Any = None, **dist_kw: Any) -> DistArray:
        """Uniform floats in ``[0, 1)``, like :meth:`numpy.random.Generator.random`."""
        dtype = np.dtype(dtype)
        out = DistArray.empty(make_distribution(shape, **dist_kw), dtype, xp=xp, device=device)
        (bits,) = self._bits(out)
        out.local[...] = _unit(bits, dtype)
        return out

    @collective
    def uniform(self, low: float = 0.0, high: float = 1.0, shape: Any = (), dtype: Any = np.float64,
                *, xp: ModuleType | None = None, device: Any = None, **dist_kw: Any) -> DistArray:
        """Uniform floats in ``[low, high)``."""
        out = self.random(shape, dtype, xp=xp, device=device, **dist_kw)
        out.local[...] = low + (high - low) * out.local
        return out

    @collective
    def standard_normal(self, shape: Any, dtype: Any = np.float64, *,
                        xp: ModuleType | None = None, device: Any = None,
                        **dist_kw: Any) -> DistArray:
        """Standard normal floats (Box-Muller on two independent hashes)."""
        dtype = np.dtype(dtype)
        out = DistArray.empty(make_distribution(shape, **dist_kw), dtype, xp=xp, device=device)
        b1, b2 = self._bits(out, 2)
        u1 = 1.0 - _unit(b1, np.dtype(np.float64))  # (0, 1]
        u2 = _unit(b2, np.dtype(np.float64))
        xp_ = out.xp
        out.local[...] = astype(xp_.sqrt(-2.0 * xp_.log(u1)) * xp_.cos(2.0 * np.pi * u2),
                                out.dtype)
        return out

    @collective
    def normal(self, loc: float = 0.0, scale: float = 1.0, shape: Any = (),
               dtype: Any = np.float64, *, xp: ModuleType | None = None, device: Any = None,
               **dist_kw: Any) -> DistArray:
        """Normal floats with mean ``loc`` and standard deviation ``scale``."""
        out = self.standard_normal(shape, dtype, xp=xp, device=device, **dist_kw)
        out.local[...] = loc + scale * out.local
        return out

    @collective
    def integers(self, low: int, high: int | None = None, shape: Any = (),
                 dtype: Any = np.int64, *, xp: ModuleType | None = None, device: Any = None,
                 **dist_kw: Any) -> DistArray:
        """Integers in ``[low, high)`` (multiply-shift; bias below ``2**-32`` per value)."""
        if high is None:
            low, high = 0, low
        span = int(high) - int(low)
        if not 0 < span <= 2**32:
            raise ValueError(f"integers needs 0 < high - low <= 2**32, got [{low}, {high})")
        out = DistArray.empty(make_distribution(shape, **dist_kw), np.dtype(dtype), xp=xp,
                              device=device)
        (bits,) = self._bits(out)
        val = ((bits >> 32) * span) >> 32
        out.local[...] = astype(astype(val, np.int64) + int(low), out.dtype)
        return out


def _unit(bits: Any, dtype: np.dtype) -> Any:
    if dtype == np.float32:
        return astype(bits >> 40, np.float32) * 2.0**-24
    return astype(bits >> 11, np.float64) * (2.0**-53)


def default_rng(seed: int = 0) -> Generator:
    """A :class:`Generator` seeded with ``seed``."""
    return Generator(seed)
