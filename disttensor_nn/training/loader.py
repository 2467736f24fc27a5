"""Batches in a deterministic order, the same on every rank (:class:`Loader`), and made
ahead of the step that takes them (:class:`Prefetcher`).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from disttensor import DistArray
from disttensor.backend import as_module, astype

from ..layout import Layout
from .datasets import Dataset

__all__ = ["Loader", "Prefetcher"]


class Loader:
    """Deterministic batches of a data set, identical on every rank.

    Iterating yields ``(x, y)`` for each remaining batch of the current epoch
    (see :meth:`Dataset.batch`) and then moves to the next epoch (so does a
    new iteration that finds the current epoch consumed). The order of
    epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed,
    e])`` (or ``0..n-1`` without shuffling), so every rank, and every rerun,
    sees the same batches. :meth:`state_dict` / :meth:`load_state_dict` save
    and restore the position, e.g. in a checkpoint's ``extra``.

    Parameters
    ----------
    dataset : Dataset
    batch_size : int
    layout : Layout
        How the (N, C, H, W) input batches are split; the targets follow
        ``target_layout`` or the data set's default.
    shuffle : bool
    seed : int
    drop_last : bool
        Drop the last, smaller batch of each epoch.
    target_layout : Layout, optional
        How targets are split (a 4-D layout for spatial targets, a 1-D one
        for labels).
    xp : module, optional
        The array module (e.g. CuPy) the batches are moved to, once per
        batch, after the host has read them (default: they stay NumPy).
    device : optional
        With ``xp`` an array API namespace, the device to put them on.
    dtype : dtype, optional
        The dtype of the input batches (e.g. bfloat16 for a model with 16-bit
        activations: :func:`disttensor_nn.set_precision`), converted from the
        data set's as each batch is loaded; default: the data set's.
    """

    def __init__(self, dataset: Dataset, batch_size: int, layout: Layout, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, *, target_layout: Layout | None = None,
                 xp: ModuleType | None = None, device: Any = None, dtype: Any = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.layout = dataset, int(batch_size), layout
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.target_layout = target_layout
        self.xp, self.device = xp, device
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.epoch = 0
        self.position = 0  # batches of the current epoch already yielded

    def __len__(self) -> int:
        """Number of batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([int(self.seed), int(epoch)]).permutation(n).astype(np.int64)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The sample indices of every batch of ``epoch``."""
        order = self.order(epoch)
        b = self.batch_size
        return [order[i * b:(i + 1) * b] for i in range(len(self))]

    def keep_bytes(self) -> int:
        """Bytes of the blocks this rank holds when the data set keeps every sample's
        (:meth:`Dataset.keep`): each sample's block of the input and of a spatial target in
        this loader's layouts, as made (the data set's dtypes); 0 on a rank that holds no
        sample of a batch."""
        ds = self.dataset
        dist_x = self.layout.distribution((self.batch_size, *ds.sample_shape))
        sl = dist_x.local_slices()
        if sl[0].stop <= sl[0].start:
            return 0
        n = math.prod(s.stop - s.start for s in sl[1:]) * np.dtype(ds.dtype).itemsize
        if self.target_layout is not None:
            dist_y = self.target_layout.distribution((self.batch_size, *ds.target_shape))
            n += math.prod(s.stop - s.start for s in dist_y.local_slices()[1:]) * \
                np.dtype(ds.target_dtype).itemsize
        return len(ds) * n

    def upcoming(self, n: int) -> list[np.ndarray]:
        """The sample indices of the next ``n`` batches from this loader's position (as
        iterating would give them, epoch after epoch), without taking them."""
        out: list[np.ndarray] = []
        epoch, position = self.epoch, self.position
        if len(self) == 0:
            return out
        while len(out) < n:
            if position >= len(self):
                epoch, position = epoch + 1, 0
            batches = self.batches(epoch)
            take = batches[position:position + n - len(out)]
            out += take
            position += len(take)
        return out

    def make_kept(self, batches: Sequence[np.ndarray] | None = None) -> int:
        """Make this rank's blocks now, in this loader's layouts, into the blocks its data
        set keeps (:meth:`Dataset.keep`), so that no step waits for one to be made: of
        every sample, or of the samples this rank holds in ``batches`` (e.g.
        :meth:`upcoming`, the batches a run will take). Returns the number of samples
        made (0 where the data set keeps nothing, or this rank holds no sample of a
        batch).

        A rank holds a batch's slot ``j`` whatever sample lands there, so over
        enough steps each rank needs its block of every sample; made lazily, the
        last of them would wait for many epochs of shuffled batches.
        """
        ds = self.dataset
        if not ds.keep_limit or not self.keep_bytes():
            return 0
        samples: Any = range(len(ds))
        if batches is not None:
            slots = self.layout.distribution((self.batch_size, *ds.sample_shape)) \
                .local_slices()[0]
            samples = sorted({int(i) for b in batches for i in np.asarray(b)[slots]})
        made = 0
        for kind, fill, layout, sample_shape, dtype in (
                ("input", ds._fill_input, self.layout, ds.sample_shape, ds.dtype),
                ("target", ds._fill_target, self.target_layout, ds.target_shape,
                 ds.target_dtype)):
            if layout is None:
                continue
            where = tuple(layout.distribution((self.batch_size, *sample_shape))
                          .local_slices()[1:])
            out = np.empty(tuple(w.stop - w.start for w in where), dtype)
            kept_fill = ds._keeping(kind, fill)
            for sample in samples:
                kept_fill(sample, where, out)
            made = len(samples)
        return made

    def load(self, indices: np.ndarray) -> tuple[DistArray, DistArray | np.ndarray]:
        """The batch of samples ``indices`` in this loader's layouts."""
        dist_x = self.layout.distribution((len(indices), *self.dataset.sample_shape))
        dist_y = None
        if self.target_layout is not None:
            tshape = (len(indices), *self.dataset.target_shape)
            dist_y = self.target_layout.distribution(tshape)
        x, y = self.dataset.batch(indices, dist_x, dist_y)
        if self.dtype is not None and x.dtype != self.dtype:
            x = DistArray(astype(x.local, self.dtype), x.dist)
        if self.xp is None:
            return x, y
        return self._moved(x), self._moved(y) if isinstance(y, DistArray) else y

    def _moved(self, a: DistArray) -> DistArray:
        return DistArray(as_module(a.local, self.xp, self.device), a.dist)

    def __iter__(self) -> Iterator[tuple[DistArray, DistArray | np.ndarray]]:
        if self.position >= len(self):  # the epoch was consumed without exhausting the iterator
            self.epoch, self.position = self.epoch + 1, 0
        batches = self.batches(self.epoch)
        while self.position < len(batches):
            indices = batches[self.position]
            self.position += 1
            yield self.load(indices)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch": ..., "position": ...}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a position from :meth:`state_dict`."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __repr__(self) -> str:
        return (f"Loader({self.dataset!r}, batch_size={self.batch_size}, layout={self.layout}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")


