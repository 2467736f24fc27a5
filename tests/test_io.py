"""disttensor.io: arrays read and written by block (.npy, HDF5, Zarr).

References are independent of the code under test: files are written by
``numpy.save``, ``h5py`` and ``zarr`` on one rank and read back with
``numpy.load`` / ``h5py`` / ``zarr`` whole; values come from the global index.
Reads by block are checked to read only the block: HDF5 through a file
object that counts the bytes h5py reads, Zarr through a store that counts
the bytes of the chunks it hands out (against hand-computed chunk sizes).
"""

from __future__ import annotations

import io
import math
import pathlib

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert, collective_outcome

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

comm = MPI.COMM_WORLD
P = comm.Get_size()
SHAPE = (5, 7, 3)
GLOBAL = (np.arange(math.prod(SHAPE), dtype=np.float32) * 0.5 - 3).reshape(SHAPE)

# (grid shape, axes): row split, column split, two-axis split, replicas, none split
LAYOUTS = [
    ((P,), (0, None, None)),
    ((P,), (None, 0, None)),
    ((1, P), (None, 1, 0)),
    ((P, 1), (None, None, 0)),
    ((P,), (None, None, None)),
]


SIZES = [1, 2, 3, 4]


@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


def on_root(write) -> None:
    if comm.Get_rank() == 0:
        write()
    comm.Barrier()


def test_chunk_splits_by_hand():
    assert dt.chunk_splits((10, 7), (3, 7), (2, 1)) == [[6], None]
    # 4 chunks (3, 3, 3, 1) over 3 blocks: 2, 1, 1 chunks
    assert dt.chunk_splits((10,), (3,), (3,)) == [[6, 9]]
    # more blocks than chunks: empty blocks at the end
    assert dt.chunk_splits((5,), (4,), (3,)) == [[4, 5]]
    with pytest.raises(ValueError, match="chunk sizes"):
        dt.chunk_splits((5,), (0,), (2,))


def test_npy_header_is_numpys():
    for shape, dtype in [((5, 7, 3), "<f4"), ((), ">i8"), ((0, 2), "|u1")]:
        buf = io.BytesIO()
        np.save(buf, np.zeros(shape, dtype))
        assert dt.npy_header(shape, dtype) == buf.getvalue()[:len(dt.npy_header(shape, dtype))]
        assert len(buf.getvalue()) == len(dt.npy_header(shape, dtype)) + \
            math.prod(shape) * np.dtype(dtype).itemsize


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_npy_round_trip(shared_dir, layout):
    gshape, axes = layout
    grid = dt.ProcessGrid(gshape)
    path = shared_dir / "a.npy"
    x = dt.asarray(GLOBAL, grid=grid, axes=axes)
    x.to_npy(path)
    comm.Barrier()
    back = np.load(path)
    collective_assert(back.dtype == GLOBAL.dtype and np.array_equal(back, GLOBAL),
                      "to_npy wrote another array")
    # read with another layout than the one written
    other_axes = tuple(reversed(axes))
    y = dt.from_npy(path, grid=grid, axes=other_axes)
    assert y.dist == dt.Distribution(SHAPE, grid, other_axes)
    assert_equal(y, GLOBAL)


@pytest.mark.parallel(SIZES)
def test_npy_overwrites_a_longer_file_and_reads_fortran_and_big_endian(shared_dir):
    path = shared_dir / "b.npy"
    on_root(lambda: np.save(path, np.zeros(1000)))
    small = np.arange(6, dtype=np.int16).reshape(2, 3)
    dt.asarray(small, grid=dt.ProcessGrid((P,)), axes=(None, 0)).to_npy(path)
    comm.Barrier()
    collective_assert(np.array_equal(np.load(path), small) and
                      path.stat().st_size == len(dt.npy_header((2, 3), np.int16)) + 12)
    fpath = shared_dir / "f.npy"
    on_root(lambda: np.save(fpath, np.asfortranarray(GLOBAL.astype(">f8"))))
    assert_equal(dt.from_npy(fpath, grid=dt.ProcessGrid((P,)), axes=(None, 0, None)),
                 GLOBAL.astype(np.float64))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("layout", LAYOUTS[1:3])
