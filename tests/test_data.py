"""disttensor_nn.training.data: synthetic data sets, the loader and .npy data sets.

The reference for every distributed batch is the same batch generated whole
by each rank alone (a 1-process grid on ``MPI.COMM_SELF``); blocks must match
it exactly, whatever the split.
"""

from __future__ import annotations

import functools
import os
import pathlib
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert
from disttensor_nn import Layout
from disttensor_nn.training import synthetic
from disttensor_nn.training.data import (
    ImageNetSynthetic,
    Loader,
    MeshSynthetic,
    NpyDataset,
    save_npy_dataset,
)

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3, 4]
INDICES = [5, 0, 7, 2, 9]


@functools.cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


def grid2_shape(p: int) -> tuple[int, int]:
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


def layouts() -> dict[str, Layout]:
    """The splits of an (N, C, H, W) batch under test, for this world size."""
    p = comm.Get_size()
    g1, g2 = grid((p,)), grid(grid2_shape(p))
    return {
        "H": Layout(g1, (None, None, 0, None)),
        "sample x H": Layout(g2, (0, None, 1, None)),
        "W": Layout(g1, (None, None, None, 0)),
        "HxW": Layout(g2, (None, None, 0, 1)),
        "C x W": Layout(g2, (None, 0, None, 1)),
    }


def whole(dataset, indices):
    """The batch generated whole by this rank alone."""
    solo = dt.ProcessGrid((1,), MPI.COMM_SELF)
    shape = (len(indices), *dataset.sample_shape)
    x, y = dataset.batch(indices, dt.Distribution(shape, solo, (None,) * 4))
    return x.local, (y.local if isinstance(y, dt.DistArray) else y)


@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


DATASETS = {
    "mesh": lambda: MeshSynthetic(12, size=(13, 11), seed=3),
    "mesh-noiseless": lambda: MeshSynthetic(12, size=(9, 16), channels=4, seed=1, noise=0.0),
    "imagenet": lambda: ImageNetSynthetic(12, image_size=(10, 13), num_classes=7, seed=2),
}


# --------------------------------------------------------------------------- synthetic
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", list(DATASETS))
def test_blocks_equal_the_single_rank_batch(name):
    ds = DATASETS[name]()
    xw, yw = whole(ds, INDICES)
    for lname, layout in layouts().items():
        dist = layout.distribution((len(INDICES), *ds.sample_shape))
        x, y = ds.batch(INDICES, dist)
        collective_assert(x.dist == dist and x.dtype == ds.dtype, f"{lname}: {x.dist}")
        collective_assert(np.array_equal(x.local, xw[dist.local_slices()]), f"{lname}: x block")
        if isinstance(y, dt.DistArray):
            collective_assert(y.dist.boundaries[2:] == dist.boundaries[2:]
                              and y.dist.boundaries[0] == dist.boundaries[0],
                              f"{lname}: y split {y.dist} differs from x's {dist}")
            collective_assert(np.array_equal(y.local, yw[y.dist.local_slices()]),
                              f"{lname}: y block")
        else:
            assert_equal(y, yw)
    # and the whole batch is made of whole samples
    for j, i in enumerate(INDICES):
        xs, ys = ds.sample(i)
        collective_assert(np.array_equal(xs, xw[j]) and np.array_equal(ys, yw[j]), f"sample {i}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", list(DATASETS))
