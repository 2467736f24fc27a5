"""Data sets and a loader whose batches are generated or read block by block.

Every rank produces only its own block of each batch, as given by the batch
Distribution (``dist.local_slices()``); no rank ever generates or reads a whole
sample, and no communication is needed:

* the synthetic data sets (:class:`ImageNetSynthetic`, :class:`MeshSynthetic`)
  are closed-form functions of ``(sample index, channel, y, x)`` plus
  counter-based hashes of the same global coordinates (SplitMix64, as in
  :mod:`disttensor.random`), so any split of the batch gives the same values;
* :class:`NpyDataset` memory-maps one ``.npy`` file per sample and slices out
  the local block;
* :class:`ArrayDataset` reads the local block of each sample from arrays that
  hold the whole data set, ``(N, C, *spatial)`` inputs and ``(N, C_t, *spatial)`` or
  (N,) targets: HDF5 data sets (hyperslab reads), Zarr arrays (the chunks
  that meet the block) or ``.npy`` memory maps. :func:`open_dataset` opens
  one by its path, once per rank, and :func:`save_dataset` writes one.

A :class:`Loader` turns a data set into a deterministic sequence of batches,
the same on every rank.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution
from disttensor.backend import as_module, astype
from disttensor.io import optional_module
from disttensor.random import splitmix64 as _mix

from ..layout import Layout

__all__ = [
    "ArrayDataset",
    "Dataset",
    "data_problem",
    "ImageNetSynthetic",
    "MeshSynthetic",
    "NoiseDataset",
    "NpyDataset",
    "Loader",
    "Prefetcher",
    "open_dataset",
    "save_dataset",
    "save_npy_dataset",
]

Slices = tuple[slice, ...]

FIELD_CHUNK = 2**20
"""Bytes of scratch (8 per element) per chunk of channels when a synthetic mesh block is
generated: its float32 temporaries stay under the C allocator's mapping threshold of 1 MiB
(:func:`disttensor_nn.memory.map_large_allocations`), so the heap reuses them, where a
fresh mapping per chunk would fault its pages in every time."""


# --------------------------------------------------------------------------- hashing
def _stream_keys(seed: int, tag: int, n: int) -> list[np.uint64]:
    """``n`` independent 64-bit keys for data set ``tag`` and ``seed``."""
    state = np.random.SeedSequence([int(seed), int(tag)]).generate_state(n, np.uint64)
    return [np.uint64(k) for k in state]


def _uniform(counter: Any, key: np.uint64) -> np.ndarray:
    """Uniform floats in ``[0, 1)`` (float64), a pure function of ``(counter, key)``."""
    c = np.asarray(counter, dtype=np.uint64)
    bits = _mix(_mix(c, key), key)
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).astype(np.uint64)


NOISE_PERIOD = 2**16
"""Length of the random sequence whose windows make the synthetic data's noise."""


@functools.lru_cache(maxsize=16)
def _noise_table(key: int, width: int, scale: float) -> np.ndarray:
    """``scale`` times uniform values in ``[-1, 1)`` (float32): :data:`NOISE_PERIOD` +
    ``width`` + 1 of them, a pure function of ``key``; read-only, made once per data set."""
    u = _uniform(np.arange(NOISE_PERIOD + width + 1, dtype=np.uint64), np.uint64(key))
    table = (scale * (2.0 * u - 1.0)).astype(np.float32)
    table.flags.writeable = False
    return table


