"""disttensor_nn.optim.shard_state: optimizer state (and gradients) sharded over the
ranks that replicate each parameter.

Every stage is compared with unsharded training at 1-4 ranks: raw parameters
whose local gradient parts go through ``reduce_gradients_`` (sizes not
divisible by the rank count, and parameters with fewer elements than ranks, so
some pieces are empty) against an unsharded optimizer stepping the sum of the
parts computed here in NumPy; and a small convolutional model split over space
against the same model trained unsharded. State dictionaries are whole, and
load at another rank count and stage; bad stage names raise the same error on
every rank and change nothing. Stage "full" (sharded weights, gathered by each
layer for its passes) trains 20 steps as unsharded at 1-4 ranks. The memory
model's figures are checked against sizes computed here, and the training
driver and its command line (--shard-state) against unsharded training.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import mpi_helpers
import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import collective_assert, collective_outcome
from disttensor_nn.optim import (
    BUILT_STAGES,
    SGD,
    STAGES,
    Adam,
    AdamW,
    clip_grad_norm_,
    shard_state,
)
from disttensor_nn.plan import CostModel, MachineProfile, load_profile
from disttensor_nn.reduction import reduce_gradients_
from disttensor_nn.shards import shard_counts, shard_range
from disttensor_nn.training import TrainConfig, build_model, load_checkpoint, train
from disttensor_nn.training.driver import SetupError

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3, 4]
SHAPES = [(5, 3), (7,), (1,), (2, 1)]  # 15 and 7 elements: uneven; 1 and 2: empty pieces
STEPS = 6
TOL = 1e-12


def make(kind: str, params):
    if kind == "sgd":
        return SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    if kind == "adam":
        return Adam(params, lr=0.05, amsgrad=True)
    return AdamW(params, lr=0.05)


def fresh_params():
    rng = np.random.default_rng(7)
    return [nn.Parameter(rng.standard_normal(s)) for s in SHAPES]


def part(step: int, rank: int, k: int) -> np.ndarray:
    """Rank ``rank``'s local gradient part of parameter ``k`` at step ``step``."""
    return np.random.default_rng(10_000 * step + 100 * rank + k).standard_normal(SHAPES[k])


def state_bytes(opt) -> int:
    return sum(a.nbytes for s in opt.state if s is not None
               for a in (s.values() if isinstance(s, dict) else [s]) if hasattr(a, "nbytes"))


def run_sharded(opt, params, steps, clip=None):
    for s in steps:
        opt.zero_grad()
        reduce_gradients_([(p, part(s, comm.rank, k)) for k, p in enumerate(params)], comm)
        if clip is not None:
            clip_grad_norm_(params, clip)
        opt.step()


def run_reference(opt, params, steps, nranks, clip=None):
    """The unsharded optimizer on the sums of every rank's parts (NumPy, no MPI)."""
    for s in steps:
        opt.zero_grad()
        for k, p in enumerate(params):
            p.grad[...] = sum(part(s, r, k) for r in range(nranks))
        if clip is not None:
            total = np.sqrt(sum(float(np.sum(p.grad ** 2)) for p in params))
            if clip / (total + 1e-6) < 1:
                for p in params:
                    p.grad *= clip / (total + 1e-6)
        opt.step()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("stage", ["optimizer", "gradients"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_each_stage_matches_unsharded_training(stage, kind):
    params, ref = fresh_params(), fresh_params()
    opt = shard_state(make(kind, params), stage)
    ref_opt = make(kind, ref)
    run_sharded(opt, params, range(STEPS), clip=2.0)
    run_reference(ref_opt, ref, range(STEPS), comm.size, clip=2.0)
    errs = [float(np.max(np.abs(p.data - q.data))) for p, q in zip(params, ref)]
    collective_assert(max(errs) < TOL, f"{stage} {kind}: weights differ by {errs}")
    # each rank keeps its piece of every state array: about 1/R of the unsharded bytes
    slots = 1 if kind == "sgd" else 3
    want = sum(shard_counts(int(np.prod(s)), comm.size)[0][comm.rank] for s in SHAPES)
    collective_assert(state_bytes(opt) == slots * 8 * want,
                      f"{state_bytes(opt)} state bytes, want {slots * 8 * want}")
    if stage == "gradients":
        got = [p.grad.size for p in params]
        want_g = [np.subtract(*shard_range(int(np.prod(s)), comm.size, comm.rank)[::-1])
                  for s in SHAPES]
        collective_assert(comm.size == 1 or got == want_g, f"gradient pieces {got} {want_g}")
    # the state dictionary is whole: the unsharded optimizer's keys, shapes and values
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    ok = all((a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=0, atol=TOL)
                                           for k in a))
             if isinstance(a, dict) else np.allclose(a, b, rtol=0, atol=TOL)
             for a, b in zip(sd["state"], ref_sd["state"]))
    collective_assert(ok, "state_dict differs from the unsharded one")


