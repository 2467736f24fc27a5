"""Data sets and a loader whose batches are generated or read block by block.

Every rank produces only its own block of each batch, as given by the batch
Distribution (``dist.local_slices()``); no rank ever generates or reads a whole
sample, and no communication is needed:

* the synthetic data sets (:class:`ImageNetSynthetic`, :class:`MeshSynthetic`,
  :class:`NoiseDataset`; :mod:`.synthetic`) are closed-form functions of
  ``(sample index, channel, y, x)`` plus counter-based hashes of the same global
  coordinates (SplitMix64, as in :mod:`disttensor.random`), so any split of the batch
  gives the same values;
* :class:`NpyDataset` memory-maps one ``.npy`` file per sample and slices out
  the local block;
* :class:`ArrayDataset` reads the local block of each sample from arrays that
  hold the whole data set, ``(N, C, *spatial)`` inputs and ``(N, C_t, *spatial)`` or
  (N,) targets: HDF5 data sets (hyperslab reads), Zarr arrays (the chunks
  that meet the block) or ``.npy`` memory maps. :func:`open_dataset` opens
  one by its path, once per rank, and :func:`save_dataset` writes one
  (:mod:`.stored`).

A :class:`Loader` turns a data set into a deterministic sequence of batches,
the same on every rank, and a :class:`Prefetcher` makes them ahead of the step
(:mod:`.loader`). Every data set derives from :class:`Dataset` (:mod:`.datasets`).
This module gathers their public names in one place.
"""

from __future__ import annotations

from .datasets import Dataset, Slices  # noqa: F401 (Slices: a former public name)
from .loader import Loader, Prefetcher
from .stored import (  # HDF5_SUFFIXES: a former public name outside __all__
    HDF5_SUFFIXES,  # noqa: F401
    ArrayDataset,
    NpyDataset,
    data_problem,
    open_dataset,
    save_dataset,
    save_npy_dataset,
)
from .synthetic import (  # FIELD_CHUNK, NOISE_PERIOD: former public names outside __all__
    FIELD_CHUNK,  # noqa: F401
    NOISE_PERIOD,  # noqa: F401
    ImageNetSynthetic,
    MeshSynthetic,
    NoiseDataset,
)

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
