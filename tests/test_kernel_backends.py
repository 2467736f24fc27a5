"""Choosing each layer's kernels: the planner's choice between backends, applying it, and
refusing a backend this installation cannot run (before any work, alike on every rank).

None of these tests needs PyTorch: the choice is made from kernel times a stand-in timer
gives, and where PyTorch is missing the refusals are checked as they are; where it is
installed they are checked with it hidden from the process. One test, skipped without
PyTorch, compares the residual sums taken over its threads with NumPy's.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI
from threadpoolctl import threadpool_info

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import collective_assert
from disttensor_nn.costspec import largest_block
from disttensor_nn.kernels import (
    BACKENDS,
    available_backends,
    check_backend,
    kernels_for,
    limit_threads,
    optimizer_backend,
    threads_now,
    torch_kernels,
    use_kernels,
    with_backend,
)
from disttensor_nn.plan import CostModel, Planner, apply_plan, kernel_choice, load_profile
from disttensor_nn.plan.timer import QueryRecorder

comm = MPI.COMM_WORLD
HAS_TORCH = torch_kernels.available()

# forward seconds per element of the local block, by layer kind and backend: the stand-in
# timer makes the torch kernels faster for convolutions and pooling, slower for ReLU
RATES = {("Conv2d", "torch"): 1.0, ("Conv2d", "numpy"): 3.0,
         ("MaxPool2d", "torch"): 1.0, ("MaxPool2d", "numpy"): 2.0,
         ("ReLU", "torch"): 2.0, ("ReLU", "numpy"): 1.0}


class RateTimer:
    """Kernel times from RATES (no measurement): what a cost model asks a KernelTimer."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def times(self, layer, local_in, dtype, flops, corun=1, synced=False):
        kind = type(layer).__name__
        backend = layer.kernel_backend or "numpy"
        self.asked.append((kind, backend))
        t = RATES.get((kind, backend), 1.0) * 1e-9 * float(np.prod(local_in))
        return t, 2 * t, False, corun


def small_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1))


SHAPE = (4, 2, 16, 16)


def plan_with(backends, nprocs: int = 1):
    cost = CostModel(load_profile("v100-nvlink-edr"), nprocs, RateTimer(), backends=backends)
    return Planner(small_net(), SHAPE, cost).plan(), cost.timer


@pytest.mark.parallel([1])
def test_the_planner_keeps_each_layers_faster_backend():
    plan, timer = plan_with(("numpy", "torch"))
    kernels = {e.name: e.kernels for e in plan.entries}
    # conv and pool faster in torch, ReLU in numpy; batch norm ties: the first backend
    assert kernels == {"0": "torch", "1": "numpy", "2": "numpy", "3": "torch", "4": "torch"}, \
        kernels
    assert {("Conv2d", "numpy"), ("Conv2d", "torch"), ("ReLU", "numpy"),
            ("ReLU", "torch")} <= set(timer.asked)
    table = plan.table()
    assert "kernels" in table.splitlines()[0]
    assert [line.split()[5] for line in table.splitlines()[2:7]] == \
        ["torch", "numpy", "numpy", "torch", "torch"], table
    # the faster kernels make the plan faster than either backend alone
    t_numpy = plan_with(("numpy",))[0].time
    t_torch = plan_with(("torch",))[0].time
    assert plan.time < min(t_numpy, t_torch)


@pytest.mark.parallel([1])
def test_one_backend_is_used_for_every_layer_that_has_it_and_none_chooses_nothing():
    plan, timer = plan_with(("torch",))
    assert [e.kernels for e in plan.entries] == ["torch"] * 5
    assert {b for _, b in timer.asked} == {"torch"}
    plan, timer = plan_with(None)
    assert [e.kernels for e in plan.entries] == ["numpy"] * 5
    assert "kernels" not in plan.table().splitlines()[0]  # no choice made: no column


@pytest.mark.parallel([1])
def test_a_query_recorder_lists_every_backends_kernels_to_measure():
    cost = CostModel(load_profile("v100-nvlink-edr"), 1, QueryRecorder(),
                     backends=("numpy", "torch"))
    net = small_net()
    planner = Planner(net, SHAPE, cost)
    queries = planner.kernel_queries((1, 1, 1))
    seen = {(type(q[0]).__name__, q[0].kernel_backend) for q in queries}
    assert {("Conv2d", "numpy"), ("Conv2d", "torch"), ("MaxPool2d", "torch"),
            ("BatchNorm2d", "numpy"), ("BatchNorm2d", "torch")} <= seen, seen
    # the variants share the layer's parameters and are the same object when asked again
    conv = net[0]
    assert with_backend(conv, "torch") is with_backend(conv, "torch")
    assert with_backend(conv, "torch").weight is conv.weight
    assert conv.kernel_backend is None