@pytest.mark.parallel(SIZES)
def test_state_dict_moves_between_stages_and_rank_counts():
    """Save sharded at P ranks, load unsharded, and load sharded over fewer ranks."""
    params, ref = fresh_params(), fresh_params()
    opt = shard_state(Adam(params, lr=0.05), "optimizer", comm=comm)
    ref_opt = Adam(ref, lr=0.05)
    for s in range(3):  # gradients set whole (no backward): the sharding comm given
        for k, (p, q) in enumerate(zip(params, ref)):
            p.grad[...] = q.grad[...] = part(s, 0, k)
        opt.step()
        ref_opt.step()
    saved = opt.state_dict()
    collective_assert(state_bytes(opt) < state_bytes(ref_opt) or comm.size == 1, "not sharded")
    # sharded -> unsharded, on each rank alone
    plain = fresh_params()
    for p, q in zip(plain, params):
        p.data[...] = q.data
    plain_opt = Adam(plain, lr=0.05)
    plain_opt.load_state_dict(saved)
    # sharded at P -> sharded at max(P - 1, 1) ranks (the other rank steps unsharded)
    sub = comm.Split(0 if comm.rank < max(comm.size - 1, 1) else 1, comm.rank)
    moved = fresh_params()
    for p, q in zip(moved, params):
        p.data[...] = q.data
    moved_opt = shard_state(Adam(moved, lr=0.05), "optimizer", comm=sub)
    moved_opt.load_state_dict(saved)
    for s in range(3, 5):
        for k, p in enumerate(ref):
            g = part(s, 0, k)
            p.grad[...] = g
            plain[k].grad[...] = g
            moved[k].grad[...] = g
        ref_opt.step()
        plain_opt.step()
        moved_opt.step()
    errs = [float(np.max(np.abs(a.data - r.data))) for ps in (plain, moved)
            for a, r in zip(ps, ref)]
    collective_assert(max(errs) < TOL, f"after loading: weights differ by {errs}")
    # and back: the unsharded state loads into a sharded optimizer over the world
    back = shard_state(Adam(fresh_params(), lr=0.05), "optimizer", comm=comm)
    back.load_state_dict(plain_opt.state_dict())
    a, b = back.state_dict()["state"], ref_opt.state_dict()["state"]
    collective_assert(all(np.array_equal(x["exp_avg_sq"], y["exp_avg_sq"])
                          for x, y in zip(a, b)), "unsharded -> sharded")
    sub.Free()


def conv_model(seed: int = 0) -> nn.Sequential:
    # weights of 54, 3, 3 and 1 elements: pieces uneven and, at 2-4 ranks, empty
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, seed=seed, dtype=np.float64),
                         nn.ReLU(), nn.Conv2d(3, 1, 1, seed=seed + 1, dtype=np.float64))


@functools.cache
def grid1() -> dt.ProcessGrid:
    return dt.ProcessGrid((comm.size,))


