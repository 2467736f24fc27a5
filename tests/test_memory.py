"""Memory: layers' declarations against measured allocations, measurement within a budget,
the budget as a promise, and the memory profile.

Each layer's :class:`~disttensor_nn.costspec.CostSpec` says what it keeps from
forward to backward and how much scratch its passes need; here both are
measured with ``tracemalloc`` on the layer itself, so a layer whose
implementation keeps more (or less) than it declares fails, whichever
implementation it has.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.testing import collective_assert
from disttensor_nn.kernels import numpy_kernels, torch_kernels, use_kernels
from disttensor_nn.memory import (
    MemoryProfile,
    map_large_allocations,
    peak_resident_bytes,
    reset_peak,
    resident_bytes,
)
from disttensor_nn.models import DepthToSpace
from disttensor_nn.optim.optimizer import CHUNK
from disttensor_nn.plan import (
    CostModel,
    KernelTimer,
    MachineProfile,
    Planner,
    apply_plan,
    builtin_profiles,
)
from disttensor_nn.plan.planner import leaf_nodes, trace
from disttensor_nn.recompute import recompute_segments
from disttensor_nn.reduction import GradientBuckets
from disttensor_nn.training import TrainConfig, build_model, loop, train
from disttensor_nn.training.driver import MemoryBudgetError, SetupError

S = (2, 16, 96, 96)  # 1.1 MiB per float32 block: far above Python's own allocations
SLACK = 160 * 2**10  # objects besides arrays (plans, geometry, hooks), bytes


def _local(layer: nn.Layer, shape: tuple[int, ...]) -> dict[str, int]:
    """Bytes measured with tracemalloc on one process: kept, forward and backward scratch."""
    nd = len(shape)
    grid = ProcessGrid((1,) * nd, MPI.COMM_SELF)
    axes = (0, None, *range(1, nd - 1))
    dist = Distribution(shape, grid, axes)
    numpy_kernels.release_workspace()
    gc.collect()
    tracemalloc.start()
    try:
        x = DistArray.from_local(np.random.default_rng(0).standard_normal(shape)
                                 .astype(np.float32), dist)
        in_bytes = x.local.nbytes
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        y = layer(x)
        out_bytes, out_dist, out_local = y.local.nbytes, y.dist, y.local_shape
        forward_peak = tracemalloc.get_traced_memory()[1] - base
        del x, y
        numpy_kernels.release_workspace()  # scratch, not kept
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base + in_bytes
        dy = DistArray.from_local(np.ones(out_local, np.float32), out_dist)
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        dx = layer.backward(dy)
        backward_peak = tracemalloc.get_traced_memory()[1] - base
        del dx, dy
    finally:
        tracemalloc.stop()
        numpy_kernels.release_workspace()
    pure = Distribution(shape, (1,) * nd, axes)
    spec = layer.cost_spec(pure, 4)
    return {"in": in_bytes, "out": out_bytes, "kept": kept, "spec": spec,
            # scratch beyond the output (and what forward keeps), beyond the returned gradient
            "workspace": max(forward_peak - out_bytes - spec.saved, backward_peak - in_bytes)}


LAYERS = [
    pytest.param(lambda: nn.Conv2d(16, 32, 3, padding=1), id="conv3x3"),
    pytest.param(lambda: nn.Conv2d(16, 32, 5, stride=2, padding=2), id="conv5x5s2"),
    pytest.param(lambda: nn.Conv2d(16, 64, 1), id="conv1x1"),
    pytest.param(lambda: nn.ReLU(), id="relu"),
    pytest.param(lambda: nn.LeakyReLU(0.1), id="leaky"),
    pytest.param(lambda: nn.BatchNorm2d(16), id="bn"),
    pytest.param(lambda: nn.Sigmoid(), id="sigmoid"),
    pytest.param(lambda: nn.MaxPool2d(3, 2, padding=1), id="maxpool"),
    pytest.param(lambda: nn.AvgPool2d(2), id="avgpool"),
    pytest.param(lambda: DepthToSpace(2), id="depth2space"),
]


@pytest.mark.parallel(1)
@pytest.mark.parametrize("make", LAYERS)
def test_kept_bytes_are_what_the_layer_declares(make):
    """What stays allocated after forward (the caller's references dropped) = CostSpec.kept."""
    m = _local(make(), S)
    declared = m["spec"].kept(m["in"], m["out"])
    assert abs(m["kept"] - declared) <= 0.01 * declared + SLACK, (m["kept"], declared)


@pytest.mark.parallel(1)
@pytest.mark.parametrize("make", LAYERS)
def test_workspace_bounds_the_passes_scratch_closely(make):
    """The declared workspace covers the scratch measured in either pass, without padding it
    by more than half (or 1 MiB for layers with almost none)."""
    m = _local(make(), S)
    declared = m["spec"].workspace
    assert m["workspace"] <= declared + SLACK, (m["workspace"], declared)
    assert declared <= 1.6 * m["workspace"] + 2**20, (m["workspace"], declared)


@pytest.mark.parallel(1)
def test_a_numpy_convolution_on_two_threads_declares_a_tile_per_thread():
    """The NumPy kernels' pool gives each thread its own columns: the workspace declared
    and measured with two threads, as with one."""
    numpy_kernels.set_num_threads(2)
    try:
        m = _local(nn.Conv2d(16, 32, 3, padding=1), S)
    finally:
        numpy_kernels.set_num_threads(1)
    one = _local(nn.Conv2d(16, 32, 3, padding=1), S)
    declared = m["spec"].workspace
    assert declared > one["spec"].workspace, (declared, one["spec"].workspace)
    assert m["workspace"] <= declared + SLACK, (m["workspace"], declared)
    assert declared <= 1.6 * m["workspace"] + 2**20, (m["workspace"], declared)


TORCH_CONVS = [
    pytest.param(lambda: nn.Conv2d(32, 32, 3, padding=1), (1, 32, 256, 512), id="3x3"),
    pytest.param(lambda: nn.Conv2d(8, 64, 5, stride=2, padding=2), (1, 8, 512, 512),
                 id="5x5s2-widening"),
    pytest.param(lambda: nn.Conv2d(64, 128, 3, stride=2, padding=1), (1, 64, 256, 256),
                 id="3x3s2"),
]


def _torch_conv_peaks(case: int) -> tuple[int, int, int, int, int]:
    """(forward peak, backward peak, output bytes, input-gradient bytes, declared
    workspace) of ``TORCH_CONVS[case]`` on the torch kernels, as resident bytes above each
    pass's start (every large allocation mapped on its own, as the training driver has
    them). Run in a process of its own: oneDNN keeps scratch memory from one convolution
    to the next, so a pass after larger ones elsewhere in a process allocates less."""
    make, shape = TORCH_CONVS[case].values
    assert reset_peak(), "the resident peak cannot be restarted here"
    map_large_allocations(2**20)
    layer = make()
    use_kernels(layer, "torch")
    grid = ProcessGrid((1,) * 4, MPI.COMM_SELF)
    dist = Distribution(shape, grid, (0, None, 1, 2))
    x = DistArray.from_local(np.random.default_rng(0).standard_normal(shape)
                             .astype(np.float32), dist)
    y = layer(x)  # oneDNN's code and caches for these shapes, which the baseline holds
    layer.backward(DistArray.from_local(np.ones(y.local_shape, np.float32), y.dist))
    del y

    def peak(run):
        gc.collect()
        start = resident_bytes()
        reset_peak()
        result = run()
        return peak_resident_bytes() - start, result

    fwd, y = peak(lambda: layer(x))
    dy = DistArray.from_local(np.ones(y.local_shape, np.float32), y.dist)
    bwd, dx = peak(lambda: layer.backward(dy))
    spec = layer.cost_spec(Distribution(shape, (1,) * 4, (0, None, 1, 2)), 4)
    return fwd - spec.saved, bwd, y.local.nbytes, dx.local.nbytes, int(spec.workspace)


@pytest.mark.parallel(1)
@pytest.mark.skipif(not torch_kernels.available(), reason="needs the torch extra")
@pytest.mark.parametrize("case", range(len(TORCH_CONVS)),
                         ids=[c.id for c in TORCH_CONVS])
def test_a_torch_convolution_declares_the_memory_its_kernels_take_outside_the_cache(case):
    """PyTorch's CPU convolutions copy their blocks into oneDNN's layout, in memory that
    tracemalloc does not see: measured as the resident peak of each pass (in a fresh
    process), beyond the blocks the pass returns, the declared workspace covers it
    without padding it by more than half."""
    from disttensor.testing.launch import mpiexec_path

    if not reset_peak():
        pytest.skip("the resident peak cannot be restarted here")
    mpiexec = mpiexec_path()
    if shutil.which(mpiexec) is None:
        pytest.skip("no mpiexec found")
    here = os.path.dirname(os.path.abspath(__file__))
    drop = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "_PYTEST_MPI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(here), here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = f"import test_memory; print(*test_memory._torch_conv_peaks({case}))"
    r = subprocess.run([mpiexec, "-n", "1", sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fwd, bwd, out, grad, declared = map(int, r.stdout.split()[-5:])
    measured = max(fwd - out, bwd - grad)
    assert measured <= declared + 4 * 2**20, (fwd, bwd, declared)
    assert declared <= 1.5 * measured + 4 * 2**20, (fwd, bwd, declared)


def _profile(**kw) -> MachineProfile:
    base = dict(name="test", p2p_alpha=1e-5, p2p_beta=1e-9, allreduce_alpha=2e-5,
                allreduce_beta=2e-9, alltoall_alpha=3e-5, alltoall_beta=3e-9,
                peak_flops=1e10, efficiency=0.5, mem_bandwidth=1e10, memory_per_rank=2**30,
                measured=True, cores_per_node=2)
    base.update(kw)
    return MachineProfile(**base)


@pytest.mark.parallel([1, 2])
def test_kernel_measurement_stays_within_a_small_budget(tmp_path_factory):
    """Blocks far larger than the budget allows at once are timed on tiles, in segments.

    Four 16 MiB inputs (and their outputs and gradients) held at once, as the
    chain measurement used to, would need well over 128 MiB; with a budget of
    48 MiB and 2 MiB tiles the traced peak stays below the budget, every
    block gets a time scaled from its tile by the FLOPs' ratio, and is marked
    as tiled.
    """
    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("k")) if comm.rank == 0 else None)
    timer = KernelTimer("t", cache_dir=cache)
    timer.tile_bytes = 2 * 2**20
    f4 = np.dtype(np.float32)
    shape = (1, 16, 514, 514)  # a 3x3 convolution's halo-extended block, 16.1 MiB
    layers = [nn.Conv2d(16, 16, 3, padding=1, seed=i) for i in range(2)] + [nn.ReLU(),
                                                                           nn.BatchNorm2d(16)]
    queries = [(layer, shape if isinstance(layer, nn.Conv2d) else (1, 16, 512, 512), f4, 1.0)
               for layer in layers]
    budget = 48 * 2**20
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        timer.measure_chain(queries, comm, reps=1, memory=budget)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    collective_assert(peak < budget, f"measurement peak {peak / 2**20:.1f} MiB")
    for layer, local, _, _ in queries:
        tile = timer.tile(layer, local)
        collective_assert(math.prod(tile) * 4 <= timer.tile_bytes and tile != local, str(tile))
        full = timer.table[timer.key(layer, local, f4, comm.size)]
        part = timer.table[timer.key(layer, tile, f4, comm.size)]
        factor = timer.scale(layer, local, tile)
        collective_assert(full[0] == pytest.approx(part[0] * factor) and full[3] == "tile",
                          f"{full} {part}")
        collective_assert(timer.tiled(layer, local, f4, comm.size), "not marked as tiled")
    # the two convolutions share one signature, so one tile times both
    collective_assert(len({k for k in timer.table if k.startswith("conv")}) == 2,
                      str(list(timer.table)))


def test_tile_scale_is_the_flops_ratio():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    timer = KernelTimer("t", cache_dir="/nonexistent", measure=False)
    timer.tile_bytes = 2**20
    local = (2, 8, 258, 130)
    tile = timer.tile(conv, local)
    assert tile[0] == 1 and tile[1] == 8 and math.prod(tile) * 4 <= 2**20
    out = lambda s: s[0] * 8 * (s[2] - 2) * (s[3] - 2)  # noqa: E731 (valid 3x3 outputs)
    assert timer.scale(conv, local, tile) == pytest.approx(out(local) / out(tile))
    assert timer.tile(conv, (1, 8, 34, 34)) == (1, 8, 34, 34)  # small blocks as they are


V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing


def _config(**kw) -> TrainConfig:
    base = dict(model="mesh-demo", size=(64, 64), batch=4, steps=1, samples=8, metrics=None,
                machine=V100, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parallel([1, 3])
def test_a_budget_no_plan_fits_is_refused_on_every_rank(capsys):
    with pytest.raises(SetupError, match="fits 1 MiB per rank") as err:
        train(_config(memory_per_rank=2**20))
    collective_assert(not isinstance(err.value, MemoryBudgetError), "the planner decides")
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.rank == 0:
        assert "peak resident memory per rank" in out


@pytest.mark.parallel([1, 2])
def test_a_step_that_would_pass_the_budget_is_refused_naming_layer_and_shortfall(tmp_path_factory):
    """A plan file whose budget is below what the ranks already hold plus the step's need."""
    comm = MPI.COMM_WORLD
    tmp = comm.bcast(str(tmp_path_factory.mktemp("plan")) if comm.rank == 0 else None)
    model, shape = build_model("mesh-demo", (64, 64), 4)
    planner = Planner(model, shape, CostModel(builtin_profiles()[V100], comm.size))
    plan = planner.plan()
    plan.memory_budget = resident_bytes() + 0.5 * (plan.peak_memory - plan.baseline_memory)
    path = os.path.join(tmp, "plan.json")
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write(plan.to_json())
    comm.Barrier()
    with pytest.raises(MemoryBudgetError, match=r"over the budget of \d+ MiB by \d+ MiB") as err:
        train(_config(layout=path))
    names = [f"layer {e.name} ({e.layer})" for e in plan.entries]
    collective_assert(any(n in str(err.value) for n in names), str(err.value))
    collective_assert(comm.allgather(str(err.value)) == [str(err.value)] * comm.size,
                      "the message differs between ranks")


@pytest.mark.parallel([1, 2])
def test_summary_reports_training_and_planning_peaks_apart_and_profiles_layers():
    s = train(_config(profile_memory=True, steps=2))
    phases = {p["name"] for p in s["memory_profile"]["phases"]}
    collective_assert({"data", "planning", "forward", "backward", "optimizer"} <= phases,
                      str(phases))
    layers = [p["name"] for p in s["memory_profile"]["layers"]]
    collective_assert(any(n.endswith("Conv2d forward") for n in layers) and
                      any(n.endswith("Conv2d backward") for n in layers), str(layers))
    train_peak = s["training_peak_memory_per_rank_bytes"]
    collective_assert(0 < train_peak <= s["peak_memory_per_rank_bytes"], str(s))
    collective_assert(0 < s["planning_peak_memory_per_rank_bytes"]
                      <= s["peak_memory_per_rank_bytes"], str(s))


def test_memory_profile_separates_the_peaks_of_phases():
    prof = MemoryProfile()
    with prof.phase("big"):
        a = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        del a
    with prof.phase("small"):
        b = np.ones(2**20 // 8)
        del b
    big, small = prof.phases["big"], prof.phases["small"]
    assert big.peak >= big.start + 60 * 2**20
    if prof.exact:  # the operating system lets the peak be restarted
        assert small.peak < big.peak - 48 * 2**20
    assert peak_resident_bytes() > 0


def _recompute_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, seed=1), nn.ReLU(), nn.BatchNorm2d(8),
                         nn.Conv2d(8, 8, 3, padding=1, seed=2), nn.ReLU(), nn.BatchNorm2d(8),
                         nn.Conv2d(8, 2, 1, seed=3), nn.Sigmoid())


@pytest.mark.parallel([1, 2, 3])
def test_recompute_gives_the_gradients_of_keeping_activations():
    """Segments recomputed in backward: the same input gradient, parameter gradients and
    running statistics as keeping every activation, and nothing saved between passes."""
    comm = MPI.COMM_WORLD
    shape = (2, 3, 10, 9)
    results = []
    for recompute in (False, True):
        model = _recompute_net()
        planner = Planner(model, shape, CostModel(builtin_profiles()[V100], comm.size),
                          allowed=[(1, comm.size, 1)], recompute=recompute)
        plan = planner.plan()
        groups = [e.recompute for e in plan.entries]
        collective_assert((min(groups) >= 0) == recompute, str(groups))
        apply_plan(model, plan, shape, comm)
        layers = [n.layer for n in leaf_nodes(trace(model, shape))]
        recompute_segments(layers, groups)
        grid = model[0].layout.grid
        data = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
        x = dt.asarray(data, grid=grid, axes=(0, None, 1, 2))
        y = model(x)
        if recompute:  # what the segments' layers saved is gone until backward
            collective_assert(not hasattr(layers[1], "_mask") and
                              not hasattr(layers[2], "_saved"), "state kept")
        dy = dt.asarray(np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape),
                        grid=y.dist.grid, axes=y.dist.axes)
        dx = model.backward(dy)
        results.append((dx.to_global(),
                        [p.grad.copy() for p in model.parameters()],
                        [b.copy() for _, b in model.named_buffers()], plan))
    (dx0, g0, b0, keep), (dx1, g1, b1, rec) = results
    collective_assert(np.allclose(dx0, dx1, rtol=1e-5, atol=1e-6), "input gradients differ")
    collective_assert(all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(g0, g1)),
                      "parameter gradients differ")
    collective_assert(all(np.array_equal(a, b) for a, b in zip(b0, b1)),
                      "running statistics updated twice")
    collective_assert(rec.time > keep.time, f"{rec.time} {keep.time}")  # forward twice
    collective_assert("R recomputed" in rec.table(), rec.table())


