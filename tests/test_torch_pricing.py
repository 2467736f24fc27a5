"""How the planner prices a traced node as ``parallelize`` runs it (``pricing``).

A dimension of length one is never split by the compiler (its grid axis holds replicas),
so a candidate that splits it is priced without the messages the built-in layer would send
there; a node whose input no candidate splits is timed as the PyTorch module itself. The
kernel timer here is a stand-in that answers by kernel signature, so the costs are known.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from disttensor_nn import BatchNorm2d, Conv2d  # noqa: E402
from disttensor_nn.plan import CostModel, load_profile  # noqa: E402
from disttensor_nn.torch.pricing import ModuleTwin, as_run, priced  # noqa: E402

torch.set_num_threads(1)
MODULE_TIME, LAYER_TIME = 1e-6, 1e-3


class Timer:
    """Answers every query at once: the module's time for a module twin, else the layer's."""

    def __init__(self):
        self.asked = []

    def times(self, layer, local_in, dtype, flops, corun=1, synced=False):
        self.asked.append((layer, tuple(local_in)))
        t = MODULE_TIME if isinstance(layer, ModuleTwin) else LAYER_TIME
        return t, 2 * t, False, corun


def model(timer):
    return CostModel(load_profile("v100-nvlink-edr"), 2, timer)


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


@pytest.mark.parametrize("make, module, shape", [
    (lambda: Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1), (1, 4, 16, 12)),
    (lambda: BatchNorm2d(4), nn.BatchNorm2d(4), (1, 4, 16, 12)),
])
def test_a_replicated_node_is_the_module_without_messages(make, module, shape):
    timer = Timer()
    layer = priced(make(), module)
    cost = model(timer).layer(layer, shape, (2, 1, 1))  # the one sample over both ranks
    assert (cost.fwd, cost.bwd) == (MODULE_TIME, 2 * MODULE_TIME)
    assert cost.comm == 0.0
    twin, local = timer.asked[-1]
    assert isinstance(twin, ModuleTwin) and local == shape  # the whole block, unpadded
    # split over the height: the built-in layer's twin and its messages (a halo, or the
    # statistics' sums and the gradients')
    split = model(timer).layer(layer, shape, (1, 2, 1))
    assert (split.fwd, split.bwd) == (LAYER_TIME, 2 * LAYER_TIME) and split.comm > 0
    assert not isinstance(timer.asked[-1][0], ModuleTwin)


def test_the_built_in_layer_alone_sums_over_the_empty_block():
    """The difference the pricing makes: unpriced, one sample 'split' over two ranks pays
    the batch norm's sums over a rank that holds nothing."""
    timer = Timer()
    plain = model(timer).layer(BatchNorm2d(4), (1, 4, 16, 12), (2, 1, 1))
    assert plain.comm > 0 and (plain.fwd, plain.bwd) == (LAYER_TIME, 2 * LAYER_TIME)


def test_several_samples_are_priced_as_before():
    timer = Timer()
    plain = model(timer).layer(BatchNorm2d(4), (4, 4, 16, 12), (2, 1, 1))
    mine = model(timer).layer(priced(BatchNorm2d(4), nn.BatchNorm2d(4)), (4, 4, 16, 12),
                              (2, 1, 1))
    assert (mine.fwd, mine.bwd, mine.comm) == (plain.fwd, plain.bwd, plain.comm)


@pytest.mark.parametrize("input_grad", [True, False])
def test_the_module_twin_runs_the_module(input_grad):
    torch.manual_seed(0)
    module = nn.Conv2d(3, 5, 3, padding=1, dtype=torch.float64)
    twin = ModuleTwin(module, Conv2d(3, 5, 3, padding=1, dtype=np.float64)).local_twin()
    twin.input_grad = input_grad
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 6))
    dy = np.random.default_rng(2).standard_normal((2, 5, 7, 6))
    y = twin.forward(own(x))
    dx = twin.backward(own(dy))
    xt = torch.from_numpy(x.copy()).requires_grad_()
    ref = module(xt)
    ref.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y.local, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    if input_grad:
        np.testing.assert_allclose(dx.local, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    else:
        assert dx is None
    # the twin's parameters are its own
    np.testing.assert_allclose(twin.torch_module.weight.grad.numpy(),
                               module.weight.grad.numpy(), rtol=1e-12)
    assert twin.torch_module.weight is not module.weight
    assert twin.output_shape((2, 3, 7, 6)) == (2, 5, 7, 6)