def train_model(stage: str | None, kind: str, steps: int = 4):
    model = conv_model()
    opt = make(kind, model.parameters())
    if stage is not None:
        shard_state(opt, stage)
    loss = nn.MSELoss()
    shape = (2, 2, 8, 6)
    dist = dt.Distribution(shape, grid1(), (None, None, 0, None))
    norms = []
    for s in range(steps):
        rng = np.random.default_rng(s)
        x = dt.DistArray.from_global(rng.standard_normal(shape), dist)
        t = rng.standard_normal((2, 1, 8, 6))
        opt.zero_grad()
        loss(model(x), t)
        model.backward(loss.backward())
        norms.append(clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    return [p.data.copy() for p in model.parameters()], norms


@pytest.mark.parallel([1, 3, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_model_split_over_space_trains_alike_at_each_stage(kind):
    ref, ref_norms = train_model(None, kind)
    for stage in ("optimizer", "gradients"):
        got, norms = train_model(stage, kind)
        errs = [float(np.max(np.abs(a - b))) for a, b in zip(got, ref)]
        collective_assert(max(errs) < 1e-10 and np.allclose(norms, ref_norms, rtol=1e-10),
                          f"{stage}: weights differ by {errs}, norms {norms} {ref_norms}")


@pytest.mark.parallel(SIZES)
def test_bad_stages_raise_the_same_error_on_every_rank_and_change_nothing():
    params = fresh_params()
    opt = SGD(params, lr=0.1, momentum=0.9)
    for stage, words in (("zero2", "unknown stage 'zero2'"), (2, "unknown stage 2"),
                         ("zero-3", "unknown stage 'zero-3'")):
        _, err = collective_outcome(shard_state, opt, stage)
        collective_assert(isinstance(err, ValueError) and words in str(err), str(err))
    _, err = collective_outcome(shard_state, object(), "optimizer")
    collective_assert(isinstance(err, TypeError), str(err))
    collective_assert(opt.shard_stage == "none" and not any(p.reduce_scatter for p in params),
                      "changed")


def test_the_memory_model_counts_the_sharded_state_per_rank():
    """params_memory: the optimizer state, then the gradients, at 1/P (metadata only)."""
    prof = MachineProfile(name="test", p2p_alpha=1e-5, p2p_beta=1e-9, allreduce_alpha=2e-5,
                          allreduce_beta=2e-9, alltoall_alpha=3e-5, alltoall_beta=3e-9,
                          peak_flops=1e10, efficiency=0.5, mem_bandwidth=1e10,
                          memory_per_rank=2**30, reduce_scratch=0.0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    sizes = [int(np.prod(p.shape)) * 4 for p in model.parameters()]
    total, big = sum(sizes), max(sizes)
    for nprocs, slots in ((1, 1), (4, 1), (4, 2), (3, 3)):
        def mem(stage, nprocs=nprocs, slots=slots):
            return CostModel(prof, nprocs, shard_state=stage,
                             state_slots=slots).params_memory(model, sizes)
        small = sum(n for n in sizes if n < 2**20)
        # weights, gradients, state, and the local gradients waiting for their reduction
        assert mem("none") == pytest.approx((2 + slots) * total + total + small)
        assert mem("optimizer") == pytest.approx(2 * total + slots * total / nprocs
                                                 + total + small)
        # reduce-scattered one layer at a time: one layer's local gradients in flight
        assert mem("gradients") == pytest.approx(total + (1 + slots) * total / nprocs + big)
        # the weights too, but a layer's are gathered whole for its pass, and the next
        # one's meanwhile: the two largest
        second = sorted(sizes)[-2]
        assert mem("full") == pytest.approx((2 + slots) * total / nprocs + 2 * big + second)
    with pytest.raises(ValueError, match="unknown shard_state 'zero'"):
        CostModel(prof, 2, shard_state="zero")


# --------------------------------------------------------------------------- the training driver
V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing
SIZE = (16, 16)  # small samples: the parameters (what the stages shard) are the model's own
# NumPy's kernels alone: no other backend to warm up before the first step
CLI = ["mesh-demo", "--machine", V100, "--no-progress", "--size", "16x16", "--batch", "4",
       "--samples", "8", "--kernels", "numpy"]
SHARDED = [s for s in BUILT_STAGES if s != "none"]


def shared_dir(c: MPI.Comm = comm) -> str:
    return mpi_helpers.shared_tmpdir("dt-shard-", c)


def checkpoint_weights(path: str) -> list[np.ndarray]:
    """The parameters a checkpoint holds, read on this rank alone."""
    model, _ = build_model("mesh-demo", SIZE, 4)
    load_checkpoint(path, model, comm=MPI.COMM_SELF)
    return [np.array(p.full()) for p in model.parameters()]


def cli_run(capsys, tmp: str, name: str, *argv: str) -> tuple[dict, list[np.ndarray], str]:
    """``disttensor-train`` with ``argv``: its summary, final weights and rank 0's output."""
    from disttensor_nn.training.cli import train_main

    prefix, ck = os.path.join(tmp, name), os.path.join(tmp, name + "-ck")
    assert train_main(CLI + ["--metrics", prefix, "--checkpoint", ck, *argv]) == 0
    out = capsys.readouterr().out
    comm.Barrier()  # rank 0 writes the metrics after training
    with open(prefix + ".json") as f:
        summary = json.load(f)["summary"]
    return summary, checkpoint_weights(ck), out


def assert_same_training(a: tuple, b: tuple, what: str, rtol: float = 1e-5) -> None:
    (sa, wa, _), (sb, wb, _) = a, b
    la, lb = np.array(sa["history"]), np.array(sb["history"])
    errs = [float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)) for x, y in zip(wa, wb)]
    collective_assert(len(la) == len(lb) and np.allclose(la, lb, rtol=rtol, atol=0),
                      f"{what}: losses {la} vs {lb}")
    collective_assert(max(errs) <= rtol, f"{what}: weights differ by {max(errs)} (relative)")


@pytest.mark.parallel([3])  # uneven pieces, and empty ones for the smallest parameters
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_command_line_trains_alike_at_each_stage(capsys, optimizer):
    """--shard-state: the same losses and weights as unsharded training (a checkpoint of
    each holds its final weights, whole), over two steps (the second uses the optimizer's
    state from the first)."""
    tmp = shared_dir()
    common = ["--steps", "2", "--optimizer", optimizer] + (
        ["--lr", "0.01"] if optimizer == "adam" else [])
    ref = cli_run(capsys, tmp, "none", *common)
    collective_assert(ref[0]["shard_state"] == "none", "summary")
    for stage in SHARDED:
        got = cli_run(capsys, tmp, stage, *common, "--shard-state", stage)
        assert_same_training(got, ref, stage)
        summary, _, out = got
        collective_assert(summary["shard_state"] == stage, f"summary {summary['shard_state']}")
        collective_assert(comm.rank > 0 or f"parameter state sharded: {stage}" in out, out)
        collective_assert("does nothing here" not in out, out)  # replicated over the ranks


@pytest.mark.parallel([1])
def test_shard_state_without_replicated_parameters_trains_on_with_one_note(capsys):
    tmp = shared_dir()
    ref = cli_run(capsys, tmp, "none", "--steps", "2")
    got = cli_run(capsys, tmp, "optimizer", "--steps", "2", "--shard-state", "optimizer")
    out = got[2]
    assert out.count("note: --shard-state optimizer does nothing here") == 1, out
    assert_same_training(got, ref, "1 rank", rtol=0)
    # auto: on one rank every stage prices alike, so the plan keeps "none" and says why
    auto = cli_run(capsys, tmp, "auto", "--steps", "2", "--shard-state", "auto")
    assert auto[0]["shard_state"] == "none" and "does nothing here" not in auto[2], auto[2]
    assert "parameter state not sharded (chosen by --shard-state auto" in auto[2], auto[2]
    assert_same_training(auto, ref, "auto", rtol=0)


@pytest.mark.parametrize("argv,words", [
    (["--shard-state", "zero3"], "invalid choice: 'zero3'"),
    (["--shard-state", ""], "invalid choice: ''"),
    (["--shard-state", "Full"], "invalid choice: 'Full'"),
    (["--shard-state", "Auto"], "invalid choice: 'Auto'"),
])
def test_the_command_line_refuses_bad_stages_with_one_usage_message(capsys, argv, words):
    from disttensor_nn.training.cli import train_main

    with pytest.raises(SystemExit) as exc:
        train_main(CLI + ["--metrics", ""] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("error:") == 1 and "Traceback" not in err, err


@pytest.mark.parallel([1, 2, 3])
def test_train_refuses_an_unknown_stage_on_every_rank_before_any_work():
    cfg = TrainConfig(model="mesh-demo", size=SIZE, batch=4, steps=1, samples=8,
                      metrics=None, machine=V100, progress=False, shard_state="zero")
    _, err = collective_outcome(train, cfg)
    collective_assert(isinstance(err, SetupError) and "unknown stage 'zero'" in str(err),
                      repr(err))


@pytest.mark.parallel([3])
def test_a_checkpoint_saved_sharded_at_two_ranks_resumes_unsharded_at_one_and_three():
    """Whole state in the checkpoint: saved by 2 ranks under --shard-state gradients, it
    continues unsharded on 3 ranks and on 1 as the checkpoint of the same 2-rank training
    unsharded does (Adam's moments and step count included)."""
    tmp = shared_dir()

    def cfg(**kw):
        base = dict(model="mesh-demo", size=SIZE, batch=4, samples=8, metrics=None,
                    machine=V100, progress=False, optimizer="adam", lr=0.01, kernels="numpy")
        return TrainConfig(**{**base, **kw})
    pair = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    saved = {}
    for stage in ("gradients", "none"):
        saved[stage] = ck = os.path.join(tmp, stage)
        if pair != MPI.COMM_NULL:
            assert train(cfg(steps=2, checkpoint=ck, shard_state=stage), comm=pair)["steps"] == 2
        comm.Barrier()
        if comm.rank == 0:  # a copy for the 1-rank run
            shutil.copytree(ck, ck + "-solo")
    if pair != MPI.COMM_NULL:
        pair.Free()
    comm.Barrier()
    runs = {}
    for stage, ck in saved.items():
        three = train(cfg(steps=4, checkpoint=ck, resume=True))
        one = train(cfg(steps=4, checkpoint=ck + "-solo", resume=True), comm=MPI.COMM_SELF) \
            if comm.rank == 0 else None
        runs[stage] = {"3 ranks": (three, ck), "1 rank": (comm.bcast(one, root=0),
                                                          ck + "-solo")}
    for name in ("3 ranks", "1 rank"):
        (got, path), (ref, ref_path) = runs["gradients"][name], runs["none"][name]
        a, b = np.array(got["history"]), np.array(ref["history"])
        collective_assert(len(a) == 4 and np.allclose(a, b, rtol=1e-5, atol=0),
                          f"{name}: losses {a} vs {b}")
        w, wr = checkpoint_weights(path), checkpoint_weights(ref_path)
        errs = [float(np.max(np.abs(x - y))) for x, y in zip(w, wr)]
        collective_assert(max(errs) < 1e-5, f"{name}: weights differ by {max(errs)}")


def test_the_plan_counts_the_sharded_state_in_its_peak():
    """make_plan's predicted peak shrinks by what each stage leaves on the other ranks:
    figures from the parameters' sizes, the optimizer's slots and R alone."""
    from disttensor_nn.plan import make_plan

    model, shape = build_model("mesh-demo", (64, 64), 4)
    sizes = [int(np.prod(p.shape)) * 4 for p in model.parameters()]
    total, big = sum(sizes), max(sizes)
    # each convolution hands its weight's and bias's local gradients to the reduction
    # together (batch norm sums its own): all in buckets of less than 1 MiB
    reduced = [sum(int(np.prod(p.shape)) * 4 for p in layer.own_parameters())
               for layer in model if isinstance(layer, nn.Conv2d)]
    assert max(reduced) < 2**20
    scratch = load_profile(V100).reduce_scratch
    for nprocs, slots in ((2, 1), (4, 2), (3, 0)):
        plans = {stage: make_plan(model, shape, nprocs, V100, baseline=1e8, shard_state=stage,
                                  state_slots=slots)[0] for stage in STAGES}
        grids = {stage: [e.grid for e in p.entries] for stage, p in plans.items()}
        assert all(g == grids["none"] for g in grids.values()), grids
        assert all(e.grid[0] == nprocs for e in plans["none"].entries)  # samples split
        peak = {stage: p.peak_memory for stage, p in plans.items()}
        # stage 1: the optimizer state, (1 - 1/R) of slots x the parameters
        assert peak["none"] - peak["optimizer"] == pytest.approx(
            slots * total * (1 - 1 / nprocs))
        # stage 2: also the reduced gradients; the local gradients waiting for their
        # (fused) reductions, with the MPI library's scratch, become one layer's
        waiting = 2 * sum(reduced) + scratch * sum(reduced)
        assert peak["none"] - peak["gradients"] == pytest.approx(
            (1 + slots) * total * (1 - 1 / nprocs) + waiting - max(reduced) * (1 + scratch))
        # stage 3: also the weights, but a layer's are gathered whole for its passes,
        # and the next layer's meanwhile: the two largest
        assert peak["gradients"] - peak["full"] == pytest.approx(
            total * (1 - 1 / nprocs) - big - sorted(sizes)[-2])


@pytest.mark.parallel([2])
def test_the_driver_plans_with_the_stage_and_the_optimizers_slots():
    """The plan the training driver makes counts the stage: Adam's two moments at 1/R."""
    def run(stage):
        s = train(TrainConfig(model="mesh-demo", size=SIZE, batch=4, steps=1, samples=8,
                              metrics=None, machine=V100, progress=False, optimizer="adam",
                              lr=0.01, shard_state=stage, kernels="numpy"))
        return s["predicted_peak_memory_bytes"] - s["predicted_baseline_memory_bytes"]
    model, _ = build_model("mesh-demo", SIZE, 4)
    total = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    saved = run("none") - run("optimizer")
    collective_assert(saved == pytest.approx(2 * total * (1 - 1 / comm.size)),
                      f"{saved} vs {2 * total * (1 - 1 / comm.size)}")


# --------------------------------------------------------------------------- stage "full"
def bn_model(dtype) -> nn.Sequential:
    # weights of 54, 3, 3 and 3 elements: uneven pieces, empty at 4 ranks; batch norm sums
    # its own gradients (after the ReLU: a bias right before it would have no gradient
    # but rounding noise, which Adam amplifies)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, seed=3, dtype=dtype), nn.ReLU(),
                         nn.BatchNorm2d(3, dtype=dtype), nn.Conv2d(3, 3, 1, seed=4, dtype=dtype))


def train_full(stage: str | None, kind: str, dtype, steps: int = 20):
    """``steps`` steps of a model split over space (clipped), sharded at ``stage``."""
    model = bn_model(dtype)
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) \
        if kind == "sgd" else Adam(model.parameters(), lr=0.01)
    if stage is not None:
        shard_state(opt, stage)
    loss = nn.MSELoss()
    shape = (2, 2, 8, 6)
    dist = dt.Distribution(shape, grid1(), (None, None, 0, None))
    seen = []  # whether the first convolution's whole weights are dropped after forward
    model[0].register_forward_hook(lambda layer, x, y: seen.append(
        layer.weight._data is None))
    # the next layer's gather started before a layer runs (forward: the last convolution's
    # while batch norm runs; backward: the first's while the ReLU runs)
    model[2].register_forward_hook(lambda layer, x, y: ahead.append(
        model[3].weight._pending is not None))
    model[1].register_full_backward_hook(lambda layer, dx, dy: ahead.append(
        model[0].weight._pending is not None))
    ahead: list[bool] = []
    settled: list[list[bool]] = []
    for s in range(steps):
        rng = np.random.default_rng(s)
        x = dt.DistArray.from_global(rng.standard_normal(shape).astype(dtype), dist)
        t = rng.standard_normal((2, 3, 8, 6)).astype(dtype)
        opt.zero_grad()
        loss(model(x), t)
        model.backward(loss.backward())
        # after each layer's first backward pass, before any update: its pieces alone
        settled.append([p.sharded_weights for layer in (model[0], model[3])
                        for p in layer.own_parameters()])
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, opt, (seen, ahead, settled)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sharded_weights_train_as_unsharded_for_20_steps(kind, dtype, tol):
    """Stage "full": each rank keeps 1/R of every replicated weight between passes, the
    layers gather them for forward and backward and drop them after; 20 steps give the
    unsharded weights (within the dtype's rounding), and whole state dictionaries."""
    ref, ref_opt, _ = train_full(None, kind, dtype)
    model, opt, (seen, ahead, settled) = train_full("full", kind, dtype)
    want = {k: np.asarray(v) for k, v in ref.state_dict().items()}
    got = {k: np.asarray(v) for k, v in model.state_dict().items()}  # gathered: collective
    errs = {k: float(np.max(np.abs(got[k] - want[k])) / max(np.max(np.abs(want[k])), 1))
            for k in want}
    collective_assert(got.keys() == want.keys() and max(errs.values()) <= tol,
                      f"{kind} {dtype.__name__}: weights differ by {errs}")
    # sharded from the first step on (its backward pass told the ranks that share them)
    collective_assert(comm.size == 1 and not any(seen) or comm.size > 1 and all(seen[1:]),
                      f"the whole weights stayed after forward: {seen}")
    collective_assert(comm.size == 1 and not any(ahead) or comm.size > 1 and all(ahead[2:]),
                      f"no gather started ahead: {ahead}")
    # the first step too holds the whole weights only until each layer's backward pass
    collective_assert(all(all(s) == (comm.size > 1) for s in settled),
                      f"whole weights after backward: {settled}")
    convs = [p for layer in (model[0], model[3]) for p in layer.own_parameters()]
    if comm.size > 1:
        # the convolutions' weights: this rank's piece alone, whole only inside a pass
        pieces = [p.piece.size for p in convs]
        wanted = [shard_counts(int(np.prod(p.shape)), comm.size)[0][comm.rank] for p in convs]
        collective_assert(all(p.sharded_weights and p._data is None for p in convs)
                          and pieces == wanted, f"pieces {pieces}, want {wanted}")
        _, err = collective_outcome(lambda: convs[0].data)
        collective_assert(isinstance(err, RuntimeError) and "full()" in str(err), repr(err))
    # batch norm sums its own gradients: no communicator to shard it over, whole
    collective_assert(not any(p.sharded_weights for p in model[2].own_parameters()), "bn")
    # the memory model prices a model whose weights are sharded (from their dtypes)
    priced = [CostModel(load_profile(V100), comm.size, shard_state="full").params_memory(m)
              for m in (model, ref)]
    collective_assert(priced[0] == priced[1], f"{priced}")
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    ok = all((np.allclose(a, b, rtol=0, atol=tol * 10) if not isinstance(a, dict) else
              all(np.allclose(a[k], b[k], rtol=10 * tol, atol=10 * tol) for k in a))
             for a, b in zip(sd["state"], ref_sd["state"]))
    collective_assert(ok, "the optimizer's state_dict differs from the unsharded one")


@pytest.mark.parallel([1, 2, 3])
def test_sharded_weights_load_whole_state_and_go_back_to_whole():
    """load_state_dict into sharded weights keeps each rank's piece of it; a later stage
    "none" gathers the weights whole again."""
    model, opt, _ = train_full("full", "adam", np.float64, steps=2)
    ref = bn_model(np.float64)
    saved = ref.state_dict()
    model.load_state_dict(saved)
    got = {k: np.asarray(v) for k, v in model.state_dict().items()}
    collective_assert(all(np.array_equal(got[k], np.asarray(saved[k])) for k in saved),
                      "loaded weights")
    shard_state(opt, "none")
    opt.zero_grad()
    opt.step()  # zero gradients: Adam still moves by its moments, as unsharded
    collective_assert(not any(p.sharded_weights for p in model.parameters()), "still sharded")


@functools.cache
def grid2() -> dt.ProcessGrid:
    return dt.ProcessGrid({1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[comm.size])


def filter_net() -> nn.Sequential:
    """Filters split over grid axis 1 (their blocks replicated over axis 0), batch norm,
    a replicated 1x1 convolution and a Linear layer."""
    f64 = np.float64
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, dtype=f64, filter_axes=(1,)),
                        nn.BatchNorm2d(4, dtype=f64), nn.ReLU(), nn.Conv2d(4, 4, 1, dtype=f64),
                        nn.GlobalAvgPool(), nn.Linear(4, 3, dtype=f64))
    rng = np.random.default_rng(30)
    for p in net.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return net


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sharded_weights_of_split_filters_train_as_unsharded(kind):
    """Stage "full" on a filter-split convolution: each block of its weights is sharded
    over the ranks that hold that block (grid axis 0), the replicated weights over all."""
    shape = (4, 2, 8, 8)
    dist = dt.Distribution(shape, grid2(), (0, None, None, None))
    rng = np.random.default_rng(31)
    x = rng.standard_normal(shape)
    labels = np.argmax(x[:, 0, :, :3].mean(axis=(1, 2))[:, None] * [1, -1, 0.5], axis=1)

    def run(stage):
        net = filter_net()
        opt = SGD(net.parameters(), lr=0.1, momentum=0.9) if kind == "sgd" else \
            Adam(net.parameters(), lr=0.01)
        if stage is not None:
            shard_state(opt, stage)
        loss_fn = nn.SoftmaxCrossEntropy()
        losses = []
        for _ in range(20):
            losses.append(loss_fn(net(dt.DistArray.from_global(x, dist)), labels))
            opt.zero_grad()
            net.backward(loss_fn.backward())
            opt.step()
        return net, np.array(losses)
    ref, ref_losses = run(None)
    net, losses = run("full")
    want = {k: np.asarray(v) for k, v in ref.state_dict().items()}
    got = {k: np.asarray(v) for k, v in net.state_dict().items()}
    errs = {k: float(np.max(np.abs(got[k] - want[k]))) for k in want}
    collective_assert(np.allclose(losses, ref_losses, rtol=1e-10, atol=0)
                      and max(errs.values()) < 1e-10, f"{kind}: {errs}")
    w = net[0].weight
    replicas = grid2().shape[0]
    collective_assert(w.dist is not None or grid2().shape[1] == 1, "the filters are not split")
    collective_assert(w.sharded_weights == (replicas > 1), f"{w.sharded_weights}")
    if replicas > 1:
        want_piece = shard_counts(w.local_size, replicas)[0][grid2().coords_of(comm.rank)[0]]
        collective_assert(w.piece.size == want_piece, f"piece {w.piece.size} {want_piece}")
    # the Linear layer's gradient is summed over the ranks splitting the samples (axis 0)
    collective_assert(net[5].weight.sharded_weights == (replicas > 1), "Linear")


