"""Learnable synthetic N-D data sets for segmentation (U-Nets) and regression (CosmoFlow).

Values are functions of the global coordinates, so each rank generates only
its block of every sample, for any split, with no communication (as the
2-D data sets of :mod:`~disttensor_nn.training.data`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from disttensor.random import splitmix64

from .data import Dataset

__all__ = ["SegmentationSynthetic", "CosmoSynthetic"]


def _keys(seed: int, tag: int, n: int) -> list[np.uint64]:
    state = np.random.SeedSequence([int(seed), int(tag)]).generate_state(n, np.uint64)
    return [np.uint64(k) for k in state]


def _uniform(counter: Any, key: np.uint64) -> np.ndarray:
    """Uniform floats in [0, 1), a pure function of ``(counter, key)``."""
    bits = splitmix64(splitmix64(np.asarray(counter, dtype=np.uint64), key), key)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


class _Fields:
    """Smooth random fields in N-D: per sample and channel a sum of ``modes`` plane waves
    (up to 3 cycles per side, unit variance), plus uniform noise hashed from the position."""

    def __init__(self, shape: tuple[int, ...], seed: int, tag: int, modes: int, noise: float):
        self.shape, self.modes, self.noise = shape, modes, noise  # shape = (C, *S)
        self.k_params, self.k_noise = _keys(seed, tag, 2)

    def values(self, sample: int, where: tuple[slice, ...]) -> np.ndarray:
        """Field values (float64) on the block ``where`` = (channels, *spatial slices)."""
        c, *space = self.shape
        nd, k = len(space), self.modes
        n = k * nd + 2 * c * k
        u = _uniform(np.uint64(sample) * np.uint64(n) + np.arange(n, dtype=np.uint64),
                     self.k_params)
        freq = (6.0 * u[:k * nd] - 3.0).reshape(k, nd)
        amp = (2.0 * u[k * nd:k * nd + c * k] - 1.0).reshape(c, k) * math.sqrt(6.0 / k)
        phase = 2 * np.pi * u[k * nd + c * k:].reshape(c, k)
        cs = np.arange(where[0].start, where[0].stop)
        coords = [np.arange(sl.start, sl.stop) for sl in where[1:]]
        out = np.zeros((len(cs), *map(len, coords)))
        for m in range(k):  # a fixed order: values independent of the block
            arg = np.zeros((1,) + tuple(map(len, coords)))
            for d, r in enumerate(coords):
                shape = [1] * (nd + 1)
                shape[1 + d] = len(r)
                arg = arg + (2 * np.pi * freq[m, d] * r / space[d]).reshape(shape)
            out += amp[cs, m].reshape((-1,) + (1,) * nd) * np.sin(
                arg + phase[cs, m].reshape((-1,) + (1,) * nd))
        if self.noise:
            counter = np.zeros(out.shape, dtype=np.uint64)
            stride = 1
            for d in reversed(range(nd + 1)):
                r = (cs if d == 0 else coords[d - 1]).astype(np.uint64) * np.uint64(stride)
                counter = counter + r.reshape((1,) * d + (-1,) + (1,) * (nd - d))
                stride *= self.shape[d]
            total = np.uint64(sample) * np.uint64(stride)
            out += self.noise * (2 * _uniform(counter + total, self.k_noise) - 1)
        return out


class SegmentationSynthetic(Dataset):
    """Smooth random N-D fields and per-voxel class labels thresholded from them.

    Input sample ``i`` has ``channels`` smooth fields (:class:`_Fields`: plane
    waves of up to 3 cycles per side, unit variance, a little noise). Its
    label at each position is the number of thresholds that the first
    channel's value exceeds (``classes - 1`` thresholds evenly spaced in
    [-0.6, 0.6]; 0 for two classes): blobs with smooth boundaries, which a
    U-Net learns quickly. Targets are (1, *S) int64 blocks split like the
    inputs.

    Parameters
    ----------
    num_samples : int
    size : tuple of int
        Spatial size S (any number of dimensions).
    channels : int
    classes : int
        At least 2.
    seed : int
    modes : int
        Plane waves per field.
    noise : float
    dtype : dtype
    """

    generated = True

    def __init__(self, num_samples: int, size: tuple[int, ...], channels: int = 1,
                 classes: int = 2, seed: int = 0, *, modes: int = 3, noise: float = 0.05,
                 dtype: Any = np.float32):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if classes < 2 or channels < 1:
            raise ValueError(f"need classes >= 2 and channels >= 1, got {classes}, {channels}")
        self.num_samples, self.classes = int(num_samples), int(classes)
        self.sample_shape = (int(channels), *map(int, size))
        self.target_shape = (1, *map(int, size))
        self.dtype, self.target_dtype = np.dtype(dtype), np.dtype(np.int64)
        self.thresholds = np.linspace(-0.6, 0.6, classes - 1) if classes > 2 else np.zeros(1)
        self._fields = _Fields(self.sample_shape, seed, 19, modes, noise)

    def __len__(self) -> int:
        return self.num_samples

    def _input_block(self, sample: int, where: tuple[slice, ...]) -> np.ndarray:
        return self._fields.values(sample, where).astype(self.dtype)

    def _target_block(self, sample: int, where: tuple[slice, ...]) -> np.ndarray:
        first = self._input_block(sample, (slice(0, 1),) + tuple(where[1:]))  # input dtype
        labels = (first[..., None] > self.thresholds.astype(self.dtype)).sum(axis=-1)
        return np.broadcast_to(labels, (where[0].stop - where[0].start, *labels.shape[1:]))

    def __repr__(self) -> str:
        return (f"SegmentationSynthetic({self.num_samples}, size={self.sample_shape[1:]}, "
                f"channels={self.sample_shape[0]}, classes={self.classes})")


class CosmoSynthetic(Dataset):
    """Volumes whose channel means encode ``outputs`` parameters to regress (CosmoFlow-like).

    Sample ``i`` has parameters ``theta`` uniform in [-1, 1) (``outputs`` of
    them, hashed from ``i``); channel ``c`` is ``theta[c % outputs]`` plus
    half a smooth unit-variance random field. The target is ``theta``: an
    (N, outputs) float array that every rank holds whole (as class labels
    are held), compared by a mean squared error with the network's
    sample-split output.

    Parameters
    ----------
    num_samples : int
    size : tuple of int
    channels : int
    outputs : int
    seed : int
    dtype : dtype
    """

    generated = True

    def __init__(self, num_samples: int, size: tuple[int, ...], channels: int = 4,
                 outputs: int = 4, seed: int = 0, *, dtype: Any = np.float32):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples, self.outputs = int(num_samples), int(outputs)
        self.sample_shape = (int(channels), *map(int, size))
        self.target_shape = ()
        self.dtype = self.target_dtype = np.dtype(dtype)
        self._fields = _Fields(self.sample_shape, seed, 23, 3, 0.05)
        (self._k_theta,) = _keys(seed, 29, 1)

    def __len__(self) -> int:
        return self.num_samples

    def _theta(self, samples: np.ndarray) -> np.ndarray:
        counter = samples.astype(np.uint64)[:, None] * np.uint64(self.outputs) + \
            np.arange(self.outputs, dtype=np.uint64)
        return 2 * _uniform(counter, self._k_theta) - 1

    def _input_block(self, sample: int, where: tuple[slice, ...]) -> np.ndarray:
        theta = self._theta(np.array([sample]))[0]
        cs = np.arange(where[0].start, where[0].stop) % self.outputs
        field = self._fields.values(sample, where)
        return (theta[cs].reshape((-1,) + (1,) * (field.ndim - 1)) + 0.5 * field
                ).astype(self.dtype)

    def _labels(self, samples: np.ndarray) -> np.ndarray:
        return self._theta(np.asarray(samples)).astype(self.dtype)

    def __repr__(self) -> str:
        return (f"CosmoSynthetic({self.num_samples}, size={self.sample_shape[1:]}, "
                f"channels={self.sample_shape[0]}, outputs={self.outputs})")
