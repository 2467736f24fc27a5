"""``disttensor-train --model-file PATH.py:FUNCTION`` and ``disttensor-plan --model-file``.

A plain PyTorch model (convolutions, batch norm, ReLU, max pooling, a transposed
convolution and a U-Net-like ``cat`` skip) is written to a file; the command line trains
it on 1 to 3 ranks, and its checkpoint's weights, read from the checkpoint's files, must
equal those of the same steps of plain PyTorch in one process (``torch.optim`` on the mean
squared error, all samples in every step) within 1e-5 relative. Plans are made on a
published machine profile, which times nothing, so every rank and run plans alike. Bad
arguments end the job with one usage message from rank 0 (exit 2) before any work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import mpi_helpers
import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)

from disttensor_nn.plan import Plan  # noqa: E402
from disttensor_nn.training.cli import plan_main, predict_main, train_main  # noqa: E402
from disttensor_nn.training.data import NoiseDataset  # noqa: E402

V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing
comm = MPI.COMM_WORLD
torch.set_num_threads(1)

MODEL_SOURCE = '''
import torch
from torch import nn


class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(4), nn.ReLU())
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        return self.out(torch.cat([e, self.up(self.mid(self.down(e)))], 1))


def build():
    return SkipNet()


class Volume(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 3, 3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.pool = nn.AvgPool3d(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out = nn.Conv3d(6, 1, 1)

    def forward(self, x):
        e = torch.relu(self.norm(self.conv(x)))
        return self.out(torch.cat([e, self.up(self.pool(e))], 1))


def build_3d():
    return Volume()


def not_a_module():
    return "a string"


def raises():
    raise RuntimeError("no weights here")


NOT_CALLABLE = 3
'''
C, H, W, N = 2, 12, 10, 4


def shared_tmpdir() -> str:
    return mpi_helpers.shared_tmpdir("dt-model-file-", comm)


def model_file(directory: str) -> str:
    path = os.path.join(directory, "skipnet.py")
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            f.write(MODEL_SOURCE)
    comm.Barrier()
    return path


def npy_data(directory: str) -> tuple[str, np.ndarray, np.ndarray]:
    """A directory of input.npy (N, C, H, W) and target.npy (N, 1, H, W), random."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    t = rng.standard_normal((N, 1, H, W)).astype(np.float32)
    path = os.path.join(directory, "data")
    if comm.Get_rank() == 0:
        os.makedirs(path)
        np.save(os.path.join(path, "input.npy"), x)
        np.save(os.path.join(path, "target.npy"), t)
    comm.Barrier()
    return path, x, t


def source_model(fn: str = "build", seed: int | None = 0) -> torch.nn.Module:
    """``fn()`` of MODEL_SOURCE in this process (after ``torch.manual_seed(seed)``, unless
    None)."""
    ns: dict = {}
    exec(compile(MODEL_SOURCE, "skipnet.py", "exec"), ns)
    if seed is not None:
        torch.manual_seed(seed)
    return ns[fn]()


def reference(x: np.ndarray, t: np.ndarray, steps: int, optimizer: str, lr: float,
              seed: int = 0) -> dict[str, np.ndarray]:
    """The model of MODEL_SOURCE trained in this process alone, every sample in each step."""
    model = source_model(seed=seed)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(t)).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def checkpoint_state(directory: str) -> dict[str, np.ndarray]:
    """The parameters and buffers of a checkpoint, read from its manifest and state.npz."""
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    with np.load(os.path.join(directory, "state.npz")) as npz:
        return {e["name"]: npz[e["key"]] for e in manifest["parameters"] + manifest["buffers"]}


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    bad = []
    for name, ref in want.items():
        if name not in got:
            bad.append(f"{name}: missing")
            continue
        value = np.asarray(got[name], dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
        err = np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-30)
        if value.shape != ref.shape or err > 1e-5:
            bad.append(f"{name}: relative error {err:.2e}")
    collective_assert(not bad and set(got) == set(want), "; ".join(bad) +
                      f" (names {sorted(set(got) ^ set(want))} differ)")