# --------------------------------------------------------------------------- the stages' time
ALPHA, BETA = 2e-5, 2e-9  # the allreduce's constants of prof()


def prof(**kw) -> MachineProfile:
    return MachineProfile(name="test", p2p_alpha=1e-5, p2p_beta=1e-9, allreduce_alpha=ALPHA,
                          allreduce_beta=BETA, alltoall_alpha=3e-5, alltoall_beta=3e-9,
                          peak_flops=1e10, efficiency=0.5, mem_bandwidth=1e10,
                          memory_per_rank=2**30, cores_per_node=8, **kw)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_the_cost_model_charges_each_stage_the_collectives_it_runs(nprocs):
    """A layer's communication under each stage, with the samples split over every rank:
    the allreduce of its gradient (G bytes), a reduce-scatter and all-gathers of its
    weights (W bytes), priced here from the profile's constants (recursive doubling's
    latency, a ring's bytes: an allreduce is a reduce-scatter then an all-gather)."""
    steps, share = np.log2(nprocs), (nprocs - 1) / nprocs

    def half(n):  # a reduce-scatter or an all-gather of n bytes in all
        return steps * ALPHA + share * n * BETA

    conv = nn.Conv2d(4, 8, 3, padding=1)
    lin = nn.Linear(16, 5)
    w_conv = (8 * 4 * 9 + 8) * 4  # float32 weights, gradients summed in float32
    w_lin = (16 * 5 + 5) * 4  # float32 weights, gradients summed in float32
    for layer, shape, g, w in ((conv, (8, 4, 6, 6), w_conv, w_conv),
                               (lin, (8, 16), w_lin, w_lin)):
        cand = (nprocs, 1, 1)  # the samples split, the weights replicated on every rank
        want = {"none": 2 * half(g), "optimizer": 2 * half(g) + half(w),
                "gradients": half(g) + half(w), "full": half(g) + 2 * half(w)}
        for stage, t in want.items():
            cost = CostModel(prof(), nprocs, overlap=False, shard_state=stage).layer(
                layer, shape, cand)
            assert cost.comm == pytest.approx(t, rel=1e-12), (type(layer).__name__, stage)
            assert cost.grad == 0 and cost.hidden == 0
        # overlapped: the gradient allreduce runs behind backward (in a bucket: its share of
        # the latency); each pass's all-gather under "full" hides behind the kernels, up
        # to the pass's time
        none = CostModel(prof(), nprocs, shard_state="none").layer(layer, shape, cand)
        assert none.grad == pytest.approx(2 * steps * ALPHA * g / 2**20 + 2 * share * g * BETA)
        full = CostModel(prof(), nprocs, shard_state="full").layer(layer, shape, cand)
        assert full.grad == 0 and full.comm == pytest.approx(want["full"])
        assert full.hidden == pytest.approx(min(half(w), none.fwd) + min(half(w), none.bwd))
    # one rank: nothing to reduce or gather, whatever the stage
    for stage in STAGES:
        assert CostModel(prof(), 1, shard_state=stage).layer(conv, (8, 4, 6, 6),
                                                              (1, 1, 1)).comm == 0


