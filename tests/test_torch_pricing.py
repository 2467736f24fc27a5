"""How the planner prices a traced node as ``parallelize`` runs it (``pricing``).

A dimension of length one is never split by the compiler (its grid axis holds replicas),
so a candidate that splits it is priced on the replicated distribution (the cost model's
``runs_as``); a module whose input is whole is timed as the
PyTorch module itself, and a batch norm whose statistics span ranks as the split batch
norm the compiler runs (over one rank; the layer's messages priced as before). The kernel
timer is a stand-in that answers by the kind of twin it
is asked about (so the costs are known), or a real one on a scratch cache.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from disttensor_nn import BatchNorm2d, Conv2d, Layer, MaxPool2d, ReLU  # noqa: E402
from disttensor_nn.plan import CostModel, KernelTimer, load_profile  # noqa: E402
from disttensor_nn.plan.costmodel import dist_for  # noqa: E402
from disttensor_nn.torch.autoplan import needs_grad  # noqa: E402
from disttensor_nn.torch.pricing import (  # noqa: E402
    ModuleTwin,
    SplitNormTwin,
    as_run,
    channels_last_view,
    priced,
    standard_view,
)

torch.set_num_threads(1)
MODULE_TIME, LAYER_TIME = 1e-6, 1e-3
PROFILE = load_profile("v100-nvlink-edr")


class Timer:
    """Answers every query at once: the module's time for a module twin, else the layer's."""

    def __init__(self):
        self.asked = []

    def times(self, layer, local_in, dtype, flops, corun=1, synced=False):
        self.asked.append((layer, tuple(local_in)))
        t = MODULE_TIME if isinstance(layer, ModuleTwin) else LAYER_TIME
        return t, 2 * t, False, corun


def cost_model(timer, nprocs=2, runs_as=as_run):
    return CostModel(PROFILE, nprocs, timer, runs_as=runs_as)


def own(a):
    """``a`` as a DistArray of this process alone."""
    return DistArray(a, Distribution(a.shape, ProcessGrid((1,) * a.ndim, MPI.COMM_SELF),
                                     tuple(range(a.ndim))))


def test_as_run_keeps_dimensions_of_length_one_whole():
    d = Distribution((1, 4, 8, 6), (2, 1, 1), (0, None, 1, 2))
    run = as_run(d)
    assert run.axes == (None, None, 1, 2) and run.nblocks == (1, 1, 1, 1)
    assert run.grid_shape == (2, 1, 1)
    h = Distribution((1, 4, 8, 6), (1, 2, 1), (0, None, 1, 2))
    assert as_run(h) is h  # nothing of length one is split
    both = as_run(Distribution((1, 4, 8, 1), (2, 1, 2), (0, None, 1, 2)))
    assert both.axes == (None, None, 1, None)
    uneven = Distribution((1, 4, 8, 6), (2, 2, 1), (0, None, 1, 2),
                          splits=[None, None, [3], None])
    assert as_run(uneven).axes == (None, None, 1, 2)
    assert as_run(uneven).splits == uneven.splits  # the height's uneven blocks kept


@pytest.mark.parametrize("make, module, shape", [
    (lambda: Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1), (1, 4, 16, 12)),
    (lambda: BatchNorm2d(4), nn.BatchNorm2d(4), (1, 4, 16, 12)),
])
def test_a_replicated_node_is_the_module_without_messages(make, module, shape):
    timer = Timer()
    layer = priced(make(), module)
    cost = cost_model(timer).layer(layer, shape, (2, 1, 1))  # the one sample on both ranks
    assert (cost.fwd, cost.bwd) == (MODULE_TIME, 2 * MODULE_TIME)
    assert cost.comm == 0.0
    twin, local = timer.asked[-1]
    assert isinstance(twin, ModuleTwin) and local == shape  # the whole block, unpadded
    assert twin.output_shape(local) == tuple(module(torch.zeros(shape)).shape)
    # split over the height: a convolution's built-in twin and its halo's messages; a batch
    # norm's split run (the statistics' sums priced as the layer's)
    split = cost_model(timer).layer(layer, shape, (1, 2, 1))
    norm = isinstance(module, nn.BatchNorm2d)
    want = MODULE_TIME if norm else LAYER_TIME
    assert (split.fwd, split.bwd) == (want, 2 * want) and split.comm > 0
    assert isinstance(timer.asked[-1][0], SplitNormTwin) == norm
    assert isinstance(timer.asked[-1][0], ModuleTwin) == norm
    # the built-in layer as the built-in runtime runs it: one rank's block whole, the
    # other's empty, and the statistics summed over both
    plain = cost_model(timer, runs_as=None).layer(make(), shape, (2, 1, 1))
    assert (plain.fwd, plain.bwd) == (LAYER_TIME, 2 * LAYER_TIME)
    if isinstance(module, nn.BatchNorm2d):
        assert plain.comm > 0


def test_several_samples_of_a_whole_batch_norm_run_split_with_the_layers_messages():
    timer = Timer()
    shape = (4, 4, 16, 12)
    plain = cost_model(timer, runs_as=None).layer(BatchNorm2d(4), shape, (2, 1, 1))
    mine = cost_model(timer).layer(priced(BatchNorm2d(4), nn.BatchNorm2d(4)), shape,
                                   (2, 1, 1))
    twin, local = timer.asked[-1]
    assert isinstance(twin, SplitNormTwin) and local == (2, 4, 16, 12)
    assert (mine.fwd, mine.bwd) == (MODULE_TIME, 2 * MODULE_TIME)
    assert mine.comm == plain.comm > 0


@pytest.mark.parametrize("make, module, as_module", [
    (lambda: Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1), True),
    (lambda: MaxPool2d(2), nn.MaxPool2d(2), True),
    (lambda: ReLU(), nn.ReLU(), True),
    (lambda: BatchNorm2d(4, stats="group"), nn.BatchNorm2d(4), True),  # each rank's own
    (lambda: BatchNorm2d(4), nn.BatchNorm2d(4), False),  # sums over the ranks first
])
def test_split_samples_run_the_module_where_nothing_else_is_summed(make, module, as_module):
    """Blocks of whole samples run the module on each rank (its gradients' sums priced as
    the built-in layer's); a split over space keeps the built-in layer's twin, and a batch
    norm whose statistics span ranks is timed as the split batch norm, with the built-in
    layer's messages."""
    timer = Timer()
    shape = (4, 4, 16, 12)
    plain = cost_model(Timer(), runs_as=None).layer(make(), shape, (2, 1, 1))
    mine = cost_model(timer).layer(priced(make(), module), shape, (2, 1, 1))
    twin, local = timer.asked[-1]
    norm = isinstance(module, nn.BatchNorm2d)
    assert isinstance(twin, ModuleTwin) == (as_module or norm)
    assert isinstance(twin, SplitNormTwin) == (norm and not as_module)
    if as_module:
        assert local == (2, 4, 16, 12) and (mine.fwd, mine.bwd) == (MODULE_TIME,
                                                                    2 * MODULE_TIME)
        # the parameters' gradients still summed, nothing else
        assert (mine.grad, mine.comm) == (plain.grad, plain.comm)
        if isinstance(module, nn.Conv2d):
            assert mine.grad + mine.comm > 0
    else:
        assert (mine.fwd, mine.bwd, mine.comm) == (MODULE_TIME, 2 * MODULE_TIME, plain.comm)
    timer.asked.clear()
    cost_model(timer).layer(priced(make(), module), shape, (1, 2, 1))  # over the height
    assert all(isinstance(t, SplitNormTwin) == norm and isinstance(t, ModuleTwin) == norm
               for t, _ in timer.asked)


def test_one_rank_runs_the_modules():
    timer = Timer()
    cost = cost_model(timer, nprocs=1).layer(
        priced(Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1)), (4, 4, 16, 12),
        (1, 1, 1))
    assert isinstance(timer.asked[-1][0], ModuleTwin) and cost.fwd == MODULE_TIME


