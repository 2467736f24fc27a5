"""disttensor_nn.training.checkpoint: round trips, refusal of bad checkpoints, atomic saves.

Models whose arrays live in another array module (``array_api_strict``, on its
CPU device and on one that behaves like an accelerator's memory) checkpoint
and load too, and stay in their module and on their device.

Every refusal must raise the same CheckpointError (type and message) on every
rank and leave the model untouched; a failed save must leave the target as it
was and no temporary directory behind.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.backend import array_namespace, as_module, device_of, to_numpy
from disttensor.testing import assert_equal, collective_assert
from disttensor_nn.training import checkpoint as ckpt
from disttensor_nn.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3, 4]
X_SHAPE = (4, 2, 9, 7)


@functools.cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


def grid2_shape(p: int) -> tuple[int, int]:
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


def make_model(seed: int = 0, width: int = 4) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, width, 3, padding=1, seed=seed),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Residual(nn.Conv2d(width, width, 3, padding=1, seed=seed + 1)),
        nn.Conv2d(width, 1, 1, seed=seed + 2),
    )


def batch(seed: int) -> tuple[dt.DistArray, np.ndarray]:
    """An input split over H (every rank holds a block) and a global target."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(X_SHAPE).astype(np.float32)
    t = rng.standard_normal((X_SHAPE[0], 1, *X_SHAPE[2:])).astype(np.float32)
    dist = dt.Distribution(X_SHAPE, grid((comm.Get_size(),)), (None, None, 0, None))
    return dt.DistArray.from_global(x, dist), t


def train(model: nn.Layer, opt: nn.SGD, steps: int, seed: int = 0) -> None:
    loss = nn.MSELoss()
    for s in range(steps):
        x, t = batch(seed + s)
        opt.zero_grad()
        loss(model(x), t)
        model.backward(loss.backward())
        opt.step()


def trained(seed: int = 0) -> tuple[nn.Sequential, nn.SGD]:
    model = make_model(seed)
    opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, opt, 2)
    return model, opt


def untrained(seed: int = 0) -> tuple[nn.Sequential, nn.SGD]:
    """A model and an SGD with momentum buffers, without the cost of training."""
    model = make_model(seed)
    opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, p in enumerate(model.parameters()):
        p.grad[...] = np.cos(np.arange(p.data.size) + i).reshape(p.data.shape)
    opt.step()
    return model, opt


def snapshot(model: nn.Layer, opt: nn.SGD) -> list[np.ndarray]:
    out = [p.data.copy() for p in model.parameters()]
    out += [getattr(layer, a).copy() for _, layer, a in ckpt.named_buffers(model)]
    return out + [b.copy() for b in opt.state if b is not None]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        u.dtype == v.dtype and np.array_equal(u, v) for u, v in zip(a, b))


def dist_arrays() -> dict[str, dt.DistArray]:
    """A sample x H split array, a fully replicated one and one with replicas on a grid axis."""
    p = comm.Get_size()
    g2 = grid(grid2_shape(p))
    a = np.arange(np.prod(X_SHAPE), dtype=np.float32).reshape(X_SHAPE) / 7
    b = np.arange(30, dtype=np.int64).reshape(5, 6) * 3 - 11
    return {
        "split": dt.DistArray.from_global(a, dt.Distribution(X_SHAPE, g2, (0, None, 1, None))),
        "replicated": dt.DistArray.from_global(b, dt.Distribution((5, 6), g2, (None, None))),
        "replica axis": dt.DistArray.from_global(a[0, 0], dt.Distribution((9, 7), g2, (1, None))),
    }


def refusal(fn, *args, **kw) -> str:
    """Call ``fn``, require a CheckpointError with the same message on every rank; return it."""
    try:
        fn(*args, **kw)
        msg = None
    except CheckpointError as exc:
        msg = str(exc)
    everyone = comm.allgather(msg)
    collective_assert(msg is not None, "no CheckpointError was raised")
    collective_assert(all(m == everyone[0] for m in everyone), f"messages differ: {everyone}")
    return msg