def test_kept_blocks_equal_the_made_ones_are_made_once_and_stay_within_their_bytes(
        name, monkeypatch):
    """Dataset.keep: later epochs copy this rank's kept blocks (each made once, the first
    time the rank is given its sample), equal to the single-rank batch; no more than the
    bytes given are kept; Loader.keep_bytes is what keeping every sample's blocks holds."""
    ds = DATASETS[name]()
    made = spy_fills(ds, monkeypatch)
    layout = layouts()["sample x H"]
    target = Layout(layout.grid, layout.axes) if ds.has_spatial_target else None
    loader = Loader(ds, 4, layout, shuffle=True, seed=3, target_layout=target)
    ds.keep(loader.keep_bytes())
    ref = DATASETS[name]()  # the same data, keeping nothing
    loaded = []  # the blocks the loader had made (not the reference's)
    for epoch in range(3):
        for idx in loader.batches(epoch):
            before = len(made)
            x, y = loader.load(idx)
            loaded += made[before:]
            xw, yw = whole(ref, idx)
            ok = np.array_equal(x.local, xw[x.dist.local_slices()]) and (
                np.array_equal(y.local, yw[y.dist.local_slices()])
                if isinstance(y, dt.DistArray) else np.array_equal(y, yw))
            collective_assert(ok, f"epoch {epoch}: batch {idx}")
    # each block made once, the first time this rank was given its sample
    collective_assert(len(loaded) == len(set(loaded)), f"made twice: {loaded}")
    # all that was made is kept (the samples this rank was given so far)
    collective_assert(0 < ds.kept_bytes <= loader.keep_bytes() == ds.keep_limit,
                      f"{ds.kept_bytes} {loader.keep_bytes()}")
    # a smaller allowance keeps fewer blocks, never more bytes than allowed
    ds.keep(loader.keep_bytes() // 3)
    for idx in loader.batches(0):
        loader.load(idx)
    third = loader.keep_bytes() // 3
    collective_assert(ds.keep_limit == third and 0 < ds.kept_bytes <= third or third == 0,
                      f"{ds.kept_bytes} of {third}")
    ds.keep(0)
    collective_assert(ds.kept_bytes == 0 and ds.keep_limit == 0)


@pytest.mark.parallel(SIZES)
def test_make_kept_of_the_upcoming_batches_makes_only_what_they_take(monkeypatch):
    """Loader.upcoming(n) is what the next n batches will be (across epochs, from the
    loader's position, nothing taken); make_kept of them makes the blocks of the samples
    this rank holds in them, once, and loading them then makes nothing."""
    ds = DATASETS["mesh"]()
    made = spy_fills(ds, monkeypatch)
    layout = layouts()["sample x H"]
    loader = Loader(ds, 4, layout, shuffle=True, seed=9,
                    target_layout=Layout(layout.grid, layout.axes))
    next(iter(loader))  # one batch taken: the position moves
    ahead = loader.upcoming(5)  # 3 batches an epoch: into the next epoch
    taken = []
    for _ in range(2):
        taken += [idx for idx in loader.batches(loader.epoch)[loader.position:]]
        loader.epoch, loader.position = loader.epoch + 1, 0
    loader.epoch, loader.position = 0, 1
    collective_assert(len(ahead) == 5 and all(np.array_equal(a, b)
                                              for a, b in zip(ahead, taken[:5])),
                      f"{ahead} vs {taken[:5]}")
    ds.keep(loader.keep_bytes())
    slots = layout.distribution((4, *ds.sample_shape)).local_slices()[0]
    mine = sorted({int(i) for b in ahead for i in b[slots]})
    made.clear()
    n = loader.make_kept(ahead)
    collective_assert(n == len(mine) and sorted({i for _, i in made}) == mine
                      and len(made) == 2 * len(mine), f"{n}, {made}, {mine}")
    made.clear()
    for idx in ahead:
        loader.load(idx)
    collective_assert(not made, f"made {made}")


def spy_fills(ds, monkeypatch) -> list[tuple[str, int]]:
    """The ``(method, sample)`` of every block ``ds`` makes from now on (its fills)."""
    made = []
    for method in ("_fill_input", "_fill_target"):
        real = getattr(type(ds), method)
        monkeypatch.setattr(type(ds), method, lambda self, i, where, out, real=real, m=method:
                            (made.append((m, i)), real(self, i, where, out))[1])
    return made


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("split", ["sample x H", "HxW"])
def test_make_kept_makes_every_block_before_the_first_batch(name, split, monkeypatch):
    """Loader.make_kept: each rank's block of every sample made once, up front, and kept
    (Loader.keep_bytes of them); then no batch of any epoch makes one, and every batch
    equals the single-rank one."""
    ds = DATASETS[name]()
    made = spy_fills(ds, monkeypatch)
    layout = layouts()[split]
    target = Layout(layout.grid, layout.axes) if ds.has_spatial_target else None
    loader = Loader(ds, 4, layout, shuffle=True, seed=5, target_layout=target)
    collective_assert(loader.make_kept() == 0 and not made)  # nothing kept: nothing made
    ds.keep(loader.keep_bytes())
    n = loader.make_kept()
    holds = loader.keep_bytes() > 0
    kinds = 2 if ds.has_spatial_target else 1
    collective_assert(n == (len(ds) if holds else 0) and len(made) == kinds * n
                      and len(set(made)) == len(made) and ds.kept_bytes == loader.keep_bytes(),
                      f"{n} samples, {len(made)} blocks, {ds.kept_bytes} of "
                      f"{loader.keep_bytes()} bytes")
    ref = DATASETS[name]()  # the same data, keeping nothing (its fills are spied on too)
    for epoch in range(2):
        for idx in loader.batches(epoch):
            made.clear()
            x, y = loader.load(idx)
            fresh = list(made)
            xw, yw = whole(ref, idx)
            ok = np.array_equal(x.local, xw[x.dist.local_slices()]) and (
                np.array_equal(y.local, yw[y.dist.local_slices()])
                if isinstance(y, dt.DistArray) else np.array_equal(y, yw))
            collective_assert(ok and not fresh, f"epoch {epoch}: batch {idx}, made {fresh}")


@pytest.mark.parallel([1])
def test_only_generated_data_sets_keep_blocks(tmp_path):
    mesh = MeshSynthetic(4, size=(8, 8), channels=2)
    with pytest.raises(ValueError, match=">= 0"):
        mesh.keep(-1)
    save_npy_dataset(tmp_path / "npy", mesh)
    with pytest.raises(ValueError, match="only generated data sets"):
        NpyDataset(tmp_path / "npy").keep(2**20)


@pytest.mark.parallel(SIZES)
def test_labels_as_distarray():
    ds = DATASETS["imagenet"]()
    _, labels = whole(ds, INDICES)
    p = comm.Get_size()
    x, y = ds.batch(INDICES, layouts()["sample x H"].distribution((5, 3, 10, 13)),
                    dt.Distribution((5,), grid((p,))))
    assert_equal(y, labels)
    collective_assert(labels.dtype == np.int64 and labels.min() >= 0 and labels.max() < 7)


@pytest.mark.parallel(SIZES)
def test_mesh_generates_only_the_local_block_and_a_one_pixel_halo(monkeypatch):
    ds = MeshSynthetic(4, size=(16, 12), channels=5)
    calls = []
    fields = MeshSynthetic._fields

    def spy(self, sample, cs, ys, xs, out=None):
        calls.append((sample, tuple(cs), int(ys.min()), int(ys.max()), int(xs.min()),
                      int(xs.max())))
        return fields(self, sample, cs, ys, xs, out)

    monkeypatch.setattr(MeshSynthetic, "_fields", spy)
    dist = layouts()["HxW"].distribution((3, 5, 16, 12))
    ds.batch([0, 3, 1], dist)
    _, sh, sw = dist.local_slices()[1:]
    ok = all(sh.start - 1 <= y0 and y1 <= sh.stop and sw.start - 1 <= x0 and x1 <= sw.stop
             for _, _, y0, y1, x0, x1 in calls)
    collective_assert(ok and len(calls) == 6, f"block {sh, sw}, generated {calls}")


@pytest.mark.parallel([1])
def test_mesh_fields_are_generated_a_few_channels_at_a_time(monkeypatch):
    # the same values as all channels at once, with float64 scratch of two channels only
    ds = MeshSynthetic(2, size=(64, 48), channels=18, seed=3)
    where = (slice(1, 18), slice(5, 60), slice(0, 48))
    monkeypatch.setattr(synthetic, "FIELD_CHUNK", 2**40)
    at_once = ds._input_block(1, where)
    two = 2 * 55 * 48 * 8  # bytes of two channels of the block in float64
    monkeypatch.setattr(synthetic, "FIELD_CHUNK", two)
    tracemalloc.start()
    try:
        chunked = ds._input_block(1, where)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(chunked, at_once)
    # the block itself and a handful of two-channel temporaries (all 17 channels at once
    # take several times the block in float64)
    assert peak <= chunked.nbytes + 6 * two, (peak, chunked.nbytes, two)


@pytest.mark.parallel([1])
@pytest.mark.parametrize("name", ["mesh", "imagenet"])
def test_every_block_of_a_sample_equals_the_whole_samples_values(name):
    # the waves are matrix products (BLAS): every element must come out the same in any
    # block, of one row or column too, at the edges, and at sizes where BLAS switches
    # kernels; the mask's margin is generated again and must agree with the input
    h, w = 70, 45
    ds = (MeshSynthetic(2, size=(h, w), channels=3, seed=7) if name == "mesh"
          else ImageNetSynthetic(2, image_size=(h, w), seed=7))
    full = ds._input_block(1, (slice(0, 3), slice(0, h), slice(0, w)))
    cuts_h, cuts_w = [0, 1, 2, 3, 8, 17, 33, h - 2, h - 1, h], [0, 1, 2, 5, 16, 31, w - 1, w]
    bad = []
    for y0, y1 in zip(cuts_h, cuts_h[1:], strict=False):
        for x0 in cuts_w[:-1]:
            for x1 in [x for x in cuts_w if x > x0]:
                where = (slice(0, 3), slice(y0, y1), slice(x0, x1))
                if not np.array_equal(ds._input_block(1, where), full[:, y0:y1, x0:x1]):
                    bad.append((y0, y1, x0, x1))
    for y0 in cuts_h[:-1]:  # every row alone, against every column run
        if not np.array_equal(ds._input_block(1, (slice(1, 2), slice(y0, y0 + 1),
                                                  slice(0, w))), full[1:2, y0:y0 + 1]):
            bad.append((y0, "row"))
    assert not bad, bad
    if name == "mesh":
        mask = ds._target_block(1, (slice(0, 1), slice(0, h), slice(0, w)))
        for y0, y1, x0, x1 in [(0, 1, 0, w), (h - 1, h, 3, 4), (5, 40, 0, 1), (2, 3, 44, 45)]:
            np.testing.assert_array_equal(
                ds._target_block(1, (slice(0, 1), slice(y0, y1), slice(x0, x1))),
                mask[:, y0:y1, x0:x1])


@pytest.mark.parallel([1])
def test_mask_is_a_function_of_the_input():
    ds = MeshSynthetic(6, size=(32, 40), seed=4)
    x, y = whole(ds, list(range(6)))
    s = np.pad(x[:, 0] + x[:, 1] > 0, ((0, 0), (1, 1), (1, 1)), mode="edge").astype(int)
    votes = sum(s[:, dy:dy + 32, dx:dx + 40] for dy in range(3) for dx in range(3))
    np.testing.assert_array_equal(y[:, 0], (votes >= 5).astype(np.float32))
    assert 0.15 < y.mean() < 0.85, y.mean()           # both classes present
    assert not np.array_equal(y[0], y[1])              # it changes with the sample
    assert abs(x.mean()) < 0.3 and 0.6 < x.std() < 1.4  # roughly standardised fields
    # smooth fields: neighbouring pixels are strongly correlated
    assert np.corrcoef(x[:, :, :, 1:].ravel(), x[:, :, :, :-1].ravel())[0, 1] > 0.9
    # the same seed gives the same data, another seed other data
    np.testing.assert_array_equal(whole(MeshSynthetic(6, size=(32, 40), seed=4), [2])[0], x[2:3])
    assert not np.array_equal(whole(MeshSynthetic(6, size=(32, 40), seed=5), [2])[0], x[2:3])


@pytest.mark.parallel([1])
def test_imagenet_shapes_and_labels():
    ds = ImageNetSynthetic(300, num_classes=10)
    assert ds.sample_shape == (3, 224, 224) and len(ds) == 300
    labels = ds._labels(np.arange(300))
    assert set(labels.tolist()) == set(range(10))
    x, lab = ds.sample(0)
    assert x.shape == (3, 224, 224) and x.dtype == np.float32 and lab.shape == ()
    with pytest.raises(IndexError):
        ds.sample(300)
    g = dt.ProcessGrid((1,), MPI.COMM_SELF)
    with pytest.raises(ValueError, match="shape"):
        ds.batch([0, 1], dt.Distribution((3, 3, 224, 224), g, (None,) * 4))


# --------------------------------------------------------------------------- loader
@pytest.mark.parallel([1, 2, 3])
def test_loader_is_deterministic_and_the_same_on_every_rank():
    ds = DATASETS["mesh"]()
    layout = layouts()["sample x H"]
    a = Loader(ds, 5, layout, seed=7)
    b = Loader(ds, 5, layout, seed=7)
    e0, e1 = a.batches(0), a.batches(1)
    collective_assert(len(a) == 2 and [len(i) for i in e0] == [5, 5])
    collective_assert(all(np.array_equal(u, v) for u, v in zip(e0, b.batches(0))))
    collective_assert(not all(np.array_equal(u, v) for u, v in zip(e0, e1)), "epochs differ")
    everyone = comm.allgather([i.tolist() for i in e0 + e1])
    collective_assert(all(e == everyone[0] for e in everyone), "ranks disagree")
    full = Loader(ds, 5, layout, seed=7, drop_last=False)
    collective_assert(sorted(np.concatenate(full.batches(3)).tolist()) == list(range(12))
                      and len(full) == 3 and len(full.batches(3)[-1]) == 2)
    plain = Loader(ds, 4, layout, shuffle=False)
    collective_assert(np.concatenate(plain.batches(5)).tolist() == list(range(12)))

    # iteration: the batches of epoch 0, then of epoch 1, equal to direct generation
    seen = [(x, y) for x, y in a]
    collective_assert(a.epoch == 1 and len(seen) == 2)
    for (x, y), idx in zip(seen, e0):
        xw, yw = whole(ds, idx)
        collective_assert(np.array_equal(x.local, xw[x.dist.local_slices()])
                          and np.array_equal(y.local, yw[y.dist.local_slices()]))

    # resuming from a saved position gives the remaining batches
    it = iter(b)
    next(it)
    next(it)
    next(iter(b))  # epoch 1, batch 0
    state = b.state_dict()
    collective_assert(state == {"epoch": 1, "position": 1}, str(state))
    c = Loader(ds, 5, layout, seed=7)
    c.load_state_dict(state)
    rest = [x for x, _ in c]
    collective_assert(len(rest) == 1)
    xw, _ = whole(ds, e1[1])
    collective_assert(np.array_equal(rest[0].local, xw[rest[0].dist.local_slices()]))


@pytest.mark.parallel([1, 3])
def test_loader_target_layout_for_labels():
    ds = DATASETS["imagenet"]()
    p = comm.Get_size()
    loader = Loader(ds, 4, layouts()["sample x H"], target_layout=Layout(grid((p,)), (0,)),
                    shuffle=False)
    x, y = next(iter(loader))
    assert_equal(y, whole(ds, [0, 1, 2, 3])[1])
    collective_assert(x.shape == (4, 3, 10, 13))


# --------------------------------------------------------------------------- .npy files
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["mesh", "imagenet"])
def test_npy_dataset_round_trip(shared_dir, name):
    ds = DATASETS[name]()
    stored = [4, 1, 11, 1, 0]
    paths = save_npy_dataset(shared_dir / "data", ds, stored)
    collective_assert(all(os.path.exists(p) for p in paths) and len(paths) == 5)
    npy = NpyDataset(shared_dir / "data")
    collective_assert(len(npy) == 5 and npy.sample_shape == ds.sample_shape
                      and npy.target_shape == ds.target_shape)
    order = [3, 0, 4, 2]
    xw, yw = whole(ds, [stored[k] for k in order])
    for lname, layout in layouts().items():
        x, y = npy.batch(order, layout.distribution((4, *ds.sample_shape)))
        collective_assert(np.array_equal(x.local, xw[x.dist.local_slices()]), f"{lname}: x")
        if isinstance(y, dt.DistArray):
            collective_assert(np.array_equal(y.local, yw[y.dist.local_slices()]), f"{lname}: y")
        else:
            assert_equal(y, yw)
    # also from explicit file lists, without targets
    x, y = NpyDataset(paths).batch(order, layouts()["H"].distribution((4, *ds.sample_shape)))
    collective_assert(y is None and np.array_equal(x.local, xw[x.dist.local_slices()]))