def mixed_plan_file(directory: str, path: str, batch: int, capsys, fn: str = "build",
                    channels: int = C, size: str = f"{H}x{W}", samples: bool = False) -> str:
    """disttensor-plan's plan for the model, its layers' grids changed to cycle through
    every split of one dimension (N, H, W: uneven blocks at 3 ranks), or with ``samples``
    all to split N, as a JSON file."""
    auto = os.path.join(directory, "auto.json")
    assert plan_main(["--model-file", f"{path}:{fn}", "--in-channels", str(channels),
                      "--size", size, "--batch", str(batch), "--machine", V100, "--json",
                      auto]) == 0
    capsys.readouterr()
    comm.Barrier()  # rank 0 writes the file
    with open(auto) as f:
        plan = Plan.from_json(f.read())
    p, ndim = comm.Get_size(), len(plan.entries[0].grid)
    grids = [tuple(p if k == d else 1 for k in range(ndim)) for d in range(ndim)]
    plan = dataclasses.replace(plan, entries=[
        dataclasses.replace(e, grid=grids[0 if samples else (i + 1) % ndim])
        for i, e in enumerate(plan.entries)])
    mixed = os.path.join(directory, "mixed.json")
    if comm.Get_rank() == 0:
        with open(mixed, "w") as f:
            f.write(plan.to_json())
    comm.Barrier()
    return mixed


def base(path: str, *extra: str) -> list[str]:
    return ["--model-file", f"{path}:build", "--machine", V100, "--no-progress",
            "--metrics", "", *extra]


# ------------------------------------------------------------------ training
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 0.01)])
@pytest.mark.parametrize("layout", ["auto", "mixed"])
def test_model_file_trains_as_plain_torch_in_one_process(layout, optimizer, lr, capsys):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, t = npy_data(tmp)
    ck = os.path.join(tmp, "ck")
    plan = "auto" if layout == "auto" else mixed_plan_file(tmp, path, N, capsys)
    assert train_main(base(path, "--data", data, "--batch", str(N), "--steps", "3",
                           "--optimizer", optimizer, "--lr", str(lr), "--ranks-layout", plan,
                           "--checkpoint", ck)) == 0
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert "enc.0 Conv2d" in out and "predicted time per iteration" in out, out
        assert f"skipnet.py:build ({N}, {C}, {H}, {W}) on {comm.Get_size()} rank" in out, out
    assert_close(checkpoint_state(ck), reference(x, t, 3, optimizer, lr))
    # the checkpoint's parameters load into the unwrapped model, by its state_dict names
    plain = source_model(seed=None)
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint_state(ck).items()})


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_model_file_trains_on_hdf5_and_zarr(fmt, capsys):
    """The user's model trains on an HDF5 file and on a Zarr group (data sets input and
    target) as plain torch does in one process on the same samples."""
    pytest.importorskip("h5py" if fmt == "h5" else "zarr")
    tmp = shared_tmpdir()
    path = model_file(tmp)
    _, x, t = npy_data(tmp)
    data = os.path.join(tmp, f"data.{fmt}")
    if comm.Get_rank() == 0:
        if fmt == "h5":
            import h5py

            with h5py.File(data, "w") as f:
                f["input"], f["target"] = x, t
        else:
            import zarr

            group = zarr.open_group(data, mode="w")
            for name, values in (("input", x), ("target", t)):
                group.create_array(name, shape=values.shape, dtype=values.dtype,
                                   chunks=(1, *values.shape[1:]))[...] = values
    comm.Barrier()
    ck = os.path.join(tmp, f"ck-{fmt}")
    assert train_main(base(path, "--data", data, "--batch", str(N), "--steps", "3",
                           "--lr", "0.05", "--checkpoint", ck)) == 0
    capsys.readouterr()
    assert_close(checkpoint_state(ck), reference(x, t, 3, "sgd", 0.05))