def test_recompute_auto_only_when_no_plan_fits_otherwise():
    model = nn.Sequential(*[layer for _ in range(6) for layer in (
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(8))])
    shape = (1, 8, 128, 128)
    cm = CostModel(builtin_profiles()[V100], 1)
    keep = Planner(model, shape, cm).plan()
    rec = Planner(model, shape, cm, recompute=True).plan()
    assert rec.peak_memory < keep.peak_memory
    fits = Planner(model, shape, cm, keep.peak_memory + 1, recompute="auto").plan()
    assert fits.entries == keep.entries  # nothing recomputed when keeping everything fits
    between = (keep.peak_memory + rec.peak_memory) / 2
    auto = Planner(model, shape, cm, between, recompute="auto").plan()
    assert auto.peak_memory <= between and any(e.recompute >= 0 for e in auto.entries)
    with pytest.raises(ValueError, match="fits"):
        Planner(model, shape, cm, between).plan()


def _applied_recompute_net(shape: tuple[int, ...]) -> tuple[nn.Sequential, list]:
    """:func:`_recompute_net` laid out by a plan that keeps every activation."""
    comm = MPI.COMM_WORLD
    model = _recompute_net()
    plan = Planner(model, shape, CostModel(builtin_profiles()[V100], comm.size),
                   allowed=[(1, comm.size, 1)], recompute=False).plan()
    apply_plan(model, plan, shape, comm)
    return model, [n.layer for n in leaf_nodes(trace(model, shape))]