# --------------------------------------------------------------------------- round trip
@pytest.mark.parallel(SIZES)
def test_round_trip_restores_model_optimizer_rng_extra_and_arrays(shared_dir):
    model, opt = trained()
    rng = np.random.default_rng(42)
    rng.random(3)
    extra = {"loader": {"epoch": 3, "position": 1}, "name": "run-1", "pair": (1, 2.5),
             "table": np.arange(4.0), "scalar": np.float32(1.5), "none": None, 7: [True]}
    arrays = dist_arrays()
    path = save_checkpoint(shared_dir / "ckpt", model, opt, step=17, rng_state=rng,
                           extra=extra, arrays=arrays)
    collective_assert(os.path.isfile(os.path.join(path, "manifest.json")))
    leftovers = [f for f in os.listdir(shared_dir) if f != "ckpt"]
    collective_assert(not leftovers, f"left behind: {leftovers}")

    fresh = make_model(seed=9)
    fresh_opt = nn.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    collective_assert(not same(snapshot(fresh, fresh_opt), snapshot(model, opt)))
    # read the arrays into other distributions: W-split, and a new array from a Distribution
    p = comm.Get_size()
    w_split = dt.DistArray.zeros(dt.Distribution(X_SHAPE, grid((p,)), (None, None, None, 0)),
                                 np.float32)
    out = load_checkpoint(path, fresh, fresh_opt,
                          arrays={"split": w_split,
                                  "replicated": dt.Distribution((5, 6), grid((p,)), (0, None))})
    collective_assert(same(snapshot(fresh, fresh_opt), snapshot(model, opt)), "state differs")
    collective_assert(out["step"] == 17)
    collective_assert(out["rng_state"] == rng.bit_generator.state, str(out["rng_state"]))
    restored = np.random.default_rng()
    restored.bit_generator.state = out["rng_state"]
    collective_assert(np.array_equal(restored.random(5), rng.random(5)))
    e = out["extra"]
    collective_assert(e["loader"] == extra["loader"] and e["name"] == "run-1"
                      and e["pair"] == (1, 2.5) and e["none"] is None and e[7] == [True]
                      and np.array_equal(e["table"], extra["table"])
                      and type(e["scalar"]) is np.float32 and e["scalar"] == 1.5, str(e))
    collective_assert(out["arrays"]["split"] is w_split)
    assert_equal(w_split, arrays["split"].to_global())
    assert_equal(out["arrays"]["replicated"], arrays["replicated"].to_global())
    collective_assert(out["array_names"] == ["replica axis", "replicated", "split"])
    # every saved array is a standard .npy holding the global array
    for name, a in arrays.items():
        fname = {e["name"]: e["file"] for e in out["manifest"]["arrays"]}[name]
        collective_assert(np.array_equal(np.load(os.path.join(path, fname)), a.to_global()))

    # training goes on identically from the restored state
    train(model, opt, 1, seed=5)
    train(fresh, fresh_opt, 1, seed=5)
    collective_assert(same(snapshot(fresh, fresh_opt), snapshot(model, opt)), "diverged")


@pytest.mark.parallel([1, 3])
def test_manifest_describes_the_checkpoint(shared_dir):
    model, opt = untrained()
    path = save_checkpoint(shared_dir / "c", model, opt, step=3, arrays=dist_arrays())
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    names = [e["name"] for e in m["parameters"]]
    want = ["0.weight", "0.bias", "1.weight", "1.bias", "3.branch.weight", "3.branch.bias",
            "4.weight", "4.bias"]
    collective_assert(names == want, str(names))
    collective_assert([e["name"] for e in m["buffers"]] == ["1.running_mean", "1.running_var"])
    collective_assert(m["parameters"][0]["shape"] == [4, 2, 3, 3]
                      and m["parameters"][0]["dtype"] == np.dtype(np.float32).str)
    collective_assert(m["version"] == ckpt.VERSION and m["step"] == 3
                      and m["optimizer"]["class"] == "SGD")
    collective_assert(sorted(m["files"]) == ["array_000.npy", "array_001.npy", "array_002.npy",
                                             "state.npz"]
                      and all(len(v["sha256"]) == 64 for v in m["files"].values()))