def test_the_gradient_sums_stay_in_the_memory_model():
    conv = Conv2d(4, 6, 3, padding=1)
    mine = priced(conv, nn.Conv2d(4, 6, 3, padding=1))
    cm = cost_model(Timer())
    assert cm.local_gradient_bytes(mine, (1, 4, 16, 12)) == \
        cm.local_gradient_bytes(conv, (1, 4, 16, 12)) != []


@pytest.mark.parametrize("module, like, input_grad", [
    (nn.Conv2d(3, 5, 3, padding=1), Conv2d(3, 5, 3, padding=1), True),
    (nn.Conv2d(3, 5, 3, padding=1), Conv2d(3, 5, 3, padding=1), False),
    (nn.ReLU(inplace=True), ReLU(), True),  # in place: a leaf that requires a gradient
    (nn.ReLU(), ReLU(), False),  # a first layer without parameters: no backward at all
    (nn.MaxPool2d(3, 2, 1, return_indices=True), MaxPool2d(3, 2, 1), True),
])
def test_the_module_twin_runs_the_module(module, like, input_grad):
    torch.manual_seed(0)
    module = module.double()
    twin = priced(like, module)
    twin.input_grad = input_grad
    spec = twin.cost_spec(Distribution((2, 3, 7, 6), (1, 1, 1), (0, None, 1, 2)), 8)
    run = spec.twin.local_twin()
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 6))
    y = run.forward(own(x))
    dy = np.random.default_rng(2).standard_normal(y.local.shape)
    dx = run.backward(own(dy))
    xt = torch.from_numpy(x.copy()).requires_grad_()
    ref = module(xt * 1)  # not the leaf itself: the module may work in place
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert run.output_shape(x.shape) == tuple(ref.shape) == y.local.shape
    np.testing.assert_allclose(y.local, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    ref.backward(torch.from_numpy(dy))
    if input_grad:
        np.testing.assert_allclose(dx.local, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    else:
        assert dx is None
    for mine, theirs in zip(run.torch_module.parameters(), module.parameters()):
        np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-12)
        assert mine is not theirs  # its own copy


@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_the_split_norm_twin_runs_the_split_batch_norm(input_grad, affine):
    """Over one rank, the twin of a batch norm whose statistics span ranks is PyTorch's
    training-mode batch norm of the block: output, input and parameter gradients; the
    module's running statistics untouched."""
    torch.manual_seed(0)
    module = nn.BatchNorm2d(3, affine=affine).double()
    if affine:
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5)
            module.bias.uniform_(-1, 1)
    layer = priced(BatchNorm2d(3), module)
    layer.input_grad = input_grad
    spec = layer.cost_spec(Distribution((2, 3, 7, 6), (1, 2, 1), (0, None, 1, 2)), 8)
    assert isinstance(spec.twin, SplitNormTwin) and spec.allreduces
    run = spec.twin.local_twin()
    assert type(run) is SplitNormTwin and run.kernel_signature().endswith("|split")
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 6)) * 2 + 3
    y = run.forward(own(x))
    dy = np.random.default_rng(2).standard_normal(y.local.shape)
    dx = run.backward(own(dy))
    xt = torch.from_numpy(x.copy()).requires_grad_()
    ref = nn.functional.batch_norm(xt, None, None, module.weight, module.bias, True)
    np.testing.assert_allclose(y.local, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    ref.backward(torch.from_numpy(dy))
    if input_grad:
        np.testing.assert_allclose(dx.local, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    else:
        assert dx is None
    for mine, theirs in zip(run.torch_module.parameters(), module.parameters()):
        np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-10)
    # no running statistics moved (the twin's own copy of the module, which it runs)
    np.testing.assert_array_equal(run.torch_module.running_mean.numpy(), np.zeros(3))
    assert int(run.torch_module.num_batches_tracked) == 0


def test_the_split_norm_twin_runs_a_bfloat16_module():
    """A bfloat16 model's batch norm (its weights 16-bit) runs split, as the compiler runs
    it: within bfloat16's rounding of the float64 reference."""
    module = nn.BatchNorm2d(3).to(torch.bfloat16)
    spec = priced(BatchNorm2d(3), module).cost_spec(
        Distribution((2, 3, 7, 6), (1, 2, 1), (0, None, 1, 2)), 2)
    run = spec.twin.local_twin()
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 6)).astype(np.float32)
    y = run.forward(own(x))
    run.backward(own(np.ones(y.local.shape, np.float32)))
    xd = torch.from_numpy(x).to(torch.bfloat16).double()
    ref = nn.functional.batch_norm(xd, None, None, training=True)
    np.testing.assert_allclose(np.asarray(y.local, np.float64), ref.numpy(), atol=3e-2)
    assert run.torch_module.weight.grad is not None