def _step(model: nn.Sequential, data: np.ndarray) -> tuple[DistArray, DistArray | None]:
    x = dt.asarray(data, grid=model[0].layout.grid, axes=(0, None, 1, 2))
    y = model(x)
    dy = dt.asarray(np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape),
                    grid=y.dist.grid, axes=y.dist.axes)
    return y, model.backward(dy)


RECOMPUTE_GROUPS = [0, 0, 0, 1, 1, 1, -1, -1]


@pytest.mark.parallel([1, 2, 3])
def test_recompute_keeps_eval_mode_and_input_grad():
    """A segment drops only per-pass state: ``eval()`` and ``input_grad = False`` set after
    it is installed hold through forward passes (against a twin model without segments)."""
    shape = (2, 3, 10, 9)
    data = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    model, layers = _applied_recompute_net(shape)
    twin, _ = _applied_recompute_net(shape)
    recompute_segments(layers, RECOMPUTE_GROUPS)
    for m in (model, twin):
        _step(m, data)  # a training step moves the running statistics off 0 and 1
        m.eval()
    y1, y2 = model(_step_input(model, data)), model(_step_input(model, data))
    collective_assert(not any(m.training for m in model.modules()), "training mode came back")
    ref = twin(_step_input(twin, data)).to_global()
    collective_assert(np.allclose(y1.to_global(), ref, rtol=1e-5, atol=1e-6) and
                      np.allclose(y2.to_global(), ref, rtol=1e-5, atol=1e-6),
                      "eval forward differs from the model without segments")
    model.train()
    model[0].input_grad = False
    _, dx = _step(model, data)
    collective_assert(model[0].input_grad is False and dx is None, "input_grad came back")