def _noise_rows(key: np.uint64, sample: int, channels: np.ndarray, ys: np.ndarray, x0: int,
                width: int, shape: tuple[int, int, int], scale: float = 1.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """The noise of :func:`_noise` as ``(windows, offsets)``: ``windows[offsets]`` is the
    noise, ``offsets`` of shape (c, h) (so that a few channels at a time are gathered)."""
    c_n, h_n, w_n = (int(s) for s in shape)
    with np.errstate(over="ignore"):
        rows = (np.uint64(sample) * np.uint64(c_n) + _u64(channels))[:, None] * \
            np.uint64(h_n) + _u64(ys)[None, :]
        offsets = (_mix(rows, key) >> np.uint64(48)).astype(np.intp)  # [0, NOISE_PERIOD)
    table = _noise_table(int(key), w_n, float(scale))
    return np.lib.stride_tricks.sliding_window_view(table[x0:], width), offsets


def _noise(key: np.uint64, sample: int, channels: np.ndarray, ys: np.ndarray, x0: int,
           width: int, shape: tuple[int, int, int], scale: float = 1.0) -> np.ndarray:
    """Uniform noise in ``[-scale, scale)`` (float32) at global ``(sample, channel, y, x)``
    for ``x`` in ``[x0, x0 + width)``, shape (c, h, width); ``x0 + width`` at most one
    past the sample's width.

    Each row ``(sample, channel, y)`` is a window of one random sequence of
    :data:`NOISE_PERIOD` + W values (:func:`_noise_table`), at an offset its
    global index hashes to (SplitMix64): one gather of whole rows, where a hash
    of every element took ten passes over the block.
    """
    windows, offsets = _noise_rows(key, sample, channels, ys, x0, width, shape, scale)
    return windows[offsets]


def _waves(y_factors: np.ndarray, x_factors: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[c, y, x] = sum_k y_factors[y, k] x_factors[c, k, x]`` (float32; ``y_factors``
    may also be ``(c, y, k)``, one per channel), each element the same whatever block of
    ``y`` and ``x`` it is computed in.

    One matrix product per channel (BLAS): its kernels sum the ``k`` terms of
    every element in the same order wherever the element lies, which was
    checked for every block of at least 2 x 2 of several sizes; a block of one
    row or one column would take BLAS's matrix-vector path, which sums in
    another order, so callers compute at least two of each.
    """
    if y_factors.shape[-2] < 2 or x_factors.shape[-1] < 2:
        raise ValueError("blocks of waves are computed at least 2 x 2")
    y_factors = np.ascontiguousarray(y_factors, np.float32)
    return np.matmul(y_factors if y_factors.ndim == 3 else y_factors[None],
                     np.ascontiguousarray(x_factors, np.float32), out=out)


def _span(coords: np.ndarray) -> tuple[int, int, np.ndarray | None]:
    """The smallest run ``[lo, hi)`` of at least two coordinates that holds ``coords``
    (a run of one is extended by one past it), and the positions of ``coords`` in it
    (None: the run is ``coords`` itself)."""
    lo, hi = int(coords.min()), int(coords.max()) + 1
    hi = max(hi, lo + 2)
    if hi - lo == len(coords) and int(coords[0]) == lo and np.all(np.diff(coords) == 1):
        return lo, hi, None
    return lo, hi, coords - lo


def _indices(indices: Any) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise TypeError(f"indices must be a 1-D sequence of integers, got {indices!r}")
    return idx.astype(np.int64)


def _range(sl: slice) -> np.ndarray:
    return np.arange(sl.start, sl.stop, dtype=np.int64)


# --------------------------------------------------------------------------- base class

def _blocks(idx: np.ndarray, dist: Distribution, sample_shape: tuple[int, ...], dtype: Any,
            fill: Callable[[int, Slices, np.ndarray], None], name: str, what: str) -> DistArray:
    """This rank's block of the samples ``idx`` in ``dist``, each written by ``fill(sample,
    where, out)`` into its place in the batch."""
    want = (len(idx), *sample_shape)
    if tuple(dist.global_shape) != want:
        raise ValueError(f"{name} has shape {dist.global_shape}, {what} {want}")
    out = DistArray.empty(dist, dtype)
    sn, *where = dist.local_slices()
    for j, i in enumerate(idx[sn]):
        fill(int(i), tuple(where), out.local[j])
    return out


class Dataset:
    """A data set of ``len(self)`` samples of shape :attr:`sample_shape` = (C, H, W).

    Subclasses implement :meth:`_input_block`, :meth:`_target_block` (spatial
    targets) or :meth:`_labels` (one integer label per sample), and set
    :attr:`sample_shape`, :attr:`target_shape` and :attr:`dtype`.

    Attributes
    ----------
    sample_shape : tuple of int
        (C, H, W) of one input sample.
    target_shape : tuple of int
        Shape of one target: ``()`` for a class label, ``(C_t, H, W)`` for a
        spatial target that is split like the input.
    dtype : numpy.dtype
        Element type of the inputs.
    """

    sample_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    dtype: np.dtype
    target_dtype: np.dtype
    generated: bool = False
    """Whether the blocks are computed from their sample and place alone (synthetic data
    sets), so that :meth:`keep` may keep them."""
    _kept: dict[tuple[str, int, tuple[tuple[int, int], ...]], np.ndarray] | None = None
    _keep_left: int = 0

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def keep(self, nbytes: int) -> None:
        """Keep the blocks this rank makes, up to ``nbytes`` of them, for the next time they
        are asked for (a later epoch copies them instead of computing them again).

        Only for :attr:`generated` data sets (a file's blocks are kept by the
        operating system's page cache instead); blocks beyond ``nbytes`` are
        made each time as before. ``keep(0)`` lets the kept blocks go.

        Raises
        ------
        ValueError
            For a negative ``nbytes``, or a data set that is not generated.
        """
        if not self.generated:
            raise ValueError(f"{type(self).__name__} reads its blocks: only generated data "
                             "sets keep them")
        if int(nbytes) < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        self._kept, self._keep_left = ({} if nbytes else None), int(nbytes)

    @property
    def keep_limit(self) -> int:
        """The bytes :meth:`keep` was given (0: blocks are not kept)."""
        return self._keep_left + self.kept_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes of the blocks :meth:`keep` holds now on this rank."""
        return sum(a.nbytes for a in (self._kept or {}).values())

    def _keeping(self, kind: str, fill: Callable[[int, Slices, np.ndarray], None]
                 ) -> Callable[[int, Slices, np.ndarray], None]:
        """``fill``, through the blocks :meth:`keep` holds (``kind``: input or target)."""
        kept = self._kept
        if kept is None:
            return fill

        def kept_fill(sample: int, where: Slices, out: np.ndarray) -> None:
            key = (kind, sample, tuple((w.start, w.stop) for w in where))
            got = kept.get(key)
            if got is not None:
                out[...] = got
                return
            fill(sample, where, out)
            if out.nbytes <= self._keep_left:
                kept[key] = out.copy()
                self._keep_left -= out.nbytes
        return kept_fill

    def _fill_input(self, sample: int, where: Slices, out: np.ndarray) -> None:
        """Write input block ``where`` of ``sample`` into ``out`` (its place in a batch);
        :meth:`_input_block`'s values, which a data set may write in place instead."""
        out[...] = self._input_block(sample, where)

    def _fill_target(self, sample: int, where: Slices, out: np.ndarray) -> None:
        """As :meth:`_fill_input`, for :meth:`_target_block`."""
        out[...] = self._target_block(sample, where)

    # -- what subclasses provide
    def _input_block(self, sample: int, where: Slices) -> np.ndarray:  # pragma: no cover
        """Block ``where`` = (channels, y, x) slices of input ``sample``."""
        raise NotImplementedError

    def _target_block(self, sample: int, where: Slices) -> np.ndarray:  # pragma: no cover
        """Block ``where`` = (channels, y, x) slices of the spatial target of ``sample``."""
        raise NotImplementedError

    def _labels(self, samples: np.ndarray) -> np.ndarray:  # pragma: no cover
        """Integer labels of ``samples``."""
        raise NotImplementedError

    # -- public API
    @property
    def has_spatial_target(self) -> bool:
        """Whether targets are (C_t, H, W) arrays (True) or integer labels (False)."""
        return len(self.target_shape) > 0

    def _check_index(self, idx: np.ndarray) -> None:
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)}), got "
                             f"[{idx.min()}, {idx.max()}]")

    def target_distribution(self, dist_x: Distribution) -> Distribution | None:
        """Default Distribution of the targets of a batch laid out as ``dist_x``.

        Spatial targets (N, C_t, H, W) are split exactly like the input in N,
        H and W (same grid axes, same block boundaries; the channel dimension
        is not split). Labels return None: they come as a NumPy array that
        every rank holds whole.
        """
        if not self.has_spatial_target:
            return None
        shape = (dist_x.global_shape[0], *self.target_shape)
        axes = list(dist_x.axes)
        axes[1] = None
        splits: list[Any] = list(dist_x.splits)
        splits[1] = None
        return Distribution(shape, dist_x.grid, axes, splits)

    def _inputs(self, idx: np.ndarray, dist_x: Distribution) -> DistArray:
        """This rank's block of the input batch of samples ``idx`` (checked on every rank)."""
        self._check_index(idx)
        return _blocks(idx, dist_x, self.sample_shape, self.dtype,
                       self._keeping("input", self._fill_input), "dist_x", "the batch is")

    def inputs(self, indices: Sequence[int] | np.ndarray, dist_x: Distribution) -> DistArray:
        """The inputs of samples ``indices`` alone, laid out as ``dist_x`` (for inference).

        Each rank reads (or generates) only its own block; no communication.
        """
        return self._inputs(_indices(indices), dist_x)

    def batch(self, indices: Sequence[int] | np.ndarray, dist_x: Distribution,
              dist_y: Distribution | None = None) -> tuple[DistArray, DistArray | np.ndarray]:
        """The batch of samples ``indices``, laid out as ``dist_x``.

        Each rank generates (or reads) only its own block of the inputs and of
        spatial targets; no communication takes place.

        Parameters
        ----------
        indices : sequence of int
            Global sample indices, in batch order (the same on every rank).
        dist_x : Distribution
            Distribution of the (len(indices), C, H, W) input batch, over a
            ProcessGrid; any dimension may be split.
        dist_y : Distribution, optional
            Distribution of the targets: (N, C_t, H, W) for spatial targets
            (default: :meth:`target_distribution`), or (N,) for labels (default:
            labels come as a NumPy int64 array of shape (N,) on every rank).

        Returns
        -------
        x : DistArray
            The inputs.
        y : DistArray or numpy.ndarray
            The targets.

        Raises
        ------
        ValueError
            When a distribution's shape does not match (identically on every rank).
        IndexError
            For a sample index outside the data set.
        """
        idx = _indices(indices)
        x = self._inputs(idx, dist_x)
        if not self.has_spatial_target:
            labels = self._labels(idx)
            if dist_y is None:
                return x, labels
            if tuple(dist_y.global_shape) != (len(idx),):
                raise ValueError(f"dist_y has shape {dist_y.global_shape}, the labels are "
                                 f"{(len(idx),)}")
            return x, DistArray.from_local(labels[dist_y.local_slices()], dist_y)
        if dist_y is None:
            dist_y = self.target_distribution(dist_x)
        y = _blocks(idx, dist_y, self.target_shape, self.target_dtype,
                    self._keeping("target", self._fill_target), "dist_y", "the targets are")
        return x, y

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One whole sample ``(x, y)`` as NumPy arrays, on this rank alone.

        Meant for writing data sets to disk and for tests; training uses
        :meth:`batch`, which never builds a whole sample.
        """
        idx = np.array([index], dtype=np.int64)
        self._check_index(idx)
        full = tuple(slice(0, n) for n in self.sample_shape)
        x = self._input_block(int(index), full)
        if not self.has_spatial_target:
            return x, np.asarray(self._labels(idx)[0])
        return x, self._target_block(int(index), tuple(slice(0, n) for n in self.target_shape))


# --------------------------------------------------------------------------- synthetic
class ImageNetSynthetic(Dataset):
    """ImageNet-shaped synthetic images: (3, H, W) float inputs and integer labels.

    Sample ``i`` has label ``hash(seed, i) mod num_classes``; each channel of
    its image is a plane wave whose frequency and phase depend on the label
    and the channel, plus uniform noise at the global coordinates ``(i, c, y, x)``
    (each row ``(i, c, y)`` a window of one random sequence, at an offset hashed
    from the row's index)::

        x[c, y, x] = 0.5 sin(2 pi (fy y / H + fx x / W) + phi) + 0.5 u,   u in [-1, 1)

    so a network can learn the labels, and every element is a closed-form
    function of its global index.

    Parameters
    ----------
    num_samples : int
        Size of the data set.
    image_size : int or (int, int)
        H and W (224 as ImageNet by default).
    num_classes : int
        Number of classes (1000 by default).
    seed : int
        Selects the data set; every rank must use the same.
    dtype : dtype
        Input element type (float32 by default).
    """

    channels = 3

    generated = True

    def __init__(self, num_samples: int, image_size: int | tuple[int, int] = 224,
                 num_classes: int = 1000, seed: int = 0, dtype: Any = np.float32):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if not 0 < num_classes <= 2**32:
            raise ValueError(f"num_classes must lie in [1, 2**32], got {num_classes}")
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.num_samples, self.num_classes, self.seed = int(num_samples), int(num_classes), seed
        self.sample_shape = (self.channels, int(h), int(w))
        self.target_shape = ()
        self.dtype = np.dtype(dtype)
        self.target_dtype = np.dtype(np.int64)
        self._k_label, self._k_wave, self._k_noise = _stream_keys(seed, 1, 3)

    def __len__(self) -> int:
        return self.num_samples

    def _labels(self, samples: np.ndarray) -> np.ndarray:
        bits = _mix(_mix(_u64(samples), self._k_label), self._k_label)
        with np.errstate(over="ignore"):
            val = ((bits >> np.uint64(32)) * np.uint64(self.num_classes)) >> np.uint64(32)
        return val.astype(np.int64)

    def _input_block(self, sample: int, where: Slices) -> np.ndarray:
        sc, sh, sw = where
        cs, ys, xs = _range(sc), _range(sh), _range(sw)
        _, h, w = self.sample_shape
        label = int(self._labels(np.array([sample]))[0])
        # per (label, channel): fy, fx in +-[0.5, 4) cycles per image, phase in [0, 2 pi)
        counter = (np.uint64(label) * np.uint64(self.channels) + _u64(cs))[:, None] * \
            np.uint64(4) + np.arange(4, dtype=np.uint64)[None, :]
        u = _uniform(counter, self._k_wave)
        sign = np.where(u[:, 3] < 0.5, -1.0, 1.0)
        fy, fx, phi = 0.5 + 3.5 * u[:, 0], sign * (0.5 + 3.5 * u[:, 1]), 2 * np.pi * u[:, 2]
        out = np.empty((len(cs), len(ys), len(xs)), np.float32)
        if not out.size:
            return out.astype(self.dtype)
        y0, y1, ysel = _span(ys)
        x0, x1, xsel = _span(xs)
        yr, xr = np.arange(y0, y1), np.arange(x0, x1)
        ay = 2 * np.pi * fy[:, None] * yr[None, :] / h                     # (c, h)
        bx = 2 * np.pi * fx[:, None] * xr[None, :] / w + phi[:, None]      # (c, w)
        # 0.5 sin(ay + bx) + 0.5 noise
        acc = _waves(np.stack([np.sin(ay), np.cos(ay)], axis=2),
                     0.5 * np.stack([np.cos(bx), np.sin(bx)], axis=1),
                     np.empty((len(cs), len(yr), len(xr)), np.float32))
        acc += _noise(self._k_noise, sample, cs, yr, x0, len(xr), self.sample_shape, 0.5)
        if ysel is not None:
            acc = acc[:, ysel]
        out[...] = acc if xsel is None else acc[:, :, xsel]
        return out.astype(self.dtype, copy=False)

    def __repr__(self) -> str:
        return (f"ImageNetSynthetic({self.num_samples}, image_size={self.sample_shape[1:]}, "
                f"num_classes={self.num_classes}, seed={self.seed})")


class MeshSynthetic(Dataset):
    """Mesh-like synthetic fields: (C, H, W) inputs and a (1, H, W) mask learnable from them.

    Every channel of sample ``i`` is a random mix of a few smooth plane waves
    shared by the channels of that sample (``modes`` waves with wave numbers
    of up to 3 cycles per image), scaled to unit variance, plus a little
    uniform noise at ``(i, c, y, x)`` (each row a window of one random
    sequence, at an offset hashed from the row's index). The target is the majority
    vote of ``x[0] + x[1] > 0`` over the 3x3 neighbourhood of each pixel (the
    image edge replicated), i.e. a blurred and re-thresholded sign of the sum
    of the first two channels, computed in the input dtype from the very
    values of the input, so a small CNN can learn it exactly.

    The mask of a block needs the two channels over the block plus a one-pixel
    margin; that margin is generated from its global coordinates too, so no
    communication is needed.

    Parameters
    ----------
    num_samples : int
        Size of the data set.
    size : (int, int)
        H and W.
    channels : int
        Number of input channels C (at least 2).
    seed : int
        Selects the data set; every rank must use the same.
    modes : int
        Number of plane waves per sample.
    noise : float
        Amplitude of the uniform noise.
    dtype : dtype
        Element type of inputs and mask (float32 by default).
    """

    generated = True

    def __init__(self, num_samples: int, size: tuple[int, int] = (256, 256), channels: int = 18,
                 seed: int = 0, *, modes: int = 4, noise: float = 0.05,
                 dtype: Any = np.float32):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if channels < 2:
            raise ValueError(f"the mask needs at least 2 channels, got {channels}")
        if modes < 1:
            raise ValueError(f"modes must be >= 1, got {modes}")
        h, w = (size, size) if isinstance(size, int) else size
        self.num_samples, self.seed, self.modes, self.noise = int(num_samples), seed, modes, noise
        self.sample_shape = (int(channels), int(h), int(w))
        self.target_shape = (1, int(h), int(w))
        self.dtype = self.target_dtype = np.dtype(dtype)
        self._k_params, self._k_noise = _stream_keys(seed, 2, 2)

    def __len__(self) -> int:
        return self.num_samples

    def _params(self, sample: int) -> tuple[np.ndarray, ...]:
        """Wave numbers (K,), (K,) and per-channel amplitudes and phases (C, K), (C, K)."""
        c, k = self.sample_shape[0], self.modes
        n = 2 * k + 2 * c * k
        u = _uniform(np.uint64(sample) * np.uint64(n) + np.arange(n, dtype=np.uint64),
                     self._k_params)
        fy, fx = 6.0 * u[:k] - 3.0, 6.0 * u[k:2 * k] - 3.0
        amp = (2.0 * u[2 * k:2 * k + c * k] - 1.0).reshape(c, k) * math.sqrt(6.0 / k)
        phase = 2 * np.pi * u[2 * k + c * k:].reshape(c, k)
        return fy, fx, amp, phase

    def _fields(self, sample: int, cs: np.ndarray, ys: np.ndarray, xs: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
        """Input values at the global coordinates ``cs x ys x xs`` (any integer arrays),
        written into ``out`` where given.

        Each wave ``a sin(ay + bx)`` is ``sin(ay) (a cos bx) + cos(ay) (a sin bx)``:
        factors of y and of (channel, x) in float64, rounded to float32 and
        summed by one matrix product per channel (:func:`_waves`, the same
        values whatever the block), over the run of rows and columns that holds
        ``ys`` and ``xs``, a few channels at a time; then the noise.
        """
        _, h, w = self.sample_shape
        if out is None:
            out = np.empty((len(cs), len(ys), len(xs)), self.dtype)
        if not out.size:
            return out
        fy, fx, amp, phase = self._params(sample)
        y0, y1, ysel = _span(ys)
        x0, x1, xsel = _span(xs)
        yr, xr = np.arange(y0, y1), np.arange(x0, x1)
        ay = 2 * np.pi * fy[None, :] * yr[:, None] / h                           # (h, K)
        y_factors = np.concatenate([np.sin(ay), np.cos(ay)], axis=1).astype(np.float32)
        in_place = ysel is None and xsel is None and out.dtype == np.float32 and \
            out.flags.c_contiguous
        bx = 2 * np.pi * fx[None, :, None] * xr[None, None, :] / w + phase[cs][:, :, None]
        a = amp[cs][:, :, None]                                                   # (c, K, w)
        x_factors = np.concatenate([a * np.cos(bx), a * np.sin(bx)], axis=1)      # (c, 2K, w)
        x_factors = x_factors.astype(np.float32)
        if self.noise:
            windows, offsets = _noise_rows(self._k_noise, sample, cs, yr, x0, len(xr),
                                           self.sample_shape, self.noise)
        # a few channels at a time, so that the scratch stays near FIELD_CHUNK bytes
        # whatever the block (a whole 1024 x 1024 sample would need several GiB of it)
        step = max(1, FIELD_CHUNK // max(8 * len(yr) * len(xr), 1))
        for c0 in range(0, len(cs), step):
            acc = out[c0:c0 + step] if in_place else \
                np.empty((len(cs[c0:c0 + step]), len(yr), len(xr)), np.float32)
            _waves(y_factors, x_factors[c0:c0 + step], acc)
            if self.noise:
                acc += windows[offsets[c0:c0 + step]]
            if not in_place:
                if ysel is not None:
                    acc = acc[:, ysel]
                out[c0:c0 + step] = acc if xsel is None else acc[:, :, xsel]
        return out

    def _input_block(self, sample: int, where: Slices) -> np.ndarray:
        sc, sh, sw = where
        return self._fields(sample, _range(sc), _range(sh), _range(sw))

    def _fill_input(self, sample: int, where: Slices, out: np.ndarray) -> None:
        sc, sh, sw = where
        self._fields(sample, _range(sc), _range(sh), _range(sw), out)

    def _target_block(self, sample: int, where: Slices) -> np.ndarray:
        _, sh, sw = where
        _, h, w = self.sample_shape
        # the block and a one-pixel margin, the image's edge replicated
        y0, y1, x0, x1 = max(sh.start - 1, 0), min(sh.stop + 1, h), max(sw.start - 1, 0), \
            min(sw.stop + 1, w)
        f = self._fields(sample, np.array([0, 1]), np.arange(y0, y1), np.arange(x0, x1))
        s = np.greater(f[0] + f[1], 0).view(np.int8)
        s = np.pad(s, ((y0 - sh.start + 1, sh.stop + 1 - y1), (x0 - sw.start + 1,
                                                                sw.stop + 1 - x1)), mode="edge")
        bh, bw = sh.stop - sh.start, sw.stop - sw.start
        rows = s[0:bh] + s[1:bh + 1] + s[2:bh + 2]              # votes of 3 rows, then of
        votes = rows[:, 0:bw] + rows[:, 1:bw + 1] + rows[:, 2:bw + 2]  # 3 columns: at most 9
        return (votes >= 5).astype(self.dtype)[None]

    def __repr__(self) -> str:
        return (f"MeshSynthetic({self.num_samples}, size={self.sample_shape[1:]}, "
                f"channels={self.sample_shape[0]}, seed={self.seed})")


# --------------------------------------------------------------------------- .npy files
class NoiseDataset(Dataset):
    """Uniform noise in ``[-1, 1)`` of any sample and target shape, for any model.

    Every input and target element is a SplitMix64 hash of its global index
    ``(sample, *coordinates)`` and of the seed, so any split of a batch gives
    the same values and no rank generates more than its block. The data set of
    a model the registry does not know (``disttensor-train --model-file``):
    inputs of the model's input shape, targets of its output shape.

    Parameters
    ----------
    num_samples : int
        Size of the data set.
    sample_shape : tuple of int
        ``(C, *spatial)`` of one input.
    target_shape : tuple of int
        The shape of one target (any, e.g. the model's output per sample).
    seed : int
        Selects the data set; every rank must use the same.
    dtype : dtype
        Element type of inputs and targets (float32 by default).
    """

    generated = True

    def __init__(self, num_samples: int, sample_shape: Sequence[int],
                 target_shape: Sequence[int], seed: int = 0, dtype: Any = np.float32):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples, self.seed = int(num_samples), seed
        self.sample_shape = tuple(int(n) for n in sample_shape)
        self.target_shape = tuple(int(n) for n in target_shape)
        if not self.target_shape:
            raise ValueError("NoiseDataset: the targets need a shape (C_t, ...), got ()")
        self.dtype = self.target_dtype = np.dtype(dtype)
        self._k_input, self._k_target = _stream_keys(seed, 4, 2)

    def __len__(self) -> int:
        return self.num_samples

    @staticmethod
    def _block(key: np.uint64, sample: int, where: Slices, shape: tuple[int, ...],
               dtype: np.dtype) -> np.ndarray:
        with np.errstate(over="ignore"):
            counter = np.uint64(sample)
            for sl, n in zip(where, shape):
                counter = counter * np.uint64(n)
                counter = np.expand_dims(counter, -1) + _u64(_range(sl))
        bits = _mix(_mix(counter, key), key)
        return ((bits >> np.uint64(11)).astype(np.float64) * (2.0**-52) - 1.0).astype(dtype)

    def _input_block(self, sample: int, where: Slices) -> np.ndarray:
        return self._block(self._k_input, sample, where, self.sample_shape, self.dtype)

    def _target_block(self, sample: int, where: Slices) -> np.ndarray:
        return self._block(self._k_target, sample, where, self.target_shape, self.target_dtype)

    def __repr__(self) -> str:
        return (f"NoiseDataset({self.num_samples}, sample_shape={self.sample_shape}, "
                f"target_shape={self.target_shape}, seed={self.seed})")


def _npy_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) from the header of a .npy file, reading nothing else."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
        raise ValueError(f"{path}: unsupported .npy format version {version}")


class NpyDataset(Dataset):
    """Samples stored as one ``.npy`` file each, read block by block through memory maps.

    Every input file holds one (C, H, W) sample; an optional target file per
    sample holds either a (C_t, H, W) spatial target (read block by block too)
    or a 0-d integer label. :meth:`batch` opens each file of a local sample
    with ``numpy.load(mmap_mode="r")`` and copies out only this rank's block.

    Parameters
    ----------
    directory_or_files : path or sequence of paths
        A directory written by :func:`save_npy_dataset` (files
        ``sample_*.npy`` and, if present, ``target_*.npy``, in sorted order),
        or the list of input files.
    target_files : sequence of paths, optional
        With a list of input files: one target file per sample.
    validate : bool
        Read every file's header now and check that shapes and dtypes agree
        (only the headers are read). Errors are raised identically on every
        rank when all ranks see the same files.

    Raises
    ------
    FileNotFoundError
        When the directory holds no samples.
    ValueError
        For mismatched shapes, dtypes or file counts.
    """

    def __init__(self, directory_or_files: str | os.PathLike | Sequence[str | os.PathLike],
                 target_files: Sequence[str | os.PathLike] | None = None, *,
                 validate: bool = True):
        if isinstance(directory_or_files, (str, os.PathLike)):
            directory = os.fspath(directory_or_files)
            files = sorted(glob.glob(os.path.join(glob.escape(directory), "sample_*.npy")))
            if not files:
                raise FileNotFoundError(f"no sample_*.npy files in {directory}")
            if target_files is None:
                targets = [os.path.join(directory, "target_" + os.path.basename(f)[7:])
                           for f in files]
                present = [os.path.exists(t) for t in targets]
                if any(present) and not all(present):
                    missing = [t for t, p in zip(targets, present) if not p]
                    raise ValueError(f"{len(missing)} target files are missing, e.g. "
                                     f"{missing[0]}")
                target_files = targets if all(present) else None
        else:
            files = [os.fspath(f) for f in directory_or_files]
        self.files = files
        self.target_files = None if target_files is None else [os.fspath(t) for t in target_files]
        if self.target_files is not None and len(self.target_files) != len(files):
            raise ValueError(f"{len(files)} input files but {len(self.target_files)} targets")
        if not files:
            raise ValueError("a NpyDataset needs at least one sample")
        shape, _, dtype = _npy_header(files[0])
        if len(shape) != 3:
            raise ValueError(f"{files[0]}: samples must be (C, H, W), got shape {shape}")
        self.sample_shape, self.dtype = tuple(shape), np.dtype(dtype).newbyteorder("=")
        self.target_shape, self.target_dtype = (), np.dtype(np.int64)
        if self.target_files is not None:
            tshape, _, tdtype = _npy_header(self.target_files[0])
            if tshape and (len(tshape) != 3 or tuple(tshape[1:]) != self.sample_shape[1:]):
                raise ValueError(f"{self.target_files[0]}: targets must be labels (0-d) or "
                                 f"(C_t, {shape[1]}, {shape[2]}), got {tshape}")
            self.target_shape, self.target_dtype = tuple(tshape), np.dtype(tdtype).newbyteorder(
                "=")
        if validate:
            self._validate()

    def _validate(self) -> None:
        checks = [(self.files, self.sample_shape, self.dtype)]
        if self.target_files is not None:
            checks.append((self.target_files, self.target_shape, self.target_dtype))
        for files, shape, dtype in checks:
            for f in files:
                s, _, d = _npy_header(f)
                if tuple(s) != shape or np.dtype(d).newbyteorder("=") != dtype:
                    raise ValueError(f"{f} holds {np.dtype(d)} {tuple(s)}, expected {dtype} "
                                     f"{shape} like {files[0]}")

    def __len__(self) -> int:
        return len(self.files)

    def _input_block(self, sample: int, where: Slices) -> np.ndarray:
        return np.load(self.files[sample], mmap_mode="r")[where]

    def _target_block(self, sample: int, where: Slices) -> np.ndarray:
        return np.load(self.target_files[sample], mmap_mode="r")[where]

    def _labels(self, samples: np.ndarray) -> np.ndarray:
        if self.target_files is None:
            raise ValueError("this NpyDataset has no target files")
        return np.array([np.load(self.target_files[i], mmap_mode="r")[()] for i in samples],
                        dtype=np.int64).reshape(len(samples))

    def batch(self, indices: Sequence[int] | np.ndarray, dist_x: Distribution,
              dist_y: Distribution | None = None) -> tuple[DistArray, DistArray | np.ndarray]:
        """As :meth:`Dataset.batch`; ``y`` is None when there are no target files."""
        if self.target_files is not None:
            return super().batch(indices, dist_x, dist_y)
        return self._inputs(_indices(indices), dist_x), None

    def __repr__(self) -> str:
        return f"NpyDataset({len(self)} samples of {self.dtype} {self.sample_shape})"


def _save_npy(path: str, array: np.ndarray) -> None:
    """``numpy.save`` to a temporary file next to ``path``, then renamed into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(array), allow_pickle=False)
    os.replace(tmp, path)


def save_npy_dataset(directory: str | os.PathLike, dataset: Dataset,
                     indices: Sequence[int] | np.ndarray | None = None,
                     comm: MPI.Comm | None = None) -> list[str]:
    """Write samples of ``dataset`` as one ``.npy`` file each, for :class:`NpyDataset`.

    Sample ``indices[k]`` goes to ``sample_{k:06d}.npy`` and its target to
    ``target_{k:06d}.npy``. Collective over ``comm``: rank ``r`` writes the
    samples ``k`` with ``k % size == r`` (each a whole sample, built on that
    rank), then all ranks wait for each other. Files are written under a
    temporary name and renamed, so a file that exists is complete.

    Parameters
    ----------
    directory : path
        Created if missing.
    dataset : Dataset
        The data set to write (its :meth:`Dataset.sample`).
    indices : sequence of int, optional
        The samples to write, all by default.
    comm : mpi4py.MPI.Comm, optional
        ``MPI.COMM_WORLD`` by default.

    Returns
    -------
    list of str
        The sample files, in order.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    directory = os.fspath(directory)
    idx = _indices(np.arange(len(dataset)) if indices is None else indices)
    paths = [os.path.join(directory, f"sample_{k:06d}.npy") for k in range(len(idx))]
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        for k in range(comm.Get_rank(), len(idx), comm.Get_size()):
            x, y = dataset.sample(int(idx[k]))
            _save_npy(paths[k], x)
            _save_npy(os.path.join(directory, f"target_{k:06d}.npy"), y)
    except Exception as exc:  # agree on failure so no rank waits forever
        error = f"{type(exc).__name__}: {exc}"
    errors = [(r, e) for r, e in enumerate(comm.allgather(error)) if e is not None]
    if errors:
        raise OSError("save_npy_dataset failed: " + "; ".join(f"rank {r}: {e}" for r, e in errors))
    return paths


# --------------------------------------------------------------------------- array files
class ArrayDataset(Dataset):
    """A data set held in two arrays: inputs ``(N, C, *spatial)`` and targets, read by block.

    The arrays are anything that NumPy-style basic slicing reads from: an
    h5py Dataset (a hyperslab read), a zarr Array (the chunks that meet the
    slices) or a ``numpy.memmap``. :meth:`batch` reads, for every sample of
    this rank's part of the batch, only this rank's block; nothing is read
    when the data set is made but the arrays' shapes and dtypes.
    :func:`open_dataset` makes one from a file's path.

    Parameters
    ----------
    inputs : array-like
        ``(N, C, *spatial)`` inputs.
    targets : array-like, optional
        ``(N, C_t, *spatial)`` spatial targets, split like the inputs, or (N,)
        integer labels (read whole by every rank). None: no targets.
    source : str
        A name for messages (the file's path).

    Attributes
    ----------
    input_array, target_array : array-like
        The arrays (``target_array`` None without targets).

    Raises
    ------
    ValueError
        For arrays whose shapes do not fit together.
    """

    def __init__(self, inputs: Any, targets: Any = None, *, source: str = "arrays"):
        shape = tuple(int(n) for n in inputs.shape)
        if len(shape) < 3:
            raise ValueError(f"{source}: inputs must be (N, C, *spatial), got shape {shape}")
        self.input_array, self.target_array, self.source = inputs, targets, source
        self.sample_shape, self.dtype = shape[1:], np.dtype(inputs.dtype).newbyteorder("=")
        self.target_shape, self.target_dtype = (), np.dtype(np.int64)
        if targets is not None:
            tshape = tuple(int(n) for n in targets.shape)
            if tshape[:1] != shape[:1]:
                raise ValueError(f"{source}: {shape[0]} inputs but targets of shape {tshape}")
            if len(tshape) > 1 and (len(tshape) != len(shape) or tshape[2:] != shape[2:]):
                raise ValueError(f"{source}: targets must be (N,) labels or (N, C_t, "
                                 f"{', '.join(map(str, shape[2:]))}), got {tshape}")
            self.target_shape = tshape[1:]
            if self.target_shape:
                self.target_dtype = np.dtype(targets.dtype).newbyteorder("=")

    def __len__(self) -> int:
        return int(self.input_array.shape[0])

    def _input_block(self, sample: int, where: Slices) -> np.ndarray:
        return np.asarray(self.input_array[(sample, *where)])

    def _target_block(self, sample: int, where: Slices) -> np.ndarray:
        return np.asarray(self.target_array[(sample, *where)])

    def _labels(self, samples: np.ndarray) -> np.ndarray:
        if self.target_array is None:
            raise ValueError(f"{self.source} has no targets")
        return np.array([self.target_array[int(i)] for i in samples], dtype=np.int64)

    def batch(self, indices: Sequence[int] | np.ndarray, dist_x: Distribution,
              dist_y: Distribution | None = None) -> tuple[DistArray, DistArray | np.ndarray]:
        """As :meth:`Dataset.batch`; ``y`` is None when there are no targets."""
        if self.target_array is not None:
            return super().batch(indices, dist_x, dist_y)
        return self._inputs(_indices(indices), dist_x), None

    def __repr__(self) -> str:
        return f"ArrayDataset({self.source}: {len(self)} samples of {self.dtype} " \
               f"{self.sample_shape})"


HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")


def _format(path: str) -> str:
    """'hdf5', 'zarr', 'npy' (a file, or a directory of input.npy/target.npy) or 'npy-dir'."""
    if path.lower().endswith(HDF5_SUFFIXES):
        return "hdf5"
    if path.rstrip("/").lower().endswith(".zarr") or os.path.exists(
            os.path.join(path, "zarr.json")):
        return "zarr"
    if os.path.isdir(path) and glob.glob(os.path.join(glob.escape(path), "sample_*.npy")):
        return "npy-dir"
    if path.lower().endswith(".npy") or os.path.isdir(path):
        return "npy"
    raise ValueError(f"{path}: not a data set this reader knows (an HDF5 file {HDF5_SUFFIXES}, "
                     "a Zarr store, a directory of sample_*.npy or of NAME.npy arrays)")


def data_problem(path: str | os.PathLike) -> str | None:
    """What makes ``path`` unreadable as a data set (no such path, unknown format), or None."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return "no such file or directory"
    try:
        _format(path)
    except ValueError as exc:
        return str(exc).split(": ", 1)[1]
    return None


def open_dataset(path: str | os.PathLike, input: str = "input",
                 target: str | None = "target") -> Dataset:
    """Open a data set file by its path, once; batches then read only this rank's blocks.

    The format comes from the path:

    * ``*.h5``, ``*.hdf5``: an HDF5 file with data sets ``input`` and ``target``
      (read with h5py; no parallel HDF5 needed);
    * ``*.zarr`` (or a directory holding ``zarr.json``): a Zarr group with
      arrays ``input`` and ``target``;
    * a directory of ``sample_*.npy`` files: :class:`NpyDataset`;
    * a directory holding ``INPUT.npy`` and ``TARGET.npy``: memory maps of the two.

    Parameters
    ----------
    path : path
        The file or directory (the same on every rank).
    input, target : str
        Names of the input and target arrays in the file (``target=None``,
        or a file without it: no targets).

    Returns
    -------
    Dataset

    Raises
    ------
    FileNotFoundError
        When the path or the input array does not exist.
    ImportError
        Without h5py or zarr for those formats (``pip install disttensor[data]``).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no data set at {path}")
    kind = _format(path)
    if kind == "npy-dir":
        return NpyDataset(path)
    if kind == "hdf5":
        group = optional_module("h5py").File(path, "r")
        names = set(group.keys())
    elif kind == "zarr":
        group = optional_module("zarr").open_group(store=path, mode="r")
        names = set(group.array_keys())
    else:
        group = {os.path.basename(f)[:-4]: f for f in
                 glob.glob(os.path.join(glob.escape(path), "*.npy"))}
        names = set(group)
    if input not in names:
        raise FileNotFoundError(f"{path} holds no input array {input!r} (it has "
                                f"{sorted(names)}; choose it with --data-input)")
    if kind == "npy":
        inputs = np.load(group[input], mmap_mode="r")
        targets = np.load(group[target], mmap_mode="r") if target in names else None
    else:
        inputs = group[input]
        targets = group[target] if target in names else None
    return ArrayDataset(inputs, targets, source=path)


def save_dataset(path: str | os.PathLike, dataset: Dataset, input: str = "input",
                 target: str = "target", *, chunks: Sequence[int] | None = None,
                 comm: MPI.Comm | None = None) -> None:
    """Write a data set to one HDF5 file or Zarr store, for :func:`open_dataset`.

    Collective over ``comm``. Both formats store the arrays in chunks of one
    sample, all channels and ``chunks`` (default 64) elements along each
    spatial dimension, so that a rank's block of a sample is read as the few
    chunks that meet it; labels are one chunk. HDF5 (``*.h5``, ``*.hdf5``):
    rank 0 writes every sample (h5py without parallel HDF5 has one writer).
    Zarr (any other path, ``*.zarr`` by convention): rank ``r`` writes the
    samples ``k`` with ``k % size == r``, and rank 0 the labels. Each sample
    is built whole on its writer (:meth:`Dataset.sample`).

    Parameters
    ----------
    path : path
        Where to write (replaced if it exists).
    dataset : Dataset
    input, target : str
        Names of the arrays.
    chunks : sequence of int, optional
        Chunk extent along each spatial dimension.
    comm : mpi4py.MPI.Comm, optional
        ``MPI.COMM_WORLD`` by default.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    path = os.fspath(path)
    n = len(dataset)
    xshape, tshape = (n, *dataset.sample_shape), (n, *dataset.target_shape)
    rank, size = comm.Get_rank(), comm.Get_size()
    spatial = dataset.sample_shape[1:]
    tile = tuple(int(t) for t in chunks) if chunks is not None else (64,) * len(spatial)
    if len(tile) != len(spatial) or min(tile, default=1) < 1:
        raise ValueError(f"chunks needs {len(spatial)} positive spatial extents, got {tile}")
    block = (1, *(min(t, m) for t, m in zip(tile, spatial)))
    xchunks = (1, xshape[1], *block[1:])
    tchunks = (1, *tshape[1:2], *block[1:]) if dataset.target_shape else (max(n, 1),)
    if path.lower().endswith(HDF5_SUFFIXES):
        def write_hdf5() -> None:
            if rank == 0:
                with optional_module("h5py").File(path, "w") as f:
                    x = f.create_dataset(input, xshape, dataset.dtype, chunks=xchunks)
                    y = f.create_dataset(target, tshape, dataset.target_dtype,
                                         chunks=tchunks if n else None)
                    for k in range(n):
                        x[k], y[k] = dataset.sample(k)
        _together(comm, write_hdf5)
        return
    zarr = optional_module("zarr")

    def create() -> None:
        if rank == 0:
            group = zarr.open_group(store=path, mode="w")
            group.create_array(input, shape=xshape, dtype=dataset.dtype, chunks=xchunks)
            group.create_array(target, shape=tshape, dtype=dataset.target_dtype,
                               chunks=tchunks)
            if not dataset.target_shape:
                group[target][:] = dataset._labels(np.arange(n, dtype=np.int64))

    def write() -> None:
        group = zarr.open_group(store=path, mode="r+")
        for k in range(rank, n, size):
            x, y = dataset.sample(k)
            group[input][k] = x
            if dataset.target_shape:
                group[target][k] = y
    _together(comm, create)
    _together(comm, write)


def _together(comm: MPI.Comm, work: Callable[[], None]) -> None:
    """Run ``work`` on every rank; raise one OSError on all ranks if it failed on any."""
    error = None
    try:
        work()
    except Exception as exc:  # agree on failure so no rank waits forever
        error = f"{type(exc).__name__}: {exc}"
    errors = [(r, e) for r, e in enumerate(comm.allgather(error)) if e is not None]
    if errors:
        raise OSError("save_dataset failed: " + "; ".join(f"rank {r}: {e}" for r, e in errors))


# --------------------------------------------------------------------------- loader
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