def test_the_kernel_timer_times_a_padded_module(tmp_path):
    """The timer sizes its buffers from the twin's output shape: a padded convolution that
    widens the channels, alone and in a chain, is timed whole."""
    layer = priced(Conv2d(4, 16, 3, padding=1), nn.Conv2d(4, 16, 3, padding=1))
    spec = layer.cost_spec(Distribution((1, 4, 16, 12), (1, 1, 1), (0, None, 1, 2)))
    timer = KernelTimer("test", cache_dir=str(tmp_path), reps=2)
    timer.measure_chain([(spec.twin, (1, 4, 16, 12), np.dtype(np.float32), 1.0)],
                        MPI.COMM_SELF, reps=2)
    fwd, bwd, estimated, _ = timer.times(spec.twin, (1, 4, 16, 12), np.float32, 1.0)
    assert fwd > 0 and bwd > 0 and not estimated
    assert any(k.startswith("torch.nn.Conv2d:") for k in timer.table)


def test_moves_between_layers_are_priced_on_the_candidates():
    """``runs_as`` prices layers only: a move into replicas waits for every rank."""
    shape = (1, 8, 32, 32)
    whole, height = dist_for(shape, (2, 1, 1)), dist_for(shape, (1, 2, 1))
    mine, plain = cost_model(Timer()), cost_model(Timer(), runs_as=None)
    for a, b in ((whole, height), (height, whole)):
        assert mine.redistribution(a, b) == plain.redistribution(a, b) > 0