def _step_input(model: nn.Sequential, data: np.ndarray) -> DistArray:
    return dt.asarray(data, grid=model[0].layout.grid, axes=(0, None, 1, 2))


@pytest.mark.parallel([1, 2, 3])
def test_recompute_installed_after_a_step_drops_saved_state():
    """Segments installed after a training step still drop what forward saved, and the
    next step's gradients are those of a twin model that keeps its activations."""
    shape = (2, 3, 10, 9)
    data = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    model, layers = _applied_recompute_net(shape)
    twin, _ = _applied_recompute_net(shape)
    for m in (model, twin):
        _step(m, data)
        m.zero_grad()
    recompute_segments(layers, RECOMPUTE_GROUPS)
    y = model(_step_input(model, data))
    dropped = [not hasattr(m, name) for m in layers[:6] for name in m.saved_for_backward]
    collective_assert(all(dropped) and len(dropped) == 6, f"state kept: {dropped}")
    collective_assert(hasattr(layers[7], "_y"), "a layer outside the segments lost its state")
    dy = dt.asarray(np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape),
                    grid=y.dist.grid, axes=y.dist.axes)
    dx = model.backward(dy)
    _, dx_ref = _step(twin, data)
    collective_assert(np.allclose(dx.to_global(), dx_ref.to_global(), rtol=1e-5, atol=1e-6),
                      "input gradients differ")
    collective_assert(all(np.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                          for p, q in zip(model.parameters(), twin.parameters())),
                      "parameter gradients differ")


