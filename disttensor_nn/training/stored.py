"""Data sets stored in files, each rank reading only its blocks: one ``.npy`` file per
sample (:class:`NpyDataset`), or arrays holding the whole set, HDF5 data sets, Zarr arrays
or ``.npy`` memory maps (:class:`ArrayDataset`); :func:`open_dataset` opens one by its
path and :func:`save_dataset` and :func:`save_npy_dataset` write one.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution
from disttensor.io import optional_module

from .datasets import Dataset, Slices, _indices

__all__ = [
    "ArrayDataset",
    "NpyDataset",
    "data_problem",
    "open_dataset",
    "save_dataset",
    "save_npy_dataset",
]


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