def test_writing_into_a_region_of_a_stack(shared_dir, layout):
    gshape, axes = layout
    grid = dt.ProcessGrid(gshape)
    x = dt.asarray(GLOBAL[None], grid=grid, axes=(None, *axes))
    stack = (3, *SHAPE)
    npy, zpath = shared_dir / "s.npy", str(shared_dir / "s.zarr")

    def create():
        np.lib.format.open_memmap(npy, "w+", np.float32, stack).flush()
        zarr.create_array(store=zpath, shape=stack, dtype=np.float32, chunks=(1, 2, 3, 3),
                          fill_value=0)
    on_root(create)
    x.to_npy(npy, region=(slice(1, 2),))
    x.to_zarr(zpath, region=(slice(2, 3),))
    want_npy, want_zarr = np.zeros(stack, np.float32), np.zeros(stack, np.float32)
    want_npy[1], want_zarr[2] = GLOBAL, GLOBAL
    collective_assert(np.array_equal(np.load(npy), want_npy), "to_npy region")
    collective_assert(np.array_equal(zarr.open_array(zpath, mode="r")[...], want_zarr),
                      "to_zarr region")
    for call in [lambda: x.to_npy(npy, region=(slice(0, 2),)),
                 lambda: x.to_zarr(zpath, region=(slice(0, 1), slice(1, 6))),
                 lambda: x.astype(np.float64).to_npy(npy, region=(slice(0, 1),))]:
        _, error = collective_outcome(call)
        collective_assert(isinstance(error, ValueError), repr(error))


def write_h5(path, chunks=None):
    def write():
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=GLOBAL, chunks=chunks)
            f.create_group("g")
    on_root(write)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("layout", LAYOUTS[:4])
def test_hdf5_by_block(shared_dir, layout):
    gshape, axes = layout
    path = shared_dir / "a.h5"
    write_h5(path)
    grid = dt.ProcessGrid(gshape)
    x = dt.from_hdf5(path, "x", grid=grid, axes=axes)
    assert x.dist == dt.Distribution(SHAPE, grid, axes)
    assert_equal(x, GLOBAL)
    with h5py.File(path, "r") as f:  # an open data set, and a Distribution
        dist = dt.Distribution(SHAPE, grid, axes, [None, None, None])
        assert_equal(dt.from_hdf5(f["x"], dist=dist), GLOBAL)


class CountingFile(io.FileIO):
    """A file whose reads are counted (h5py reads through it with driver 'fileobj')."""

    def __init__(self, path):
        super().__init__(path, "r")
        self.read_bytes = 0

    def readinto(self, b):
        n = super().readinto(b)
        self.read_bytes += n or 0
        return n

    def read(self, size=-1):
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def chunk_bytes(dist, chunks, itemsize):
    """Bytes of the chunks that meet this rank's block (hand count)."""
    if math.prod(dist.local_shape()) == 0:
        return 0
    total = 1
    for sl, c in zip(dist.local_slices(), chunks):
        total *= c * ((sl.stop - 1) // c - sl.start // c + 1)
    return total * itemsize


@pytest.mark.parallel(SIZES)
def test_hdf5_each_rank_reads_only_its_chunks(shared_dir):
    path = shared_dir / "c.h5"
    big = np.arange(4 * 30 * 16, dtype=np.float32).reshape(4, 30, 16)
    chunks = (2, 4, 16)

    def write():
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=big, chunks=chunks)
    on_root(write)
    grid = dt.ProcessGrid((P,))
    with CountingFile(path) as raw, h5py.File(raw, "r") as f:
        ds = f["x"]
        ds.id.get_num_chunks()  # the chunk index, read once by any first read
        opened = raw.read_bytes
        x = dt.from_hdf5(ds, grid=grid, axes=(None, 0, None), align_to_chunks=True)
        read = raw.read_bytes - opened
    assert all(b % 4 == 0 or b == 30 for b in x.dist.boundaries[1])
    assert_equal(x, big)
    # HDF5 stores edge chunks whole: every chunk meeting the block is read once, no other
    want = chunk_bytes(x.dist, chunks, 4)
    collective_assert(read == want, f"read {read} bytes for {want} bytes of chunks")


