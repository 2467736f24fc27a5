"""Synthetic data sets whose every block is a closed-form function of its global
coordinates (sample, channel, y, x) plus counter-based hashes of them (SplitMix64, as in
:mod:`disttensor.random`), so that any split of a batch gives the same values:
:class:`ImageNetSynthetic`, :class:`MeshSynthetic` and :class:`NoiseDataset`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from disttensor.random import splitmix64 as _mix

from .datasets import Dataset, Slices

__all__ = ["ImageNetSynthetic", "MeshSynthetic", "NoiseDataset"]

FIELD_CHUNK = 2**20
"""Bytes of scratch (8 per element) per chunk of channels when a synthetic mesh block is
generated: its float32 temporaries stay under the C allocator's mapping threshold of 1 MiB
(:func:`disttensor_nn.memory.map_large_allocations`), so the heap reuses them, where a
fresh mapping per chunk would fault its pages in every time."""


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


def _range(sl: slice) -> np.ndarray:
    return np.arange(sl.start, sl.stop, dtype=np.int64)


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