class Prefetcher:
    """Batches of a :class:`Loader` prepared ahead, in a thread, while the caller computes.

    A thread of this process reads or synthesises the next ``depth``
    batches (1 or 2) while the training step runs; :meth:`next` hands them
    out in the loader's order and counts how long the caller waited for one
    (:attr:`waited`, seconds, reset by :meth:`take_wait`). Loading a batch is
    local to each rank (no message), so the thread never meets the step's
    collectives. The batches waiting in the queue are ``depth`` input and
    target blocks more than an unprefetched loop holds (the training driver
    adds them to the plan's baseline).

    :meth:`state_dict` gives the loader's position after the last batch
    handed out, not after those prepared ahead, so a checkpoint resumes at
    the next batch the step would have taken. An exception raised while
    loading is raised again by the :meth:`next` call that would have
    received that batch. :meth:`close` stops the thread (also on garbage
    collection of an unused prefetcher, through the daemon flag).

    Parameters
    ----------
    loader : Loader
    depth : int
        Batches prepared ahead (1 or 2).
    """

    def __init__(self, loader: Loader, depth: int = 1):
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth!r}")
        self.loader, self.depth = loader, depth
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.waited = 0.0
        self._thread = threading.Thread(target=self._run, name="disttensor-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for batch in self.loader:
                    if not self._put((batch, self.loader.state_dict(), None)):
                        return
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # handed to the consumer, raised there
            self._put((None, None, exc))

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> tuple[DistArray, DistArray | np.ndarray]:
        """The next batch (waiting for it if it is not ready yet)."""
        t0 = time.perf_counter()
        batch, state, exc = self._queue.get()
        self.waited += time.perf_counter() - t0
        if exc is not None:
            raise exc
        self._state = state
        return batch

    __next__ = next

    def __iter__(self) -> Prefetcher:
        return self

    def take_wait(self) -> float:
        """Seconds waited for batches since the last call (and reset the count)."""
        w, self.waited = self.waited, 0.0
        return w

    def state_dict(self) -> dict[str, int]:
        """The loader's position after the last batch handed out (:meth:`Loader.state_dict`)."""
        return dict(self._state)

    def close(self) -> None:
        """Stop the thread and drop the batches prepared ahead."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