class CountingStore(zarr.storage.WrapperStore):
    """A Zarr store that counts the bytes of the chunk objects it hands out."""

    def __init__(self, store):
        super().__init__(store)
        self.chunk_bytes = 0

    async def get(self, key, prototype, byte_range=None):
        value = await super().get(key, prototype, byte_range)
        if value is not None and "zarr.json" not in key:
            self.chunk_bytes += len(value)
        return value


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("layout", LAYOUTS[:4])
def test_zarr_round_trip(shared_dir, layout):
    gshape, axes = layout
    grid = dt.ProcessGrid(gshape)
    path = shared_dir / "a.zarr"
    x = dt.asarray(GLOBAL, grid=grid, axes=axes)
    x.to_zarr(path, chunks=(2, 3, 2))  # chunks across block boundaries: redistributed first
    back = zarr.open_array(path, mode="r")
    collective_assert(tuple(back.chunks) == (2, 3, 2) and np.array_equal(back[...], GLOBAL))
    dt.to_zarr(x, shared_dir / "b.zarr")  # default chunks: the largest blocks
    assert_equal(dt.from_zarr(shared_dir / "b.zarr", grid=grid, axes=tuple(reversed(axes))),
                 GLOBAL)


@pytest.mark.parallel(SIZES)
def test_zarr_each_rank_reads_only_its_chunks(shared_dir):
    path = str(shared_dir / "c.zarr")
    chunks = (2, 3, 3)
    on_root(lambda: zarr.create_array(store=path, data=GLOBAL, chunks=chunks,
                                      compressors=None))
    store = CountingStore(zarr.storage.LocalStore(path, read_only=True))
    arr = zarr.open_array(store=store, mode="r")
    grid = dt.ProcessGrid((P, 1))
    x = dt.from_zarr(arr, grid=grid, axes=(0, 1, None), align_to_chunks=True)
    assert all(b % 2 == 0 or b == 5 for b in x.dist.boundaries[0])
    assert_equal(x, GLOBAL)
    # uncompressed chunks are stored whole (edge chunks too): exactly the block's chunks
    want = chunk_bytes(x.dist, chunks, 4)
    collective_assert(store.chunk_bytes == want, f"read {store.chunk_bytes}, want {want}")


@pytest.mark.parallel(SIZES)
def test_bad_input_raises_alike_on_every_rank(shared_dir):
    grid = dt.ProcessGrid((P,))
    write_h5(shared_dir / "a.h5")
    cases = [
        (FileNotFoundError, lambda: dt.from_npy(shared_dir / "none.npy", grid=grid)),
        (FileNotFoundError, lambda: dt.from_hdf5(shared_dir / "none.h5", "x", grid=grid)),
        (KeyError, lambda: dt.from_hdf5(shared_dir / "a.h5", "y", grid=grid)),
        (ValueError, lambda: dt.from_hdf5(shared_dir / "a.h5", "g", grid=grid)),
        (ValueError, lambda: dt.from_hdf5(shared_dir / "a.h5", "x",
                                          dist=dt.Distribution((5, 7), grid))),
        (ValueError, lambda: dt.from_hdf5(shared_dir / "a.h5", "x", grid=grid,
                                          align_to_chunks=True)),
        (FileNotFoundError, lambda: dt.from_zarr(shared_dir / "none.zarr", grid=grid)),
        (FileNotFoundError, lambda: dt.to_npy(dt.zeros(3, grid=grid),
                                              shared_dir / "no" / "a.npy")),
        (ValueError, lambda: dt.to_zarr(dt.zeros(3, grid=grid), shared_dir / "z", (0,))),
    ]
    for kind, call in cases:
        _, error = collective_outcome(call)
        collective_assert(isinstance(error, kind), f"{call}: {error!r}")


def test_a_missing_optional_package_names_the_extra():
    with pytest.raises(ImportError, match=r"disttensor\[data\]"):
        dt.io.optional_module("no_such_package_for_disttensor")