def test_a_priced_layer_is_timed_under_the_built_in_key():
    for layer, module in ((ReLU(), nn.ReLU()), (MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, 1)),
                          (Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1))):
        assert priced(layer, module).kernel_signature() == layer.kernel_signature()


def test_a_bfloat16_module_runs_on_16_bit_blocks():
    """The planner times a bfloat16 model's activations as 16-bit blocks of its own kind."""
    module = nn.Conv2d(3, 4, 3, padding=1).to(torch.bfloat16)
    spec = priced(Conv2d(3, 4, 3, padding=1), module).cost_spec(
        Distribution((1, 3, 8, 8), (1, 1, 1), (0, None, 1, 2)), 2)
    run = spec.twin.local_twin()
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float16)
    y = run.forward(own(x))
    dx = run.backward(own(np.ones(y.local.shape, np.float16)))
    assert y.local.dtype == dx.local.dtype == np.float16 and y.local.shape == (1, 4, 8, 8)
    assert np.isfinite(dx.local).all()


def test_no_input_gradient_before_the_first_parameter():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = nn.MaxPool2d(2)
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.bn(self.conv(self.pool(x * 2))) * self.scale + x.mean()

    gm = torch.fx.symbolic_trace(Net())
    grads = {n.name: g for n, g in needs_grad(gm).items()}
    assert grads["x"] is grads["mul"] is grads["pool"] is grads["mean"] is False
    assert grads["conv"] is grads["bn"] is grads["scale"] is grads["mul_1"] is True


def test_a_layer_may_leave_its_passes_unchecked():
    class Checked(Layer):
        def forward(self, x):
            return x

        def backward(self, dy):
            return dy

    class Unchecked(Layer, checked=False):
        def forward(self, x):
            return x

        def backward(self, dy):
            return dy

    with pytest.raises(RuntimeError):
        Checked().backward(own(np.zeros(2)))  # before any forward
    assert Unchecked().backward("anything") == "anything"


def test_a_channels_last_twin_runs_the_module_on_channels_last_memory():
    """The twin reads a C-contiguous block as channels-last memory (no copy), the module
    sees a channels-last tensor, and its output and input gradient come back as the module's
    on that tensor, read as C-contiguous blocks; the timer keeps its times apart."""
    module = nn.Conv2d(3, 5, 3, padding=1).double()
    plain = ModuleTwin(module, Conv2d(3, 5, 3, padding=1))
    twin = ModuleTwin(module, Conv2d(3, 5, 3, padding=1), channels_last=True).local_twin()
    assert twin.channels_last and twin.kernel_signature() != plain.kernel_signature()
    seen = []
    twin.torch_module.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((2, 3, 6, 7)), rng.standard_normal((2, 5, 6, 7))
    twin.input_grad = True
    y = twin.forward(own(x))
    dx = twin.backward(own(dy))
    assert seen == [True]
    assert y.local.flags.c_contiguous and dx.local.flags.c_contiguous
    # the reference: the module on x's memory read as channels-last, by hand
    xt = torch.from_numpy(x.copy()).view(2, 6, 7, 3).permute(0, 3, 1, 2).requires_grad_()
    ref = copy.deepcopy(module)
    yt = ref(xt)
    yt.backward(torch.from_numpy(dy.copy()).view(2, 6, 7, 5).permute(0, 3, 1, 2))
    np.testing.assert_allclose(y.local.reshape(-1), yt.detach().permute(0, 2, 3, 1)
                               .reshape(-1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(dx.local.reshape(-1), xt.grad.permute(0, 2, 3, 1)
                               .reshape(-1).numpy(), rtol=1e-12)
    back = standard_view(channels_last_view(torch.from_numpy(x)))
    assert back.data_ptr() == torch.from_numpy(x).data_ptr() and back.is_contiguous()