@pytest.mark.parallel([1, 2, 3])
def test_group_batch_norm_statistics_train_as_ddp_does(capsys):
    """--bn-stats group with the samples split: the parameters after three steps are those
    of one process that runs the model on each rank's samples apart (each group's own
    batch statistics, PyTorch's under DDP) and steps on the whole batch's loss."""
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, t = npy_data(tmp)
    ck = os.path.join(tmp, "ck-group")
    plan = mixed_plan_file(tmp, path, N, capsys, samples=True)
    assert train_main(base(path, "--data", data, "--batch", str(N), "--steps", "3",
                           "--lr", "0.05", "--ranks-layout", plan, "--bn-stats", "group",
                           "--checkpoint", ck)) == 0
    capsys.readouterr()
    model = source_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # the samples' blocks as the plan splits them (larger blocks first)
    cuts = dt.Distribution((N, C, H, W), dt.ProcessGrid((comm.Get_size(), 1, 1, 1))
                           ).boundaries[0]
    for step in range(3):  # a batch of every sample, in the loader's order of the epoch
        order = np.random.default_rng([0, step]).permutation(N)
        xt, tt = torch.from_numpy(x[order]), torch.from_numpy(t[order])
        opt.zero_grad()
        y = torch.cat([model(xt[lo:hi]) for lo, hi in zip(cuts, cuts[1:]) if hi > lo])
        F.mse_loss(y, tt).backward()
        opt.step()
    want = {k: v.detach().numpy() for k, v in model.named_parameters()}
    got = checkpoint_state(ck)
    assert_close({k: got[k] for k in want if k in got}, want)


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_precision_trains_as_torch_autocast_does(precision, capsys):
    """--precision bf16|fp16: the forward under torch.autocast, float32 weights; fp16's loss
    scaled by torch's GradScaler, the same steps skipped as in one process (targets of 1e3:
    the scaled output gradient overflows float16 until the scale has come down)."""
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, t = npy_data(tmp)
    if precision == "fp16":
        t = t * 1000
        if comm.Get_rank() == 0:
            np.save(os.path.join(data, "target.npy"), t)
        comm.Barrier()
    ck, metrics = os.path.join(tmp, "ck"), os.path.join(tmp, "run")
    assert train_main(base(path, "--data", data, "--batch", str(N), "--steps", "4",
                           "--lr", "0.05", "--precision", precision, "--checkpoint", ck,
                           "--metrics", metrics)) == 0
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert f"precision {precision}: the forward under torch.autocast" in out, out
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model = source_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    skipped = 0
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            y = model(torch.from_numpy(x))
        scaler.scale(F.mse_loss(y.float(), torch.from_numpy(t))).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += precision == "fp16" and scaler.get_scale() < before
    with open(metrics + ".json") as f:
        summary = json.load(f)["summary"]
    collective_assert((skipped > 0) == (precision == "fp16"), f"{skipped} skipped")
    collective_assert(summary["precision"] == precision
                      and summary["skipped_steps"] == skipped
                      and summary["loss_scale"] == (scaler.get_scale() if precision == "fp16"
                                                    else None), str(summary))
    got = checkpoint_state(ck)
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    bad = []
    for name, ref in want.items():
        value, ref = np.asarray(got[name], np.float64), np.asarray(ref, np.float64)
        err = np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-30)
        if got[name].dtype != np.dtype(np.float32) and name in dict(model.named_parameters()):
            bad.append(f"{name} saved as {got[name].dtype}")
        if err > 5e-3:  # 16-bit activations: gradients within a few roundings of 2**-8
            bad.append(f"{name}: {err:.2e}")
    collective_assert(not bad, "; ".join(bad))


@pytest.mark.parallel([1, 2, 3])
def test_accumulated_micro_batches_are_one_step(capsys):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, t = npy_data(tmp)
    ck = os.path.join(tmp, "ck")
    assert train_main(base(path, "--data", data, "--batch", "2", "--accumulate", "2",
                           "--steps", "2", "--lr", "0.05", "--checkpoint", ck)) == 0
    capsys.readouterr()
    model = source_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(2):  # the Loader's order: a permutation per epoch
        order = np.random.default_rng([0, epoch]).permutation(N)
        opt.zero_grad()
        for micro in (order[:2], order[2:]):
            loss = F.mse_loss(model(torch.from_numpy(x[micro])), torch.from_numpy(t[micro]))
            (loss / 2).backward()
        opt.step()
    assert_close(checkpoint_state(ck), {k: v.detach().numpy()
                                        for k, v in model.state_dict().items()})