def stage_plans(nprocs, memory=None, slots=2):
    """mesh-demo planned at each stage separately: {stage: plan, or None if none fits}."""
    from disttensor_nn.plan import make_plan

    model, shape = build_model("mesh-demo", (64, 64), 4)
    out = {}
    for stage in STAGES:
        try:
            out[stage] = make_plan(model, shape, nprocs, V100, memory=memory, baseline=1e8,
                                   shard_state=stage, state_slots=slots)[0]
        except ValueError:
            out[stage] = None
    return model, shape, out


def expected_choice(plans: dict) -> str:
    """The rule, from the stages' own plans: the fastest; on a tie, the least
    communication; then the first stage."""
    fits = {s: p for s, p in plans.items() if p is not None}
    fastest = min(p.time for p in fits.values())
    tied = [s for s, p in fits.items() if p.time <= fastest * (1 + 1e-9)]
    return min(tied, key=lambda s: (fits[s].exposed_comm + fits[s].hidden_comm,
                                    STAGES.index(s)))


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_auto_picks_the_fastest_stage_when_every_one_fits(nprocs):
    from disttensor_nn.plan import Plan, make_plan

    model, shape, plans = stage_plans(nprocs)
    assert all(p is not None for p in plans.values())
    if nprocs > 1:  # the stages price differently: the sharded ones move more
        assert len({p.time for p in plans.values()}) > 1
    auto = make_plan(model, shape, nprocs, V100, baseline=1e8, shard_state="auto",
                     state_slots=2)[0]
    want = expected_choice(plans)
    assert auto.shard_state == want and (nprocs > 1 or want == "none")
    ref = plans[want]
    assert auto.time == pytest.approx(ref.time, rel=1e-12)
    assert auto.peak_memory == pytest.approx(ref.peak_memory, rel=1e-12)
    assert [e.grid for e in auto.entries] == [e.grid for e in ref.entries]
    assert "shard_state auto" in auto.table()
    back = Plan.from_json(auto.to_json())
    assert back.shard_state == auto.shard_state and back.table() == auto.table()