def test_memory_profile_keeps_a_peak_between_phases():
    """64 MiB touched and freed between two phases, after a profile exists: its whole-run
    peak still has it, and creating a profile does not restart the process's count."""
    big = np.ones(96 * 2**20 // 8)
    before = peak_resident_bytes()
    del big
    prof = MemoryProfile()
    slack = 2**20  # the kernel's resident counts lag by a few pages
    assert prof.peak() >= before - slack  # creating it restarted nothing
    with prof.phase("a"):
        pass
    base = resident_bytes()
    a = np.ones(64 * 2**20 // 8)  # between the phases
    del a
    with prof.phase("b"):
        pass
    assert prof.peak() >= base + 60 * 2**20
    assert prof.peak() >= before - slack
    if prof.exact:  # the phases themselves did not see the allocation
        assert prof.phases["b"].peak < base + 48 * 2**20


@pytest.mark.parallel(1)
def test_inference_model_counts_what_a_skip_block_holds():
    """An inference pass through a U-Net level (``Skip``: pool, conv, up-convolution, channel
    concatenation, decoder): the planner's predicted peak (``training=False``) is what the pass
    allocates at its peak, measured with tracemalloc, to within Python's own objects. The
    peak is in the decoder, while the block's input (held by its caller until the block
    returns), the concatenation (held by the decoder's call) and the network's input are
    alive besides the layer's own input, output and scratch."""
    shape = (1, 1, 256, 256)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Skip(nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                              nn.ConvTranspose2d(4, 4, 2, stride=2)),
                post=nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())),
        nn.Conv2d(4, 2, 1))
    model.eval()
    planner = Planner(model, shape, CostModel(builtin_profiles()[V100], 1, training=False))
    plan = planner.uniform_plan((1, 1, 1))
    apply_plan(model, plan, shape, MPI.COMM_SELF)
    params = sum(p.data.nbytes for p in model.parameters())
    out_bytes = 2 * 256 * 256 * 4
    predicted = plan.peak_memory - params - out_bytes  # the pass alone (baseline 0)

    def drop(layer, x, y):  # what disttensor-predict does after every layer
        layer.release_saved()
        numpy_kernels.release_workspace()

    for _, layer in model.named_modules():
        layer.register_forward_hook(drop)
    dist = Distribution(shape, ProcessGrid((1,) * 4, MPI.COMM_SELF), (0, None, 1, 2))
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    model(DistArray.from_local(data.copy(), dist))  # plans and geometry built once
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        x = DistArray.from_local(data.copy(), dist)
        y = model(x)
        measured = tracemalloc.get_traced_memory()[1] - base
        del x, y
    finally:
        tracemalloc.stop()
    # the network's input and the block's input (1 + 4 channels) are what a model counting
    # only each layer's own pass would leave out: far more than the tolerance
    assert (1 + 4) * 256 * 256 * 4 >= 8 * SLACK
    assert abs(measured - predicted) <= SLACK, (measured, predicted)