@pytest.mark.parallel([1, 2, 3])
def test_synthetic_data_are_noise_of_the_model_shapes(capsys):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    ck = os.path.join(tmp, "ck")
    metrics = os.path.join(tmp, "run")
    run = base(path, "--in-channels", str(C), "--size", f"{H}x{W}", "--batch", "2",
               "--samples", "2", "--steps", "3", "--lr", "0.05")
    assert train_main(run + ["--checkpoint", ck, "--metrics", metrics]) == 0
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:  # the blocks made once, before the first step, and kept
        assert "a rank takes in this run made ahead and kept" in out, out
    data = NoiseDataset(2, (C, H, W), (1, H, W), seed=0)
    x, t = (np.stack(a) for a in zip(*(data.sample(i) for i in range(2))))
    assert x.shape == (2, C, H, W) and t.shape == (2, 1, H, W)
    assert -1 <= x.min() < -0.5 and 0.5 < x.max() < 1
    assert_close(checkpoint_state(ck), reference(x, t, 3, "sgd", 0.05))
    # made in every step instead: the same weights
    fresh = os.path.join(tmp, "fresh")
    assert train_main(run + ["--checkpoint", fresh, "--no-keep-data"]) == 0
    out = capsys.readouterr().out
    assert "made ahead" not in out, out
    a, b = checkpoint_state(ck), checkpoint_state(fresh)
    collective_assert(all(np.array_equal(a[k], b[k]) for k in a), "kept data changed a weight")
    with open(metrics + ".json") as f:
        summary = json.load(f)["summary"]
    assert summary["output_shape"] == [2, 1, H, W] and len(summary["history"]) == 3
    assert summary["predicted_time_per_iteration_s"] > 0
    # the predicted peak holds the process (measured before planning) besides the model's
    # data, as the built-in models' does; the kept blocks are reported beside it
    baseline = summary["predicted_baseline_memory_bytes"]
    assert 0 < baseline < summary["predicted_peak_memory_bytes"] and \
        baseline <= summary["peak_memory_per_rank_bytes"], summary
    assert summary["predicted_kept_data_bytes"] > 0, summary


@pytest.mark.parallel([1, 2, 3])
def test_resume_continues_the_run_exactly(capsys):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, _, _ = npy_data(tmp)
    run = base(path, "--data", data, "--batch", "2", "--optimizer", "adam", "--schedule",
               "cosine", "--warmup-steps", "1", "--schedule-steps", "5")
    whole, parts = os.path.join(tmp, "whole"), os.path.join(tmp, "parts")
    assert train_main(run + ["--steps", "4", "--checkpoint", whole]) == 0
    assert train_main(run + ["--steps", "2", "--checkpoint", parts]) == 0
    assert train_main(run + ["--steps", "4", "--checkpoint", parts, "--resume"]) == 0
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert "resumed from step 2" in out, out
    a, b = checkpoint_state(whole), checkpoint_state(parts)
    collective_assert(all(np.array_equal(a[k], b[k]) for k in a), "resumed weights differ")
    # another optimizer, another schedule, no step left: refused before any work
    for extra, words in ((["--optimizer", "sgd"], "saved with --optimizer adam"),
                         (["--schedule", "step"], "saved with other settings"),
                         (["--steps", "4"], "nothing to train")):
        argv = [*run, "--steps", "5", "--checkpoint", parts, "--resume", *extra]
        err = usage_error(capsys, argv)
        if comm.Get_rank() == 0:
            assert words in err, err


@pytest.mark.parallel([1, 2, 3])
def test_a_3d_model_on_synthetic_volumes(capsys):
    """Conv3d, GroupNorm, AvgPool3d, nearest upsampling and a cat skip on (N, 1, D, H, W)
    volumes, with a plan whose layers split N, D, H and W in turn."""
    tmp = shared_tmpdir()
    path = model_file(tmp)
    shape = (1, 6, 8, 4)
    size = "x".join(map(str, shape[1:]))
    plan = mixed_plan_file(tmp, path, 2, capsys, "build_3d", 1, size)
    ck = os.path.join(tmp, "ck")
    assert train_main(["--model-file", f"{path}:build_3d", "--machine", V100,
                       "--no-progress", "--metrics", "", "--in-channels", "1", "--size", size,
                       "--batch", "2", "--samples", "2", "--steps", "2", "--lr", "0.05",
                       "--ranks-layout", plan, "--checkpoint", ck]) == 0
    capsys.readouterr()
    data = NoiseDataset(2, shape, shape, seed=0)
    x, t = (np.stack(a) for a in zip(*(data.sample(i) for i in range(2))))
    model = source_model("build_3d", 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(t)).backward()
        opt.step()
    assert_close(checkpoint_state(ck), {k: v.detach().numpy()
                                        for k, v in model.state_dict().items()})


