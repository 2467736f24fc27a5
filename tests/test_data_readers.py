"""Training data from files (HDF5, Zarr, .npy arrays): open once, read only the local block.

The reference is the in-memory synthetic data set the files were written
from: a batch read from a file in any layout must equal the batch the data
set generates in that layout, bit for bit. Reads are counted: HDF5 through
a file object that counts the bytes h5py reads (against the hand-computed
bytes of the chunks that meet the block), Zarr through a store that records
the chunk keys it hands out (against the chunk indices that meet the block).
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib

import numpy as np
import pytest
from mpi4py import MPI
from test_io import CountingFile  # h5py reads through it; its reads are counted

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert, collective_outcome
from disttensor_nn.layout import Layout
from disttensor_nn.training import ImageNetSynthetic, MeshSynthetic, save_npy_dataset
from disttensor_nn.training.cli import data_main
from disttensor_nn.training.data import (
    ArrayDataset,
    Loader,
    NpyDataset,
    data_problem,
    open_dataset,
    save_dataset,
)
from disttensor_nn.training.driver import TrainConfig, train

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

comm = MPI.COMM_WORLD
P = comm.Get_size()
SIZES = [1, 2, 3, 4]
MESH = MeshSynthetic(4, (13, 11), channels=3, seed=5)
TILE = (5, 4)


@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


def layouts():
    """(N, C, H, W) layouts: sample, H, W and hybrid splits of this world."""
    g1 = dt.ProcessGrid((P,))
    out = [Layout(g1, (0, None, None, None)), Layout(g1, (None, None, 0, None)),
           Layout(g1, (None, None, None, 0))]
    if P == 4:
        out.append(Layout(dt.ProcessGrid((2, 2)), (0, None, 1, None)))
        out.append(Layout(dt.ProcessGrid((2, 2)), (None, None, 0, 1)))
    return out


def write_npy_arrays(directory, data):
    if comm.Get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        xs, ys = zip(*(data.sample(k) for k in range(len(data))))
        np.save(os.path.join(directory, "images.npy"), np.stack(xs))
        np.save(os.path.join(directory, "masks.npy"), np.stack(ys))
    comm.Barrier()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("suffix", [".h5", ".zarr", "npy"])
def test_batches_from_files_equal_the_in_memory_data(shared_dir, suffix):
    path = shared_dir / f"mesh{suffix}"
    names = ("images", "masks")
    if suffix == "npy":
        write_npy_arrays(path, MESH)
    else:
        save_dataset(path, MESH, *names, chunks=TILE)
    data = open_dataset(path, *names)
    assert isinstance(data, ArrayDataset) and len(data) == len(MESH)
    assert data.sample_shape == MESH.sample_shape and data.target_shape == MESH.target_shape
    for layout in layouts():
        tl = Layout(layout.grid, layout.axes)
        got = Loader(data, 3, layout, seed=2, target_layout=tl)
        ref = Loader(MESH, 3, layout, seed=2, target_layout=tl)
        for (x, y), (rx, ry) in itertools.islice(zip(got, ref), 2):
            assert x.dist == rx.dist and y.dist == ry.dist
            assert_equal(x, rx.to_global())
            assert_equal(y, ry.to_global())


@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("suffix", [".hdf5", ".zarr"])
def test_labels_from_files(shared_dir, suffix):
    data = ImageNetSynthetic(5, (6, 7), num_classes=10, seed=3)
    path = shared_dir / f"labels{suffix}"
    save_dataset(path, data)
    opened = open_dataset(path)
    assert opened.target_shape == () and opened.target_dtype == np.int64
    layout = Layout(dt.ProcessGrid((P,)), (None, None, 0, None))
    x, y = opened.batch([4, 0, 2], layout.distribution((3, 3, 6, 7)))
    rx, ry = data.batch([4, 0, 2], layout.distribution((3, 3, 6, 7)))
    assert_equal(x, rx.to_global())
    collective_assert(np.array_equal(y, ry), f"labels {y} != {ry}")


def chunks_meeting(slices, chunks):
    """Chunk indices (per dimension ranges) that meet the block ``slices``."""
    return [range(s.start // c, (s.stop - 1) // c + 1) if s.stop > s.start else range(0)
            for s, c in zip(slices, chunks)]


@pytest.mark.parallel(SIZES)
def test_hdf5_reads_only_the_chunks_of_the_block(shared_dir):
    path = shared_dir / "count.h5"
    save_dataset(path, MESH, chunks=TILE)
    layout = Layout(dt.ProcessGrid((P,)), (None, None, 0, None))
    idx = [3, 1]
    dist_x = layout.distribution((2, *MESH.sample_shape))
    with CountingFile(path) as raw, h5py.File(raw, "r") as f:
        data = ArrayDataset(f["input"], f["target"], source=str(path))
        for name in ("input", "target"):
            f[name].id.get_num_chunks()  # the chunk indexes, which a first read loads
        before = raw.read_bytes
        x, y = data.batch(idx, dist_x)
        read = raw.read_bytes - before
    rx, ry = MESH.batch(idx, dist_x)
    assert_equal(x, rx.to_global())
    assert_equal(y, ry.to_global())
    # every sample's block meets these chunks (1, C, 5, 4) and (1, 1, 5, 4), stored whole
    _, _, sh, sw = dist_x.local_slices()
    spatial = chunks_meeting((sh, sw), TILE)
    nchunks = math.prod(len(r) for r in spatial)
    want = len(idx) * nchunks * (3 + 1) * math.prod(TILE) * 4
    collective_assert(read == want, f"read {read} bytes, the block's chunks are {want}")


class KeyStore(zarr.storage.WrapperStore):
    """A Zarr store that records the keys of the chunks it hands out."""

    def __init__(self, store):
        super().__init__(store)
        self.keys = []

    async def get(self, key, prototype, byte_range=None):
        value = await super().get(key, prototype, byte_range)
        if value is not None and not key.endswith("zarr.json"):
            self.keys.append(key)
        return value


@pytest.mark.parallel(SIZES)
def test_zarr_reads_only_the_chunks_of_the_block(shared_dir):
    path = str(shared_dir / "count.zarr")
    save_dataset(path, MESH, chunks=TILE)
    store = KeyStore(zarr.storage.LocalStore(path, read_only=True))
    group = zarr.open_group(store=store, mode="r")
    data = ArrayDataset(group["input"], group["target"], source=path)
    grid = dt.ProcessGrid((1, P)) if P < 4 else dt.ProcessGrid((2, 2))
    layout = Layout(grid, (None, None, 0, 1))
    idx = [2, 0]
    dist_x = layout.distribution((2, *MESH.sample_shape))
    x, y = data.batch(idx, dist_x)
    rx, ry = MESH.batch(idx, dist_x)
    assert_equal(x, rx.to_global())
    assert_equal(y, ry.to_global())
    _, _, sh, sw = dist_x.local_slices()
    want = sorted(f"{name}/c/{i}/0/{a}/{b}" for name in ("input", "target") for i in idx
                  for a, b in itertools.product(*chunks_meeting((sh, sw), TILE)))
    collective_assert(sorted(store.keys) == want, f"read {sorted(store.keys)}, want {want}")


@pytest.mark.parallel([1, 2])
def test_npy_directories_and_bad_paths(shared_dir):
    save_npy_dataset(shared_dir / "samples", MESH)
    assert isinstance(open_dataset(shared_dir / "samples"), NpyDataset)
    write_npy_arrays(shared_dir / "arrays", MESH)
    assert data_problem(shared_dir / "nothing") == "no such file or directory"
    assert data_problem(shared_dir / "arrays") is None
    for call, kind, text in [
        (lambda: open_dataset(shared_dir / "nothing"), FileNotFoundError, "no data set"),
        (lambda: open_dataset(shared_dir / "arrays", "x"), FileNotFoundError, "'x'"),
    ]:
        _, error = collective_outcome(call)
        collective_assert(isinstance(error, kind) and text in str(error), repr(error))


@pytest.mark.parallel([2])
def test_training_on_a_made_file_equals_training_on_the_synthetic_data(shared_dir, capsys):
    path = str(shared_dir / "mesh.zarr")
    assert data_main(["make-synthetic", "mesh-demo", path, "--samples", "4", "--size",
                      "24x16", "--seed", "3", "--chunks", "8x8"]) == 0
    base = dict(model="mesh-demo", batch=2, steps=3, samples=4, seed=3, size=(24, 16),
                metrics=None, machine="v100-nvlink-edr", progress=False)
    from_file = train(TrainConfig(**base, data=path))
    synthetic = train(TrainConfig(**base))
    collective_assert(from_file["history"] == synthetic["history"],
                      f"{from_file['history']} != {synthetic['history']}")
    # and the file is what it trains on: another data set in it, another training
    other = str(shared_dir / "other.h5")
    assert data_main(["make-synthetic", "mesh-demo", other, "--samples", "4", "--size",
                      "24x16", "--seed", "4"]) == 0
    collective_assert(train(TrainConfig(**base, data=other))["history"] != synthetic["history"])