@pytest.mark.parallel([1, 3])
def test_overwrite_replaces_a_checkpoint(shared_dir):
    model, opt = untrained()
    save_checkpoint(shared_dir / "c", model, opt, step=1)
    opt.step()
    save_checkpoint(shared_dir / "c", model, opt, step=2)
    fresh = make_model(5)
    fresh_opt = nn.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    collective_assert(load_checkpoint(shared_dir / "c", fresh, fresh_opt)["step"] == 2)
    collective_assert(same(snapshot(fresh, fresh_opt), snapshot(model, opt)))
    collective_assert(os.listdir(shared_dir) == ["c"], str(os.listdir(shared_dir)))
    # a directory that is not a checkpoint is never replaced
    if comm.Get_rank() == 0:
        os.makedirs(shared_dir / "data")
        (shared_dir / "data" / "keep.txt").write_text("precious")
    comm.Barrier()
    msg = refusal(save_checkpoint, shared_dir / "data", model, opt, step=3)
    collective_assert("not a checkpoint" in msg, msg)
    collective_assert((shared_dir / "data" / "keep.txt").read_text() == "precious")


# --------------------------------------------------------------------------- refusals
def _flip(path: pathlib.Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 9])


DAMAGE = {
    "flipped byte in state": (lambda d: _flip(d / "state.npz"), "corrupt"),
    "flipped byte in array": (lambda d: _flip(d / "array_001.npy", 0.9), "corrupt"),
    "truncated array": (lambda d: _truncate(d / "array_000.npy"), "truncated"),
    "truncated state": (lambda d: _truncate(d / "state.npz"), "truncated"),
    "missing array": (lambda d: os.remove(d / "array_002.npy"), "missing"),
    "flipped byte in manifest": (lambda d: _flip(d / "manifest.json", 0.3), "corrupt"),
    "edited manifest": (lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"step": 11', '"step": 12')), "corrupt"),
    "missing manifest": (lambda d: os.remove(d / "manifest.json"), "manifest.json is missing"),
    "no checkpoint": (lambda d: os.rename(d, d.with_name("elsewhere")), "no checkpoint"),
}


@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_on_every_rank(shared_dir, damage):
    model, opt = untrained()
    path = pathlib.Path(save_checkpoint(shared_dir / "c", model, opt, step=11,
                                        arrays=dist_arrays()))
    spoil, words = DAMAGE[damage]
    if comm.Get_rank() == 0:
        spoil(path)
    comm.Barrier()
    fresh = make_model(seed=4)
    fresh_opt = nn.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    before = snapshot(fresh, fresh_opt)
    targets = {k: dt.DistArray.zeros(a.dist, a.dtype) for k, a in dist_arrays().items()}
    msg = refusal(load_checkpoint, path, fresh, fresh_opt, arrays=targets)
    collective_assert(words in msg, msg)
    collective_assert(same(snapshot(fresh, fresh_opt), before), "the model was changed")
    collective_assert(all(not a.local.any() for a in targets.values()), "an array was changed")


@pytest.mark.parallel([1, 3])
def test_mismatched_model_optimizer_or_arrays_are_refused(shared_dir):
    model, opt = untrained()
    path = save_checkpoint(shared_dir / "c", model, opt, step=1, arrays=dist_arrays())

    wider = make_model(width=5)
    msg = refusal(load_checkpoint, path, wider, nn.SGD(wider.parameters(), lr=0.1))
    collective_assert("different model" in msg and "0.weight" in msg, msg)

    shorter = nn.Sequential(*list(make_model())[:3])
    msg = refusal(load_checkpoint, path, shorter, None)
    collective_assert("different model" in msg, msg)

    double = make_model()
    for p in double.parameters():
        p.data = p.data.astype(np.float64)
    msg = refusal(load_checkpoint, path, double, None)
    collective_assert("float64" in msg, msg)

    other = make_model()
    msg = refusal(load_checkpoint, path, other, nn.SGD(list(other.parameters())[:3], lr=0.1))
    collective_assert("optimizer state" in msg, msg)

    p = comm.Get_size()
    wrong = dt.DistArray.zeros(dt.Distribution((4, 2, 9, 8), grid((p,)), (0, None, None, None)),
                               np.float32)
    msg = refusal(load_checkpoint, path, other, None, arrays={"split": wrong})
    collective_assert("shape" in msg and "split" in msg, msg)
    msg = refusal(load_checkpoint, path, other, None, arrays={"absent": wrong})
    collective_assert("absent" in msg, msg)

    # without optimizer state, an optimizer cannot be restored
    path2 = save_checkpoint(shared_dir / "c2", model, None, step=1)
    msg = refusal(load_checkpoint, path2, other, nn.SGD(other.parameters(), lr=0.1))
    collective_assert("no optimizer state" in msg, msg)
    collective_assert(load_checkpoint(path2, other, None)["step"] == 1)


# --------------------------------------------------------------------------- atomicity
@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("stage", ["block write", "manifest"])
def test_failed_save_leaves_the_previous_checkpoint_and_no_debris(shared_dir, monkeypatch,
                                                                  stage):
    model, opt = untrained()
    old = snapshot(model, opt)
    save_checkpoint(shared_dir / "c", model, opt, step=1, arrays=dist_arrays())
    opt.step()
    failing_rank = comm.Get_size() - 1 if stage == "block write" else 0

    def broken(*args, **kw):
        raise OSError("disk full (simulated)")

    if comm.Get_rank() == failing_rank:
        monkeypatch.setattr(ckpt, "_write_block" if stage == "block write" else
                            "_write_manifest", broken)
    for target in ("c", "new"):  # over a previous checkpoint, and into a fresh path
        msg = refusal(save_checkpoint, shared_dir / target, model, opt, step=2,
                      arrays=dist_arrays())
        collective_assert("disk full (simulated)" in msg and f"rank(s) [{failing_rank}]" in msg,
                          msg)
    monkeypatch.undo()
    collective_assert(sorted(os.listdir(shared_dir)) == ["c"], str(os.listdir(shared_dir)))
    fresh = make_model(3)
    fresh_opt = nn.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    collective_assert(load_checkpoint(shared_dir / "c", fresh, fresh_opt)["step"] == 1)
    collective_assert(same(snapshot(fresh, fresh_opt), old), "the old checkpoint changed")


@pytest.mark.parallel([1, 2])
def test_unstorable_values_are_refused_before_anything_is_written(shared_dir):
    model, opt = untrained()
    msg = refusal(save_checkpoint, shared_dir / "c", model, opt, step=1, extra={"f": len})
    collective_assert("builtin_function_or_method" in msg, msg)
    msg = refusal(save_checkpoint, shared_dir / "c", model, opt, step=1,
                  arrays={"x": np.zeros(3)})
    collective_assert("DistArray" in msg, msg)
    collective_assert(os.listdir(shared_dir) == [], str(os.listdir(shared_dir)))


# --------------------------------------------------------------------------- other array modules
def host_snapshot(model: nn.Layer, opt: nn.SGD) -> list[np.ndarray]:
    """NumPy copies of the state_dict values and momentum buffers, whatever their module."""
    out = [np.array(to_numpy(v), copy=True) for v in model.state_dict().values()]
    return out + [np.array(to_numpy(b), copy=True) for b in opt.state if b is not None]


def step_with(opt: nn.SGD, seed: int) -> None:
    """One SGD step with deterministic gradients, in the parameters' array module."""
    for i, p in enumerate(opt.params):
        g = np.sin(np.arange(p.data.size) + seed + i).reshape(p.shape).astype(np.float32)
        p.grad = as_module(g, array_namespace(p.data), device_of(p.data))
    opt.step()


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("device", [None, "device1"])
def test_a_model_in_another_array_module_checkpoints_and_loads(shared_dir, device):
    xps = pytest.importorskip("array_api_strict")
    dev = None if device is None else xps.Device(device)
    model = make_model().to(xps, dev)
    model[1].running_mean = xps.asarray(np.linspace(-1, 1, 4), device=dev)
    opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step_with(opt, 0)
    saved = host_snapshot(model, opt)
    path = save_checkpoint(shared_dir / "c", model, opt, step=4)
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    collective_assert(m["parameters"][0]["dtype"] == np.dtype(np.float32).str
                      and [e["name"] for e in m["buffers"]] == ["1.running_mean",
                                                                "1.running_var"])

    fresh = make_model(seed=9).to(xps, dev)
    fresh_opt = nn.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    collective_assert(not same(host_snapshot(fresh, fresh_opt), saved))
    collective_assert(load_checkpoint(path, fresh, fresh_opt)["step"] == 4)
    collective_assert(same(host_snapshot(fresh, fresh_opt), saved), "state differs")
    want = xps.asarray(np.zeros(1), device=dev).device
    arrays = list(fresh.state_dict().values()) + [p.grad for p in fresh.parameters()] + \
        [b for b in fresh_opt.state if b is not None]
    collective_assert(all(array_namespace(a) is xps and a.device == want for a in arrays),
                      "loading moved arrays out of their module or device")
    # the optimizer goes on identically from the restored state
    step_with(opt, 1)
    step_with(fresh_opt, 1)
    collective_assert(same(host_snapshot(fresh, fresh_opt), host_snapshot(model, opt)),
                      "diverged")
    # and a NumPy model loads the same checkpoint
    host = make_model(seed=5)
    host_opt = nn.SGD(host.parameters(), lr=0.05, momentum=0.9)
    load_checkpoint(path, host, host_opt)
    collective_assert(same(host_snapshot(host, host_opt), saved), "NumPy model differs")
    collective_assert(all(isinstance(a, np.ndarray) for a in host.state_dict().values()))


# --------------------------------------------------------------------------- crash atomicity
_DYING_WRITER = """
import os, shutil, sys
import numpy as np
from mpi4py import MPI
import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.training import checkpoint as ckpt

target, die_at = sys.argv[1], int(sys.argv[2])
model = nn.Sequential(nn.Conv2d(2, 3, 3, seed=0), nn.BatchNorm2d(3))
g = dt.ProcessGrid((1,), comm=MPI.COMM_SELF)
arr = lambda v: {"a": dt.DistArray.from_global(np.full((5, 4), v, np.float32),
                                                dt.Distribution((5, 4), g, (0, None)))}
ckpt.save_checkpoint(target, model, None, step=1, arrays=arr(1.0), comm=MPI.COMM_SELF)
for p in model.parameters():
    p.data += 1
steps = [0]


def dying(fn):
    def wrapper(*args, **kw):
        if steps[0] == die_at:
            os._exit(17)  # the writer dies here, without any cleanup
        steps[0] += 1
        return fn(*args, **kw)
    return wrapper


for name in ("replace", "fsync", "mkdir", "makedirs", "rename"):
    setattr(os, name, dying(getattr(os, name)))
shutil.rmtree = dying(shutil.rmtree)
for name in ("_write_state", "_create_array_file", "_write_block", "_write_manifest"):
    setattr(ckpt, name, dying(getattr(ckpt, name)))
ckpt.save_checkpoint(target, model, None, step=2, arrays=arr(2.0), comm=MPI.COMM_SELF)
"""


@pytest.mark.parallel([1])
def test_a_writer_killed_at_any_step_of_a_save_leaves_a_loadable_checkpoint(tmp_path):
    (tmp_path / "writer.py").write_text(_DYING_WRITER)
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    expected = {1: [p.data.copy() for p in nn.Sequential(
        nn.Conv2d(2, 3, 3, seed=0), nn.BatchNorm2d(3)).parameters()]}
    expected[2] = [w + 1 for w in expected[1]]
    g = dt.ProcessGrid((1,), comm=MPI.COMM_SELF)
    seen, recovered = [], 0
    for die_at in range(60):
        target = tmp_path / f"run{die_at}" / "ckpt"
        rc = subprocess.run([sys.executable, str(tmp_path / "writer.py"), str(target),
                             str(die_at)], env=env, timeout=120).returncode
        assert rc in (0, 17), rc
        recovered += not target.exists()
        model = nn.Sequential(nn.Conv2d(2, 3, 3, seed=7), nn.BatchNorm2d(3))
        state = load_checkpoint(target, model, None, comm=MPI.COMM_SELF,
                                arrays={"a": dt.Distribution((5, 4), g, (0, None))})
        step = state["step"]
        assert step in (1, 2), step
        assert all(np.array_equal(p.data, w) for p, w in zip(model.parameters(), expected[step]))
        assert np.all(state["arrays"]["a"].local == step)
        assert target.is_dir() and (target / "manifest.json").exists()
        seen.append(step)
        if rc == 0:
            break
    assert rc == 0 and seen[-1] == 2, seen
    assert recovered, "no kill fell between the two renames of the commit"
    assert 1 in seen and seen.index(2) < len(seen) - 1, seen  # old before, new after the commit
    # the next save clears what the interrupted commits left beside the target
    for run in tmp_path.glob("run*"):
        model = nn.Sequential(nn.Conv2d(2, 3, 3, seed=0), nn.BatchNorm2d(3))
        save_checkpoint(run / "ckpt", model, None, step=3, comm=MPI.COMM_SELF)
        assert sorted(os.listdir(run)) == ["ckpt"], os.listdir(run)


# --------------------------------------------------------------------------- load validates first
@pytest.mark.parallel([1, 2, 3])
def test_load_refuses_bad_or_rank_dependent_arguments_before_changing_anything(shared_dir):
    model, opt = untrained()
    path = save_checkpoint(shared_dir / "c", model, opt, step=1, arrays=dist_arrays())
    p, r = comm.Get_size(), comm.Get_rank()
    other, other_opt = untrained(seed=4)
    before = snapshot(other, other_opt)

    gridless = dt.Distribution(X_SHAPE, grid2_shape(p), (0, None, 1, None))
    msg = refusal(load_checkpoint, path, other, other_opt, arrays={"split": gridless})
    collective_assert("no process grid" in msg and "split" in msg, msg)
    collective_assert(same(snapshot(other, other_opt), before), "the model changed")

    msg = refusal(load_checkpoint, path, other, other_opt, arrays={3: gridless})
    collective_assert("str" in msg, msg)

    if p > 1:
        # a name or a distribution that differs on one rank
        dist = dt.Distribution(X_SHAPE, grid(grid2_shape(p)), (0, None, 1, None))
        names = {"split": dist} if r else {"replicated": dt.Distribution(
            (5, 6), grid(grid2_shape(p)), (None, None))}
        msg = refusal(load_checkpoint, path, other, other_opt, arrays=names)
        collective_assert("differ between ranks" in msg and "arrays" in msg, msg)
        shapes = dist if r != p - 1 else dt.Distribution((4, 2, 9, 8), grid(grid2_shape(p)),
                                                         (0, None, 1, None))
        msg = refusal(load_checkpoint, path, other, other_opt, arrays={"split": shapes})
        collective_assert("differ between ranks" in msg, msg)
        # a model that differs on one rank
        odd = make_model(width=5) if r == p - 1 else make_model()
        msg = refusal(load_checkpoint, path, odd, None)
        collective_assert("model parameters differ between ranks" in msg, msg)
        collective_assert(same(snapshot(other, other_opt), before), "the model changed")
    state = load_checkpoint(path, other, other_opt,
                            arrays={"split": dt.Distribution(X_SHAPE, grid(grid2_shape(p)),
                                                             (0, None, 1, None))})
    assert_equal(state["arrays"]["split"], dist_arrays()["split"].to_global())
    collective_assert(same(snapshot(other, other_opt), snapshot(model, opt)))


@pytest.mark.parallel([2, 3])
def test_save_refuses_rank_dependent_arguments_before_writing(shared_dir):
    model, opt = untrained()
    r = comm.Get_rank()
    msg = refusal(save_checkpoint, shared_dir / "c", model, opt, step=5 + (r == 1))
    collective_assert("rank(s) [1]" in msg and "every rank must pass the same" in msg, msg)
    arrays = dist_arrays()
    if r == comm.Get_size() - 1:
        arrays["other name"] = arrays.pop("split")
    msg = refusal(save_checkpoint, shared_dir / "c", model, opt, step=5, arrays=arrays)
    collective_assert(f"rank(s) [{comm.Get_size() - 1}]" in msg, msg)
    collective_assert(os.listdir(shared_dir) == [], str(os.listdir(shared_dir)))