@pytest.mark.parallel(SIZES)
def test_npy_dataset_memory_maps_and_reads_only_the_local_block(shared_dir, monkeypatch):
    ds = DATASETS["mesh"]()
    save_npy_dataset(shared_dir, ds, range(6))
    npy = NpyDataset(shared_dir)
    reads, modes = [], []
    load = np.load

    class Spy:
        def __init__(self, path, mm):
            self.path, self.mm = path, mm

        def __getitem__(self, key):
            reads.append((os.path.basename(self.path), key))
            return self.mm[key]

    def spy_load(path, mmap_mode=None, **kw):
        mm = load(path, mmap_mode=mmap_mode, **kw)
        modes.append((mmap_mode, type(mm).__name__))
        return Spy(path, mm)

    monkeypatch.setattr(np, "load", spy_load)
    dist = layouts()["sample x H"].distribution((6, *ds.sample_shape))
    x, y = npy.batch([5, 4, 3, 2, 1, 0], dist)
    monkeypatch.undo()
    sn, sc, sh, sw = dist.local_slices()
    want = sorted([(f"sample_{5 - j:06d}.npy", (sc, sh, sw)) for j in range(sn.start, sn.stop)]
                  + [(f"target_{5 - j:06d}.npy", (slice(0, 1), sh, sw))
                     for j in range(sn.start, sn.stop)], key=str)
    collective_assert(set(modes) <= {("r", "memmap")}, f"opened as {set(modes)}")
    collective_assert(sorted(reads, key=str) == want, f"read {reads}, expected {want}")
    for j in range(sn.stop - sn.start):
        block = np.load(shared_dir / f"sample_{5 - sn.start - j:06d}.npy")[sc, sh, sw]
        collective_assert(np.array_equal(x.local[j], block))


@pytest.mark.parallel([1, 2])
def test_npy_dataset_refuses_mismatched_files(shared_dir):
    if comm.Get_rank() == 0:
        np.save(shared_dir / "sample_000000.npy", np.zeros((2, 4, 4), np.float32))
        np.save(shared_dir / "sample_000001.npy", np.zeros((2, 4, 5), np.float32))
    comm.Barrier()
    with pytest.raises(ValueError, match="sample_000001"):
        NpyDataset(shared_dir)
    with pytest.raises(FileNotFoundError):
        NpyDataset(shared_dir / "nothing")