# ------------------------------------------------------------------ planning
def plan_and_train(capsys, *options):
    """``disttensor-plan --model-file`` (with ``options``) writing its plan's JSON, then one
    step of ``disttensor-train --ranks-layout`` by it, held to plain torch's; the plan's
    printout, the model file, the data and the plan's path."""
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, t = npy_data(tmp)
    plan = os.path.join(tmp, "plan.json")
    assert plan_main(["--model-file", f"{path}:build", "--in-channels", str(C), "--size",
                      f"{H}x{W}", "--batch", "2", "--machine", V100, *options,
                      "--json", plan]) == 0
    out = capsys.readouterr().out
    comm.Barrier()  # rank 0 writes the file
    ck = os.path.join(tmp, "ck")
    assert train_main(base(path, "--data", data, "--batch", "2", "--steps", "1",
                           "--ranks-layout", plan, "--checkpoint", ck)) == 0
    capsys.readouterr()
    # the first batch: the first two samples of epoch 0's order (the Loader's)
    order = np.random.default_rng([0, 0]).permutation(N)[:2]
    assert_close(checkpoint_state(ck), reference(x[order], t[order], 1, "sgd", 0.01))
    return out, path, data, plan


@pytest.mark.parallel([1, 2, 3])
def test_plan_prints_the_table_and_its_json_trains(capsys):
    out, path, data, plan = plan_and_train(capsys)
    if comm.Get_rank() == 0:
        for name in ("enc.0 Conv2d", "enc.1 BatchNorm2d", "down MaxPool2d",
                     "up ConvTranspose2d", "out Conv2d", "predicted time per iteration"):
            assert name in out, out
        assert f"batch (2, {C}, {H}, {W}) -> output (2, 1, {H}, {W})" in out, out
    err = usage_error(capsys, base(path, "--data", data, "--batch", "4", "--steps", "1",
                                   "--ranks-layout", plan))
    if comm.Get_rank() == 0:
        assert "plan" in err and "(2, 2, 12, 10)" in err, err


@pytest.mark.parallel([2, 3])
def test_plan_with_channel_splits_gives_a_plan_that_trains(capsys):
    """``disttensor-plan --model-file --channel-splits``: the planner plans on grids over
    the channels too; its JSON trains as plain torch does."""
    out, *_ = plan_and_train(capsys, "--channel-splits")
    if comm.Get_rank() == 0:
        assert "C/F" in out, out  # the table's column of grids over (N, C, S..)


# ------------------------------------------------------------------ inference
@pytest.mark.parallel([1, 2, 3])
def test_predict_runs_the_checkpoint_as_plain_torch_does(capsys):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, x, _ = npy_data(tmp)
    ck, out = os.path.join(tmp, "ck"), os.path.join(tmp, "pred.npy")
    assert train_main(base(path, "--data", data, "--batch", "2", "--steps", "2",
                           "--checkpoint", ck)) == 0
    assert predict_main(["--model-file", f"{path}:build", "--checkpoint", ck, "--data", data,
                         "--out", out, "--machine", V100, "--no-progress"]) == 0
    text = capsys.readouterr().out
    comm.Barrier()
    if comm.Get_rank() == 0:
        assert f"wrote {N} outputs ({N}, 1, {H}, {W}) to {out}" in text, text
        assert "enc.0 Conv2d" in text, text
    plain = source_model(seed=None)
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint_state(ck).items()})
    plain.eval()  # batch norm by its running statistics
    with torch.no_grad():
        want = plain(torch.from_numpy(x)).numpy().astype(np.float64)
    got = np.load(out).astype(np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want) if got.shape == want.shape \
        else np.inf
    collective_assert(err <= 1e-5, f"outputs {got.shape}, relative error {err:.2e}")
    for argv, words in (([], "a MODEL is needed (or --model-file"),
                        (["mesh-demo", "--model-file", f"{path}:build"], "not both"),
                        (["--model-file", f"{path}:nothere"], "defines no 'nothere'")):
        err_text = usage_error(capsys, [*argv, "--checkpoint", ck, "--data", data, "--out",
                                        out, "--machine", V100], predict_main)
        if comm.Get_rank() == 0:
            assert words in err_text, err_text