@pytest.mark.parallel(1)
def test_parameter_state_of_a_step_is_what_the_model_counts(monkeypatch):
    """Parameters, gradients, momenta, and the larger of the local gradients the buckets
    hold until the end of backward (small ones copied into a fused bucket too) and the
    optimizer's temporaries, measured over a step whose weights dwarf its activations and
    whose layers use no scratch."""
    model = nn.Sequential(nn.Linear(64, 128),  # 32 KiB of weights: fused into a bucket
                          nn.Linear(128, 2048))  # 1 MiB: reduced alone, in place
    shape = (4, 64)
    cost = CostModel(builtin_profiles()[V100], 1)
    plan = Planner(model, shape, cost).plan()
    apply_plan(model, plan, shape, MPI.COMM_SELF)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = dt.asarray(np.ones(shape, np.float32), grid=ProcessGrid((1,), MPI.COMM_SELF),
                   axes=(0, None))
    sizes = [p.data.nbytes for p in model.parameters()]
    held = []  # bytes alive when backward ends, before the reductions are added to the grads
    wait = GradientBuckets.wait
    monkeypatch.setattr(GradientBuckets, "wait", lambda self: (
        held.append(tracemalloc.get_traced_memory()[0]), wait(self)))
    peaks = []
    for _ in range(2):  # the first step creates the momenta: measure the second
        opt.zero_grad()
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            y = model(x)
            with GradientBuckets():
                model.call_backward(DistArray.from_local(np.ones(y.local_shape, np.float32),
                                                         y.dist))
            del y
            backward = held[-1] - base
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            opt.step()
            peaks = [backward, tracemalloc.get_traced_memory()[1] - base]
        finally:
            tracemalloc.stop()
    activations = 4 * (64 + 128 + 2048) * 4  # every block at once, at most
    # Linear's local gradients are of the parameters' dtype, the small ones also copied
    # into a fused bucket (by hand: only the 1 MiB weight is not)
    grads = list(sizes)
    pending = sum(grads) + sum(n for n in grads if n < 2**20)
    assert pending - SLACK <= peaks[0] <= pending + activations + SLACK, (peaks, pending)
    # SGD's update sweeps each parameter a piece at a time through a piece's scratch
    scratch = min(max(sizes), CHUNK * 4)
    assert scratch - SLACK <= peaks[1] <= scratch + SLACK, (peaks, sizes)
    # as the model counts it: weights, gradients, momenta, and the larger of the gradients
    # waiting for their reduction (the small ones twice: in a bucket) and the scratch
    assert cost.params_memory(model) == pytest.approx(
        3 * sum(sizes) + max(sum(sizes) + sum(n for n in sizes if n < 2**20), scratch))
    # the planner: parameters, gradients and momenta, the larger of the two additions on
    # top (the buckets' share, priced per layer), and the loss's output and its gradient
    planner = Planner(model, shape, cost)
    added = planner.base_memory - 3 * sum(sizes) - 2 * 4 * 2048 * 4
    collective_assert(abs(added - peaks[0]) <= activations + SLACK,
                      f"model {added}, measured {peaks[0]}")


