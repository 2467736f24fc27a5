"""The data set protocol: each rank's blocks of a batch of samples, from a data set's
per-sample reads (:class:`Dataset`), with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution

__all__ = ["Dataset"]

Slices = tuple[slice, ...]


def _indices(indices: Any) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise TypeError(f"indices must be a 1-D sequence of integers, got {indices!r}")
    return idx.astype(np.int64)


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