# ------------------------------------------------------------------ bad arguments
def usage_error(capsys, argv, main=train_main) -> str:
    """Run a command line that must stop with exit status 2; rank 0's stderr (one
    message), nothing on the other ranks."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    code = exc.value.code
    captured = capsys.readouterr()
    err = captured.err
    lines = [line for line in err.splitlines() if "error:" in line]
    collective_assert(code == 2 and "Traceback" not in err and
                      len(lines) == (1 if comm.Get_rank() == 0 else 0),
                      f"exit {code}, stderr {err!r}")
    return err


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("spec,extra,words", [
    ("/no/such/model.py:build", [], "/no/such/model.py is not a file"),
    ("{path}", [], "takes PATH.py:FUNCTION"),
    ("{path}:nothere", [],
     "defines no 'nothere' (its functions and classes: SkipNet, Volume, build,"),
    ("{path}:not_a_module", [], "not_a_module() returned a str, not a torch.nn.Module"),
    ("{path}:NOT_CALLABLE", [], "is not a function (its type is int)"),
    ("{path}:raises", [], "raises() raised RuntimeError: no weights here"),
    ("{broken}:build", [], "raised ZeroDivisionError: division by zero"),
    ("{path}:build", ["mesh-demo"], "give a MODEL or --model-file, not both"),
    ("{path}:build", ["--size", "12x10"], "needs the input's shape"),
    ("{path}:build", ["--in-channels", "3", "--size", "12x10"], "does not accept an input"),
    ("{path}:build", ["--in-channels", "2", "--size", "12x10", "--shard-state", "optimizer"],
     "--shard-state optimizer is for the built-in models"),
    ("{path}:build", ["--in-channels", "2", "--size", "12x10", "--memory-per-rank", "1KiB"],
     "error:"),
    ("{path}:build", ["--in-channels", "2", "--size", "12x10", "--device", "gpu"],
     "runs on CPU tensors only"),
    ("{path}:build", ["--in-channels", "2", "--size", "12x10", "--recompute", "always"],
     "--recompute always is for the built-in models"),
    ("{path}:build", ["--data", "{labels}"], "holds labels"),
    ("{path}:build", ["--data", "{data}", "--size", "8x8"], "the samples in"),
])
def test_bad_model_files_and_arguments_give_one_message(capsys, spec, extra, words):
    tmp = shared_tmpdir()
    path = model_file(tmp)
    data, _, _ = npy_data(tmp)
    labels, broken = os.path.join(tmp, "labels"), os.path.join(tmp, "broken.py")
    if comm.Get_rank() == 0:
        os.makedirs(labels)
        np.save(os.path.join(labels, "input.npy"), np.zeros((N, C, H, W), np.float32))
        np.save(os.path.join(labels, "target.npy"), np.arange(N))
        with open(broken, "w") as f:
            f.write("x = 1 / 0\n")
    comm.Barrier()
    names = {"path": path, "data": data, "labels": labels, "broken": broken}
    argv = ["--model-file", spec.format(**names), "--machine", V100, "--no-progress",
            "--metrics", "", "--steps", "1", *(e.format(**names) for e in extra)]
    err = usage_error(capsys, argv)
    if comm.Get_rank() == 0:
        assert words in err, err


@pytest.mark.parallel([1, 2])
def test_plan_refuses_what_it_cannot_plan(capsys):
    path = model_file(shared_tmpdir())
    plan = ["--model-file", f"{path}:build", "--machine", V100]
    err = usage_error(capsys, plan + ["--size", "12x10"], plan_main)
    if comm.Get_rank() == 0:
        assert "needs the input's shape" in err, err
    err = usage_error(capsys, plan + ["--in-channels", "2", "--size", "12x10", "--scaling",
                                      "1,2"], plan_main)
    if comm.Get_rank() == 0:
        assert "--scaling is for the registered models" in err, err
    err = usage_error(capsys, ["mesh-demo", "--in-channels", "2"], train_main)
    if comm.Get_rank() == 0:
        assert "--in-channels is for --model-file" in err, err


def test_without_torch_model_file_names_the_extra(tmp_path):
    """With PyTorch missing the package still imports, and --model-file says what to
    install (one usage message, exit 2)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    model = tmp_path / "m.py"
    model.write_text("def build():\n    return None\n")
    code = ("import sys; from disttensor_nn.training.cli import train_main; "
            f"sys.exit(train_main(['--model-file', '{model}:build', '--in-channels', '1', "
            "'--size', '8x8']))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r
    assert 'pip install "disttensor[torch]"' in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("error:") == 1, r.stderr
