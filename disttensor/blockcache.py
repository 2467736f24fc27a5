"""A cache of large host blocks, reused from one training step to the next.

A training step allocates the same large arrays every time (activations,
gradients, halo-extended inputs, message buffers) and frees them before the
next. Each new large NumPy array is a fresh mapping from the operating
system, so every step pays a page fault per page it writes; on a virtual
machine, or where memory is fragmented and huge pages scarce, that costs more
than the arithmetic of an element-wise pass. A :class:`BlockCache` keeps the
buffers instead and hands them out again by size class: a warm step maps no
new memory.

A block is free again when nothing refers to it: an array from
:meth:`BlockCache.empty` is a view of one of the cache's buffers, and every
array derived from it (slices, reshapes, ``torch.from_numpy``, DLPack
capsules, an MPI request in flight) keeps that buffer referenced, so the
buffer's reference count says exactly when it can be handed out again. No
call gives a block back; dropping the last array does.

The cache holds at most ``limit`` bytes. A request that would pass it first
drops free buffers (the largest first), and if the live ones alone leave no
room it gets memory of its own, not kept after its arrays are gone: the
cache never refuses memory and never holds more than its limit, which is
what a memory model can count. Only blocks of ``min_bytes`` or more are
cached (the C allocator serves small ones well). A request takes the
smallest free buffer at most a quarter larger than its size class, so blocks
of slightly different sizes (uneven splits, halo-extended blocks) share
buffers.

The buffers are anonymous memory maps of their own, not C-heap blocks: a
dropped buffer goes back to the operating system at once, where the C
heap would keep freed blocks of a few MiB resident, and a new one reads as
zeros without being written (:meth:`BlockCache.zeros` does not fill it).

:func:`block_cache` makes a cache the process's active one for a ``with``
block; :func:`disttensor.backend.empty` then takes every large NumPy block
from it, so :meth:`DistArray.empty <disttensor.DistArray.empty>` and the
layers' kernels use it unchanged. Arrays of other modules are untouched
(CuPy and PyTorch keep caching allocators of their own).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BlockCache", "BlockCacheStats", "block_cache", "active_block_cache",
           "size_class"]

_CLASSES_PER_OCTAVE = 8  # size classes per power of two: at most 1/8 of a block is slack


def size_class(nbytes: int) -> int:
    """The capacity of the buffer that serves a request of ``nbytes`` bytes.

    ``nbytes`` rounded up to one of eight steps per power of two, so a buffer
    wastes at most an eighth of its size and requests of slightly different
    sizes (uneven blocks, halo-extended ones) share buffers.
    """
    if nbytes <= _CLASSES_PER_OCTAVE:
        return max(int(nbytes), 1)
    step = 1 << max(int(nbytes).bit_length() - 1 - 3, 0)
    return -(-int(nbytes) // step) * step


def _map(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh anonymous memory as a uint8 array (zero pages, mapped on first
    touch), given back to the operating system as soon as no array refers to it: the C
    heap, which would keep freed blocks of a few MiB resident, never sees it."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def _baseline_refcount() -> int:
    """References a free buffer has while :meth:`BlockCache._take_free` looks at it."""
    probe = [_map(1)]
    for buf in probe:
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


@dataclass
class BlockCacheStats:
    """What a :class:`BlockCache` did: requests served from it and bytes it holds."""

    hits: int = 0
    """Requests served by a buffer the cache already held."""
    misses: int = 0
    """Requests for which the cache mapped a new buffer."""
    evictions: int = 0
    """Free buffers dropped to stay under the limit."""
    overflows: int = 0
    """Requests allocated outside the cache: the live buffers left no room under the limit."""
    held_bytes: int = 0
    """Bytes of the buffers the cache holds now, free or in use."""
    peak_held_bytes: int = 0
    """The most bytes the cache has held at once."""


class BlockCache:
    """Large host blocks reused by size class, bounded by a number of bytes.

    Parameters
    ----------
    limit : int, optional
        Most bytes the cache holds (free and in use together); unbounded when None.
    min_bytes : int
        Smallest request the cache serves; smaller ones are plain ``numpy.empty``.

    Examples
    --------
    >>> import numpy as np
    >>> from disttensor.blockcache import BlockCache
    >>> cache = BlockCache(limit=2**26)
    >>> a = cache.empty((512, 1024), np.float32)
    >>> del a                       # its buffer is free again
    >>> b = cache.empty((512, 1024), np.float32)
    >>> cache.stats.hits, cache.stats.misses
    (1, 1)
    """

    def __init__(self, limit: int | None = None, min_bytes: int = 2**20) -> None:
        for name, v in (("limit", limit), ("min_bytes", min_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative number of bytes, got {v!r}")
        self.limit = limit
        self.min_bytes = max(int(min_bytes), 1)
        self.stats = BlockCacheStats()
        self._by_class: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._free_refs = _baseline_refcount()

    def __repr__(self) -> str:
        s = self.stats
        lim = "unbounded" if self.limit is None else f"limit {self.limit / 2**20:.0f} MiB"
        return (f"BlockCache({lim}, holds {s.held_bytes / 2**20:.1f} MiB, "
                f"{s.hits} hits, {s.misses} misses)")

    # ------------------------------------------------------------ requests
    def empty(self, shape: tuple[int, ...] | int, dtype: Any = np.float64) -> np.ndarray:
        """An uninitialised C-contiguous NumPy array, from a cached buffer where it is large.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : dtype
        """
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        dt = np.dtype(dtype)
        nbytes = dt.itemsize * math.prod(shape)
        if nbytes < self.min_bytes:
            return np.empty(shape, dt)
        return self._array(shape, dt, nbytes)[0]

    def zeros(self, shape: tuple[int, ...] | int, dtype: Any = np.float64) -> np.ndarray:
        """As :meth:`empty`, filled with zeros (a newly mapped buffer is zero already)."""
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        dt = np.dtype(dtype)
        nbytes = dt.itemsize * math.prod(shape)
        if nbytes < self.min_bytes:
            return np.zeros(shape, dt)
        out, fresh = self._array(shape, dt, nbytes)
        if not fresh:
            out.fill(0)
        return out

    def _array(self, shape: tuple[int, ...], dt: np.dtype, nbytes: int
               ) -> tuple[np.ndarray, bool]:
        buf, fresh = self._take(size_class(nbytes))
        return buf[:nbytes].view(dt).reshape(shape), fresh

    def _take(self, cap: int) -> tuple[np.ndarray, bool]:
        """A buffer of at least ``cap`` bytes and whether it was mapped just now (zeros)."""
        s = self.stats
        with self._lock:
            # the smallest free buffer that holds the request without more than a quarter
            # of slack: requests a class or two apart (uneven blocks) share buffers
            for c in sorted(k for k in self._by_class if cap <= k <= cap + cap // 4):
                for buf in self._by_class[c]:
                    if sys.getrefcount(buf) <= self._free_refs:
                        s.hits += 1
                        return buf, False
            if self.limit is not None and s.held_bytes + cap > self.limit:
                self._evict(s.held_bytes + cap - self.limit)
                if s.held_bytes + cap > self.limit:
                    s.overflows += 1
                    return _map(cap), True
            buf = _map(cap)
            self._by_class.setdefault(cap, []).append(buf)
            s.misses += 1
            s.held_bytes += cap
            s.peak_held_bytes = max(s.peak_held_bytes, s.held_bytes)
            return buf, True

    def _evict(self, need: int) -> None:
        """Drop free buffers, the largest first, until ``need`` bytes are given back."""
        s = self.stats
        for cap in sorted(self._by_class, reverse=True):
            held = self._by_class[cap]
            keep = []
            for buf in held:
                if need > 0 and sys.getrefcount(buf) <= self._free_refs:
                    need -= cap
                    s.held_bytes -= cap
                    s.evictions += 1
                else:
                    keep.append(buf)
            held[:] = keep
            if need <= 0:
                return

    # ------------------------------------------------------------ state
    def in_use_bytes(self) -> int:
        """Bytes of the held buffers that some array still refers to."""
        with self._lock:
            return sum(cap for cap, held in self._by_class.items() for buf in held
                       if sys.getrefcount(buf) > self._free_refs)

    def clear(self) -> None:
        """Drop every buffer no array refers to (those in use stay until they are free)."""
        with self._lock:
            self._evict(sys.maxsize)


_active: BlockCache | None = None


def active_block_cache() -> BlockCache | None:
    """The cache :func:`disttensor.backend.empty` takes large NumPy blocks from, if any."""
    return _active


@contextlib.contextmanager
def block_cache(limit: int | None = None, min_bytes: int = 2**20, *,
                cache: BlockCache | None = None) -> Iterator[BlockCache]:
    """Make a :class:`BlockCache` the process's active one inside a ``with`` block.

    Parameters
    ----------
    limit, min_bytes
        As :class:`BlockCache` (ignored when ``cache`` is given).
    cache : BlockCache, optional
        A cache to activate again (its buffers stay warm between blocks).

    Yields
    ------
    BlockCache
        The active cache; the previous one is active again after the block,
        and the free buffers of a cache made here are dropped.
    """
    global _active
    own = cache is None
    cache = BlockCache(limit, min_bytes) if own else cache
    previous, _active = _active, cache
    try:
        yield cache
    finally:
        _active = previous
        if own:
            cache.clear()