@pytest.mark.parallel([1, 2])
def test_memory_released_before_each_step_leaves_the_training_unchanged(monkeypatch):
    """What the allocator keeps after the loader and the last step is given back before
    every step; the losses (so the gradients) are those of a run that keeps it."""
    calls = []
    release = loop.release_free_memory  # before each batch, in the step loop
    monkeypatch.setattr(loop, "release_free_memory",
                        lambda *keep, **only: calls.append(1) or release(*keep, **only))
    kept = train(_config(steps=2, size=(32, 32)))
    collective_assert(len(calls) >= 2, f"released {len(calls)} times in 2 steps")
    monkeypatch.setattr(loop, "release_free_memory", lambda *keep, **only: True)
    not_kept = train(_config(steps=2, size=(32, 32)))
    collective_assert(kept["history"] == not_kept["history"],
                      f"{kept['history']} {not_kept['history']}")


def test_reductions_in_flight_add_the_machines_scratch_on_several_ranks():
    """The MPI library's temporaries, ``reduce_scratch`` bytes per gradient byte in flight,
    count only where gradients are summed over ranks; by hand for two layers."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 8, 1))
    grads = [(8 * 4 * 9 + 8) * 4, (8 * 8 + 8) * 4]  # float32 weights and biases, each fused
    profile = dataclasses.replace(builtin_profiles()[V100], reduce_scratch=0.5)
    one, two = CostModel(profile, 1), CostModel(profile, 2)
    params = sum(grads)
    assert one.params_memory(model, grads) == 3 * params + 2 * sum(grads)
    assert two.params_memory(model, grads) == 3 * params + 2 * sum(grads) + 0.5 * sum(grads)
