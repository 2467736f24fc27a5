"""Files by block: every rank reads or writes only its own block of an array in a file.

Readers (:func:`from_npy`, :func:`from_hdf5`, :func:`from_zarr`) open the
file on every rank, take the global shape and dtype from its metadata, and
read only this rank's block (a memory map of a ``.npy`` file, an HDF5
hyperslab, the Zarr chunks that meet the block). Writers put each block in
its place of one file: :func:`to_npy` through MPI-IO (rank 0 writes the
``.npy`` header, every rank its block through a subarray file view, in one
collective write), :func:`to_zarr` by whole chunks (the array is first
redistributed so that every chunk lies inside one block, which makes the
writers' chunks disjoint). Replicas write once.

``h5py`` and ``zarr`` are optional (``pip install disttensor[data]``); the
functions that need them raise an ImportError naming the extra when they
are missing. Files must be visible to every rank at the same path (a shared
file system). Metadata errors (a missing file or data set, a shape that
does not match ``dist``) are raised identically on every rank before any
data is moved: the ranks agree on them first.
"""

from __future__ import annotations

import builtins
import importlib
import io
import math
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from .array import DistArray
from .backend import to_numpy
from .creation import make_distribution
from .distribution import Distribution, block_boundaries
from .grid import ProcessGrid
from .settings import collective

__all__ = [
    "chunk_splits",
    "from_hdf5",
    "from_npy",
    "from_zarr",
    "npy_header",
    "to_npy",
    "to_zarr",
]

T = TypeVar("T")
PathLike = str | os.PathLike