@pytest.mark.parallel([1, 2, 3])
def test_apply_plan_sets_each_layers_kernels_or_refuses_without_torch():
    plan, _ = plan_with(("numpy", "torch"), comm.Get_size())
    net = small_net()
    if HAS_TORCH:
        apply_plan(net, plan, SHAPE, comm)
        got = [layer.kernel_backend for layer in net]
        collective_assert(got == ["torch", "numpy", "numpy", "torch", "torch"], str(got))
        return
    with pytest.raises(ImportError, match=r'pip install "disttensor\[torch\]"'):
        apply_plan(net, plan, SHAPE, comm)
    collective_assert(all(layer.layout is None for layer in net), "half applied")


@pytest.mark.parallel([1])
def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="unknown kernel backend 'cudnn'"):
        check_backend("cudnn")
    with pytest.raises(ValueError, match=r"kernels must be one of \['auto', 'numpy', 'torch'\]"):
        kernel_choice("fast")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        CostModel(load_profile("v100-nvlink-edr"), 1, backends=("numpy", "fast"))
    assert kernel_choice(None) is None and kernel_choice("numpy") == ("numpy",)
    assert kernel_choice("auto") == available_backends()
    assert set(available_backends()) <= set(BACKENDS) and "numpy" in available_backends()
    with pytest.raises(ValueError):
        use_kernels(small_net(), "fast")
    opt = nn.SGD(small_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        opt.kernel_backend = "fast"
    opt.kernel_backend = "numpy"  # the arrays' own module's, as None
    assert opt.kernel_backend is None
    assert optimizer_backend(("numpy", "torch")) == "torch"
    assert optimizer_backend(("numpy",)) is None and optimizer_backend(None) is None


def _hide_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(torch_kernels._state, "torch", None)


@pytest.mark.parallel([1, 2])
def test_without_torch_every_way_to_ask_for_it_raises_the_import_error_naming_the_extra(
        monkeypatch):
    _hide_torch(monkeypatch)
    assert not torch_kernels.available() and available_backends() == ("numpy",)
    hint = r'pip install "disttensor\[torch\]"'
    net = small_net()
    opt = nn.SGD(net.parameters(), lr=0.1)

    def optimizer_kernels():
        opt.kernel_backend = "torch"

    for call in (lambda: check_backend("torch"), lambda: kernel_choice("torch"),
                 lambda: use_kernels(net, "torch"), lambda: kernels_for(np.zeros(1), "torch"),
                 optimizer_kernels):
        with pytest.raises(ImportError, match=hint):
            call()
    collective_assert(all(layer.kernel_backend is None for layer in net) and
                      opt.kernel_backend is None, "changed")
    conv = nn.Conv2d(2, 2, 3)
    conv.kernel_backend = "torch"
    x = dt.DistArray.from_global(np.ones((2, 2, 5, 5), np.float32),
                                 dt.Distribution((2, 2, 5, 5), dt.ProcessGrid(
                                     (comm.Get_size(), 1, 1, 1)), (0, None, None, None)))
    with pytest.raises(ImportError, match=hint):
        conv(x)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@pytest.mark.parallel([1, 2])
def test_a_dtype_the_torch_kernels_cannot_run_is_refused_naming_the_layer():
    conv = nn.Conv2d(2, 2, 3, dtype=np.float16)
    conv.kernel_backend = "torch"
    shape = (2, 2, 6, 6)
    x = dt.DistArray.from_global(np.ones(shape, np.float16), dt.Distribution(
        shape, dt.ProcessGrid((1, 1, comm.Get_size(), 1)), (None, None, 0, None)))
    with pytest.raises(TypeError, match="Conv2d: the torch kernels do not run float16 arrays "
                                        "on the cpu"):
        conv(x)  # before the halo exchange: every rank raises, none waits
    # and the planner never chooses them for float16
    cost = CostModel(load_profile("v100-nvlink-edr"), 1, RateTimer(), itemsize=2,
                     backends=("numpy", "torch"))
    assert [type(v).__name__ + str(v.kernel_backend) for v in cost.variants(conv)] == \
        ["Conv2dnumpy"]


def _python(code: str, nprocs: int) -> subprocess.CompletedProcess:
    from disttensor.testing.launch import mpiexec_path

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    drop = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "_PYTEST_MPI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = root
    return subprocess.run([mpiexec_path(), "-n", str(nprocs), sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parallel([1])
def test_the_clis_refuse_torch_kernels_without_torch_with_one_message_and_exit_2():
    for main in ("train_main", "plan_main"):
        args = ["--kernels", "torch"] + (["mesh-demo"] if main == "plan_main" else [])
        r = _python("import sys; sys.modules['torch'] = None\n"
                    f"from disttensor_nn.training.cli import {main}\n"
                    f"sys.exit({main}({args!r}))", 2)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr.count("error:") == 1, r.stderr
        assert 'pip install "disttensor[torch]"' in r.stderr, r.stderr
        assert "planning" not in r.stdout and "calibrat" not in r.stdout, r.stdout


@pytest.mark.parallel([1])
def test_threads_go_to_the_kernels_pool_where_torch_kernels_run_else_to_blas():
    """limit_threads: with PyTorch's kernels in play BLAS keeps one thread (its spinning
    workers took the cores from PyTorch's) and the NumPy kernels' pool and PyTorch take the
    threads; with NumPy's kernels alone, or without PyTorch, BLAS takes them."""
    def blas_threads() -> set[int]:
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    try:
        limit_threads(2, kernels="numpy")
        assert threads_now() == (1, 2) and blas_threads() == {2}
        limit_threads(2, kernels="auto")
        if HAS_TORCH:
            assert threads_now() == (2, 1) and blas_threads() == {1}
            assert torch_kernels.require().get_num_threads() == 2
        else:
            assert threads_now() == (1, 2) and blas_threads() == {2}
        limit_threads(1, kernels="torch")
        assert threads_now() == (1, 1) and blas_threads() == {1}
    finally:
        limit_threads(1)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
def test_residual_sums_over_torchs_threads_equal_numpys_exactly():
    """Where the torch kernels are in use, a residual block's sums (forward and backward)
    run in ATen: the same sums as NumPy's, bit for bit, in the input's dtype; arrays of
    different dtypes fall back to NumPy's promotion."""
    from disttensor_nn.layers.elementwise import add_blocks

    torch_kernels.require()
    assert torch_kernels.in_use()
    rng = np.random.default_rng(3)
    g = dt.ProcessGrid((1,), MPI.COMM_SELF)
    dtypes = [np.float16, np.float32, np.float64]
    if "ml_dtypes" in sys.modules or importlib.util.find_spec("ml_dtypes") is not None:
        dtypes.append(np.dtype(importlib.import_module("ml_dtypes").bfloat16))
    for dtype in dtypes:
        for shape in ((2, 3, 5, 7), (1, 64, 33, 17), (4, 1)):
            d = dt.Distribution(shape, g, (0,) + (None,) * (len(shape) - 1))
            a = rng.standard_normal(shape).astype(dtype)
            b = rng.standard_normal(shape).astype(dtype)
            out = add_blocks(dt.DistArray(a, d), dt.DistArray(b, d))
            assert isinstance(out.local, np.ndarray) and out.dtype == np.dtype(dtype)
            bits = np.dtype(f"i{out.local.itemsize}")  # bfloat16 compared bit for bit
            np.testing.assert_array_equal(out.local.view(bits), (a + b).view(bits))
            assert out.dist == d
    d = dt.Distribution((3, 4), g, (0, None))
    a, b = np.ones((3, 4), np.float32), np.full((3, 4), 0.1, np.float64)
    out = add_blocks(dt.DistArray(a, d), dt.DistArray(b, d))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out.local, a + b)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_torch_convolution_gradients_skip_the_bias_only_where_asked(nd):
    """``need_db=False`` gives no bias gradient and the same input and weight gradients as
    the NumPy kernels; by default the bias gradient follows ``need_dw``."""
    rng = np.random.default_rng(nd)
    x = rng.standard_normal((2, 3) + (7,) * nd)
    w = rng.standard_normal((4, 3) + (3,) * nd)
    stride, dilation = (2,) + (1,) * (nd - 1), (1,) * nd
    y = kernels_for(x, "numpy").conv_forward(x, w, None, stride, dilation)
    dy = rng.standard_normal(y.shape)
    want = kernels_for(x, "numpy").conv_backward(dy, x, w, stride, dilation)
    dx, dw, db = torch_kernels.conv_backward(dy, x, w, stride, dilation, need_db=False)
    assert db is None
    np.testing.assert_allclose(dx, want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, want[1], rtol=1e-12, atol=1e-12)
    _, dw, db = torch_kernels.conv_backward(dy, x, w, stride, dilation, need_dx=False)
    np.testing.assert_allclose(db, dy.sum(axis=(0, *range(2, 2 + nd))), rtol=1e-12)
    np.testing.assert_allclose(dw, want[1], rtol=1e-12, atol=1e-12)
    dx, dw, db = torch_kernels.conv_backward(dy, x, w, stride, dilation, need_dw=False)
    assert dw is None and db is None
    np.testing.assert_allclose(dx, want[0], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("make", [
    lambda: nn.Conv2d(3, 5, 3, padding=1), lambda: nn.Conv2d(3, 4, 5, stride=2, padding=2),
    lambda: nn.MaxPool2d(3, 2, padding=1), lambda: nn.AvgPool2d(3, 1, padding=1)])
def test_the_twin_the_timer_runs_makes_the_layers_kernel_calls(make, monkeypatch):
    """Where the torch kernels pad (the samples split, the image whole), the timer's twin
    keeps the padding and runs on the unpadded block: the kernel calls it makes are the
    layer's (shapes and padding), not those on a block padded beforehand. On a grid over
    the height the twin takes no channels-last blocks, as the layer takes none."""
    calls: list[tuple] = []
    for name in ("conv_forward", "conv_backward", "pool_forward", "pool_backward"):
        kernel = getattr(torch_kernels, name)

        def record(*args, _kernel=kernel, _name=name, **kw):
            calls.append((_name, tuple(args[0].shape), tuple(kw.get("padding") or ())))
            return _kernel(*args, **kw)
        monkeypatch.setattr(torch_kernels, name, record)
    p = comm.Get_size()
    layer = with_backend(make(), "torch")
    shape = (2 * p + 1, 3, 9, 10)  # uneven sample blocks
    grid = dt.ProcessGrid((p,), comm)
    dist = dt.Distribution(shape, grid, (0, None, None, None))
    spec = layer.cost_spec(dist)
    twin = with_backend(spec.twin, "torch").local_twin()  # as the timer builds its own
    twin.kernel_backend = "torch"
    whole = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x = dt.DistArray.from_global(whole, dist)
    y = layer.forward(x)
    layer.backward(dt.DistArray(np.ones_like(y.local), y.dist))
    ours = list(calls)
    calls.clear()
    block = dt.Distribution(spec.local_shape, dt.ProcessGrid((1,), MPI.COMM_SELF),
                            (0, None, None, None))
    t = twin.forward(dt.DistArray.from_local(np.ones(spec.local_shape, np.float32), block))
    twin.backward(dt.DistArray(np.ones_like(t.local), t.dist))
    collective_assert(
        spec.local_shape == largest_block(dist) and twin.twin_pads and
        twin.spec.padding == layer.spec.padding and
        (ours == calls or x.local.shape != spec.local_shape),
        f"layer calls {ours}, twin calls {calls} on {spec.local_shape}")
    if p > 1:  # the height split: a halo pads, and no channels-last blocks for either
        hdist = dt.Distribution((2, 3, 6 * p, 10), grid, (None, None, 0, None))
        hspec = layer.cost_spec(hdist)
        htwin = with_backend(hspec.twin, "torch").local_twin()
        htwin.kernel_backend = "torch"
        one = dt.Distribution(hspec.local_shape, dt.ProcessGrid((1,), MPI.COMM_SELF),
                              (0, None, None, None))
        collective_assert(
            not layer.takes_channels_last(hdist) and not htwin.takes_channels_last(one) and
            not htwin.twin_pads and hspec.local_shape[2] > 6 and
            htwin.kernel_signature() != layer.local_twin().kernel_signature(),
            f"{hspec.local_shape}, {htwin.kernel_signature()}")