@pytest.mark.parametrize("nprocs", [2, 4])  # at 3, another grid fits it unsharded
def test_auto_shards_when_the_unsharded_plan_does_not_fit(nprocs):
    """A budget between the unsharded peak and stage "optimizer"'s: a sharded stage, the
    fastest of those whose own plans fit it, recorded in the plan and its JSON."""
    from disttensor_nn.plan import Plan, make_plan

    _, _, free = stage_plans(nprocs)
    budget = (free["none"].peak_memory + free["optimizer"].peak_memory) / 2
    model, shape, plans = stage_plans(nprocs, memory=budget)
    assert plans["none"] is None  # the precondition: unsharded, nothing fits
    auto = make_plan(model, shape, nprocs, V100, memory=budget, baseline=1e8,
                     shard_state="auto", state_slots=2)[0]
    want = expected_choice(plans)
    assert auto.shard_state == want != "none" and auto.peak_memory <= budget
    assert auto.time == pytest.approx(plans[want].time, rel=1e-12)
    assert f"sharded over the ranks that replicate it: {want}" in auto.table()
    assert Plan.from_json(auto.to_json()).shard_state == want
    # a budget no stage fits: the planner's error, for every stage
    least = min(p.peak_memory for p in plans.values() if p is not None)
    with pytest.raises(ValueError, match=r"fits 1 MiB per rank .*under every shard_state"):
        make_plan(model, shape, nprocs, V100, memory=2**20, baseline=1e8, shard_state="auto")
    assert least > 2**20
    with pytest.raises(ValueError, match="unknown shard_state 'zero'"):
        make_plan(model, shape, nprocs, V100, shard_state="zero")


@pytest.mark.parallel([2])
def test_the_driver_runs_the_stage_the_plan_records_under_auto(capsys):
    """--shard-state auto with a plan file: the stage the plan was made for is applied,
    counted in the budget check and named in the summary."""
    from disttensor_nn.plan import make_plan

    tmp = shared_dir()
    model, shape = build_model("mesh-demo", SIZE, 4)
    path = os.path.join(tmp, "plan.json")
    if comm.rank == 0:
        plan = make_plan(model, shape, comm.size, V100, shard_state="full")[0]
        with open(path, "w") as f:
            f.write(plan.to_json())
    comm.Barrier()
    s = train(TrainConfig(model="mesh-demo", size=SIZE, batch=4, steps=1, samples=8,
                          metrics=None, machine=V100, progress=False, layout=path,
                          kernels="numpy", shard_state="auto"))
    out = capsys.readouterr().out
    collective_assert(s["shard_state"] == "full", s["shard_state"])
    collective_assert(comm.rank > 0 or "parameter state sharded: full (chosen by "
                      "--shard-state auto" in out, out)