def optional_module(name: str) -> ModuleType:
    """Import the optional package ``name`` (h5py, zarr), or say which extra installs it.

    Raises
    ------
    ImportError
        When the package is not installed: ``pip install disttensor[data]``.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{name} is needed to read and write this format; install it with "
                          f"`pip install disttensor[data]` (or `pip install {name}`)") from exc


def _agree(comm: MPI.Comm, what: Callable[[], T]) -> T:
    """``what()`` on every rank; if it raised on any rank, raise that error on all ranks.

    The error of the lowest failing rank is raised everywhere with its type
    (when it is a built-in exception type) and message, so that a missing
    file seen by one rank cannot leave the others waiting in a collective.
    """
    result, error = None, None
    try:
        result = what()
    except Exception as exc:
        message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else \
            str(exc)
        error = (type(exc), message)
    failed = comm.allgather(None if error is None else (error[0].__name__, error[1]))
    for rank, fail in enumerate(failed):
        if fail is None:
            continue
        kind = error[0] if error is not None and error[0].__name__ == fail[0] else \
            getattr(builtins, fail[0], None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        note = "" if comm.Get_size() == 1 else f" (rank {rank})"
        raise kind(f"{fail[1]}{note}")
    return result  # type: ignore[return-value]


def _grid_comm(dist: Distribution | None, grid: ProcessGrid | None) -> MPI.Comm:
    if dist is not None:
        return dist.grid.comm
    if grid is not None:
        return grid.comm
    return MPI.COMM_WORLD


def _distribution(shape: tuple[int, ...], dist: Distribution | None, grid: ProcessGrid | None,
                  axes: Sequence[Any] | None, splits: Sequence[Any] | None,
                  chunks: tuple[int, ...] | None, source: str) -> Distribution:
    """The Distribution of an array of ``shape`` read from ``source`` (checked on every rank)."""
    if dist is not None:
        if tuple(dist.global_shape) != tuple(shape):
            raise ValueError(f"{source} holds an array of shape {tuple(shape)}, but dist has "
                             f"the global shape {tuple(dist.global_shape)}")
        if grid is not None or axes is not None or splits is not None:
            raise ValueError("give either dist= or grid/axes/splits, not both")
        return dist
    if chunks is not None:
        if splits is not None:
            raise ValueError("give either splits= or align_to_chunks=True, not both")
        rough = make_distribution(shape, grid=grid, axes=axes)
        return rough.replace(splits=chunk_splits(shape, chunks, rough.nblocks))
    return make_distribution(shape, grid=grid, axes=axes, splits=splits)


def chunk_splits(shape: Sequence[int], chunks: Sequence[int],
                 nblocks: Sequence[int]) -> list[list[int] | None]:
    """Cut indices that put every block boundary on a chunk boundary.

    Dimension ``d`` of ``shape[d]`` elements in chunks of ``chunks[d]`` is
    split into ``nblocks[d]`` blocks of whole chunks, the chunks shared out
    by the default block rule (:func:`~disttensor.block_boundaries`: the first
    blocks get one chunk more); blocks may be empty when there are fewer
    chunks than blocks. The result is the ``splits`` argument of
    :class:`~disttensor.Distribution` (None where a dimension is not split).

    Parameters
    ----------
    shape, chunks, nblocks : sequence of int
        One entry per dimension.

    Returns
    -------
    list
        Per dimension: None, or the ``nblocks[d] - 1`` cut indices.

    Examples
    --------
    >>> chunk_splits((10, 7), (3, 7), (2, 1))
    [[6], None]
    """
    if not len(shape) == len(chunks) == len(nblocks):
        raise ValueError(f"shape {tuple(shape)}, chunks {tuple(chunks)} and nblocks "
                         f"{tuple(nblocks)} must have one entry per dimension")
    out: list[list[int] | None] = []
    for n, c, p in zip(shape, chunks, nblocks):
        if int(c) < 1:
            raise ValueError(f"chunk sizes must be >= 1, got {tuple(chunks)}")
        if p == 1:
            out.append(None)
            continue
        b = block_boundaries(math.ceil(n / c), p)
        out.append([min(n, c * k) for k in b[1:-1]])
    return out


def _writes(dist: Distribution) -> bool:
    """Whether this rank writes its block: the first replica of every block does."""
    coords = dist.grid.coords
    return all(coords[a] == 0 for a in dist.replica_axes)


# --------------------------------------------------------------------------- .npy
def npy_header(shape: Sequence[int], dtype: Any) -> bytes:
    """The ``.npy`` header (format 1.0, or 2.0 when too long) of a C-ordered array.

    Every rank can compute it, so the data start at ``len(npy_header(...))``
    bytes without a message.
    """
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(int(s) for s in shape)}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, header)
    except ValueError:  # longer than 64 KiB
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue()


def _read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    if dtype.hasobject:
        raise ValueError(f"{path} holds Python objects, which cannot be read by block")
    return tuple(shape), dtype, fortran


@collective
def from_npy(path: PathLike, dist: Distribution | None = None, *,
             grid: ProcessGrid | None = None, axes: Sequence[Any] | None = None,
             splits: Sequence[Any] | None = None) -> DistArray:
    """Read a ``.npy`` file by block: every rank copies its block out of a memory map.

    Parameters
    ----------
    path : path
        The ``.npy`` file (C or Fortran order).
    dist : Distribution, optional
        Distribution of the result; its global shape must be the file's.
    grid, axes, splits
        Without ``dist``: the layout, as for :func:`disttensor.zeros` (a 1-D
        grid over ``COMM_WORLD`` splitting the first dimension by default).

    Returns
    -------
    DistArray
        The array, in the file's dtype (native byte order).

    Raises
    ------
    FileNotFoundError, ValueError
        On every rank alike, before any data is read.
    """
    path = os.fspath(path)
    comm = _grid_comm(dist, grid)
    shape, dtype, _ = _agree(comm, lambda: _read_npy_header(path))
    dist = _agree(comm, lambda: _distribution(shape, dist, grid, axes, splits, None, path))
    out = DistArray.empty(dist, dtype)
    if out.local.size:
        out.local[...] = np.load(path, mmap_mode="r")[dist.local_slices()]
    return out


def _file_type(dist: Distribution, itemsize: int, file_shape: Sequence[int],
               offset: Sequence[int]) -> MPI.Datatype | None:
    """A byte subarray type selecting this rank's block, placed at ``offset`` in a C-ordered
    file array of ``file_shape`` (None: the block is empty)."""
    local = dist.local_shape()
    if math.prod(local) == 0:
        return None
    sizes = [*file_shape[:-1], file_shape[-1] * itemsize]
    subsizes = [*local[:-1], local[-1] * itemsize]
    starts = [o + s.start for o, s in zip(offset, dist.local_slices())]
    starts[-1] *= itemsize
    return MPI.BYTE.Create_subarray(sizes, subsizes, starts).Commit()


def _region(region: Any, target: tuple[int, ...], shape: tuple[int, ...], what: str) -> tuple:
    """The start of ``region`` (slices of the leading dimensions of an array of shape
    ``target``, the others whole) where an array of ``shape`` goes; checked."""
    if not isinstance(region, (tuple, list)) or not all(isinstance(r, slice) for r in region):
        raise TypeError(f"{what}: region must be a tuple of slices, got {region!r}")
    if len(region) > len(target) or len(shape) != len(target):
        raise ValueError(f"{what}: an array of shape {shape} cannot go into a region of "
                         f"one of shape {target}")
    full = (*region, *(slice(None),) * (len(target) - len(region)))
    bounds = [r.indices(n) for r, n in zip(full, target)]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"{what}: region slices must have step 1, got {region!r}")
    want = tuple(max(0, b - a) for a, b, _ in bounds)
    if want != tuple(shape):
        raise ValueError(f"{what}: the region {region!r} of the stored array {target} has "
                         f"shape {want}, the array {tuple(shape)}")
    return tuple(a for a, _, _ in bounds)


def _npy_data_offset(path: str) -> int:
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0)
         else np.lib.format.read_array_header_2_0)(f)
        return f.tell()


@collective
def to_npy(array: DistArray, path: PathLike, *, region: Sequence[slice] | None = None) -> None:
    """Write a DistArray to one ``.npy`` file, every rank its block, through MPI-IO.

    Every rank computes the header (:func:`npy_header`); rank 0 writes it,
    and all ranks write their blocks in one collective ``Write_all`` through
    a subarray file view, so the array is never gathered. Replicas write
    once. An existing file is replaced. The result reads back with
    :func:`numpy.load` or :func:`from_npy`.

    Parameters
    ----------
    array : DistArray
        The array (blocks on any device; they are copied to host memory).
    path : path
        The file to write; its directory must exist.
    region : tuple of slice, optional
        Write into this region of an existing C-ordered ``.npy`` file of the
        same dtype instead (slices of its leading dimensions, the others
        whole; the region's shape must be the array's), e.g. ``(slice(i,
        i + 1),)`` for sample ``i`` of a stack. The rest of the file is left
        as it is.

    Raises
    ------
    FileNotFoundError
        When the directory (or, with ``region``, the file) does not exist.
    ValueError
        For a region that does not fit the file (on every rank alike).
    """
    path = os.fspath(path)
    dist = array.dist
    comm = dist.grid.comm
    dtype = np.dtype(array.dtype)

    def check() -> tuple[tuple[int, ...], tuple[int, ...], int]:
        if region is None:
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                raise FileNotFoundError(f"to_npy: the directory {directory} does not exist")
            return dist.global_shape, (0,) * dist.ndim, len(npy_header(dist.global_shape, dtype))
        if not os.path.exists(path):
            raise FileNotFoundError(f"to_npy: no file {path} to write a region of")
        shape, stored, fortran = _read_npy_header(path)
        if fortran or stored != dtype:
            raise ValueError(f"to_npy: {path} holds {'Fortran-ordered ' if fortran else ''}"
                             f"{stored}, not C-ordered {dtype} in native byte order")
        return shape, _region(region, shape, dist.global_shape, "to_npy"), \
            _npy_data_offset(path)
    file_shape, offset, start = _agree(comm, check)
    block = np.ascontiguousarray(to_numpy(array.local)) if _writes(dist) else None
    mode = MPI.MODE_WRONLY | (MPI.MODE_CREATE if region is None else 0)
    f = MPI.File.Open(comm, path, mode)
    try:
        if region is None:
            f.Set_size(start + dist.size * dtype.itemsize)  # truncates a longer former file
            if comm.Get_rank() == 0:
                f.Write_at(0, npy_header(dist.global_shape, dtype))
        ftype = None if block is None or dist.ndim == 0 else \
            _file_type(dist, dtype.itemsize, file_shape, offset)
        if ftype is None:
            f.Set_view(start, MPI.BYTE, MPI.BYTE)
            if dist.ndim == 0 and block is not None and comm.Get_rank() == 0:
                f.Write_all(block.view(np.uint8).reshape(-1))
            else:
                f.Write_all(np.empty(0, np.uint8))
        else:
            f.Set_view(start, MPI.BYTE, ftype)
            f.Write_all(block.view(np.uint8).reshape(-1))
            ftype.Free()
    finally:
        f.Close()


# --------------------------------------------------------------------------- HDF5
def _open_hdf5(source: Any, dataset: str | None) -> Any:
    """The h5py Dataset ``dataset`` of ``source`` (a path, a file object or an h5py object)."""
    h5py = optional_module("h5py")
    if isinstance(source, h5py.Dataset):
        if dataset is not None:
            raise ValueError("dataset= names a data set inside a file; got an h5py.Dataset")
        return source
    if isinstance(source, h5py.Group):
        group = source
    else:
        if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
            raise FileNotFoundError(f"no HDF5 file {os.fspath(source)}")
        group = h5py.File(source, "r")
    if dataset is None:
        raise ValueError("from_hdf5 needs the name of the data set in the file (dataset=)")
    if dataset not in group:
        names = sorted(group.keys())
        raise KeyError(f"no data set {dataset!r} in {group.file.filename}; it holds {names}")
    ds = group[dataset]
    if not isinstance(ds, h5py.Dataset):
        raise ValueError(f"{dataset!r} in {group.file.filename} is a group, not a data set")
    return ds


@collective(ignore=("source",))
def from_hdf5(source: Any, dataset: str | None = None, dist: Distribution | None = None, *,
              grid: ProcessGrid | None = None, axes: Sequence[Any] | None = None,
              splits: Sequence[Any] | None = None,
              align_to_chunks: bool = False) -> DistArray:
    """Read an HDF5 data set by block: every rank reads its hyperslab with h5py.

    No parallel HDF5 build is needed: every rank opens the file read-only
    and reads only its block (``Dataset.read_direct`` into the block).

    Parameters
    ----------
    source : path, file object, h5py.File/Group or h5py.Dataset
        Where the data set is.
    dataset : str, optional
        Its name in the file (not with an h5py.Dataset).
    dist : Distribution, optional
        Distribution of the result; its global shape must be the data set's.
    grid, axes, splits
        Without ``dist``: the layout, as for :func:`disttensor.zeros`.
    align_to_chunks : bool
        For a chunked data set without ``dist`` or ``splits``: put block
        boundaries on chunk boundaries (:func:`chunk_splits`), so that no
        chunk is read by two ranks.

    Returns
    -------
    DistArray

    Raises
    ------
    ImportError
        Without h5py (``pip install disttensor[data]``).
    FileNotFoundError, KeyError, ValueError
        On every rank alike, before any data is read.
    """
    comm = _grid_comm(dist, grid)
    ds = _agree(comm, lambda: _open_hdf5(source, dataset))

    def layout() -> Distribution:
        chunks = ds.chunks if align_to_chunks else None
        if align_to_chunks and chunks is None:
            raise ValueError(f"align_to_chunks: the data set {ds.name} is not chunked")
        return _distribution(ds.shape, dist, grid, axes, splits, chunks, ds.name)
    layout_ = _agree(comm, layout)
    out = DistArray.empty(layout_, ds.dtype)
    if out.local.size:
        ds.read_direct(out.local, source_sel=layout_.local_slices())
    return out


# --------------------------------------------------------------------------- Zarr
def _open_zarr(source: Any, mode: str = "r") -> Any:
    zarr = optional_module("zarr")
    if isinstance(source, zarr.Array):
        return source
    if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
        raise FileNotFoundError(f"no Zarr store {os.fspath(source)}")
    node = zarr.open(store=source, mode=mode)
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{source} is a Zarr group, not an array; pass the array's path "
                         f"(it holds {sorted(node.keys())})")
    return node


@collective(ignore=("source",))
def from_zarr(source: Any, dist: Distribution | None = None, *,
              grid: ProcessGrid | None = None, axes: Sequence[Any] | None = None,
              splits: Sequence[Any] | None = None, align_to_chunks: bool = False) -> DistArray:
    """Read a Zarr array by block: every rank reads the chunks that meet its block.

    Parameters
    ----------
    source : path, store or zarr.Array
        The array (a path or store opened read-only with :func:`zarr.open`).
    dist : Distribution, optional
        Distribution of the result; its global shape must be the array's.
    grid, axes, splits
        Without ``dist``: the layout, as for :func:`disttensor.zeros`.
    align_to_chunks : bool
        Without ``dist`` or ``splits``: put block boundaries on chunk
        boundaries (:func:`chunk_splits`), so that every rank reads whole
        chunks and no chunk is read twice.

    Returns
    -------
    DistArray

    Raises
    ------
    ImportError
        Without zarr (``pip install disttensor[data]``).
    FileNotFoundError, ValueError
        On every rank alike, before any data is read.
    """
    comm = _grid_comm(dist, grid)
    arr = _agree(comm, lambda: _open_zarr(source))
    chunks = tuple(arr.chunks) if align_to_chunks else None
    layout = _agree(comm, lambda: _distribution(tuple(arr.shape), dist, grid, axes, splits,
                                                chunks, str(source)))
    out = DistArray.empty(layout, arr.dtype)
    if out.local.size:
        out.local[...] = arr[layout.local_slices()]
    return out


def _aligned(dist: Distribution, chunks: tuple[int, ...]) -> bool:
    """Whether every block boundary of ``dist`` is a multiple of the chunk size (or the end)."""
    return all(all(b % c == 0 or b == n for b in bounds)
               for bounds, c, n in zip(dist.boundaries, chunks, dist.global_shape))


@collective
def to_zarr(array: DistArray, store: Any, chunks: Sequence[int] | None = None, *,
            overwrite: bool = True, region: Sequence[slice] | None = None) -> None:
    """Write a DistArray to a Zarr (v3) array, every rank its own whole chunks.

    Rank 0 creates the array; then every rank writes the chunks inside its
    block. Two ranks never write one chunk: when a block boundary of
    ``array`` falls inside a chunk, the array is first redistributed to the
    same grid with block boundaries on chunk boundaries (:func:`chunk_splits`;
    one collective, and the memory of one more block). Replicas write once.

    Parameters
    ----------
    array : DistArray
    store : path or store
        Where to create the array (a path is a local directory store, shared
        by the ranks).
    chunks : sequence of int, optional
        Chunk shape; by default the largest block of ``array`` in each
        dimension (whole blocks when the array is evenly split).
    overwrite : bool
        Replace an existing array (otherwise it is an error).
    region : tuple of slice, optional
        Write into this region of the existing array at ``store`` instead
        (slices of its leading dimensions, the others whole; the region's
        shape must be the array's and it must start on chunk boundaries),
        e.g. ``(slice(i, i + 1),)`` for sample ``i`` of a stack; ``chunks``
        and ``overwrite`` are then not used.

    Raises
    ------
    ImportError
        Without zarr (``pip install disttensor[data]``).
    ValueError
        For a bad chunk shape or region (on every rank alike).
    """
    zarr = optional_module("zarr")
    dist = array.dist
    comm = dist.grid.comm
    offset = (0,) * dist.ndim
    if region is not None:
        def existing() -> tuple[tuple[int, ...], tuple[int, ...]]:
            target = _open_zarr(store)
            if np.dtype(target.dtype) != np.dtype(array.dtype):
                raise ValueError(f"to_zarr: {store} holds {target.dtype}, the array is "
                                 f"{array.dtype}")
            start = _region(region, tuple(target.shape), dist.global_shape, "to_zarr")
            if any(a % c for a, c in zip(start, target.chunks)):
                raise ValueError(f"to_zarr: the region {region!r} does not start on a "
                                 f"boundary of the chunks {tuple(target.chunks)}")
            return tuple(target.chunks), start
        chunks, offset = _agree(comm, existing)
    elif chunks is None:
        chunks = tuple(max(1, max(b[i + 1] - b[i] for i in range(len(b) - 1)))
                       for b in dist.boundaries)
    chunks = tuple(int(c) for c in chunks)
    if len(chunks) != dist.ndim or min(chunks, default=1) < 1:
        raise ValueError(f"to_zarr: chunks must be {dist.ndim} positive ints, got {chunks}")
    if not _aligned(dist, chunks):
        array = array.redistribute(dist.replace(
            splits=chunk_splits(dist.global_shape, chunks, dist.nblocks)))
        dist = array.dist

    def create() -> None:
        if comm.Get_rank() == 0 and region is None:
            zarr.create_array(store=store, shape=dist.global_shape, dtype=array.dtype,
                              chunks=chunks, overwrite=overwrite)
    _agree(comm, create)
    if _writes(dist) and math.prod(dist.local_shape()):
        target = zarr.open_array(store=store, mode="r+")
        where = tuple(slice(o + s.start, o + s.stop)
                      for o, s in zip(offset, dist.local_slices()))
        target[where] = to_numpy(array.local)
    comm.Barrier()  # the store is complete when any rank returns


# the writers as methods, attached from here as redistribute and exchange_halo are
DistArray.to_npy = to_npy  # type: ignore[attr-defined]
DistArray.to_zarr = to_zarr  # type: ignore[attr-defined]
