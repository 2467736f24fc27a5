"""Tutorial: a spatially split 3x3 convolution in PyTorch, from the autograd primitives.

Run it on any number of ranks::

    mpiexec -n 4 python -m mpi4py docs/tutorials/torch_custom_layer.py

Each rank holds a block of the images (split by height and width over a 2-D
grid of ranks). The layer exchanges a one-cell halo (``halo_exchange``, as
``numpy.pad`` with ``mode='reflect'``), runs ``torch.nn.functional.conv2d``
on the extended block, and uses its weight through ``broadcast``, so that
the weight's gradient is summed over the ranks. A few steps of
``torch.optim.SGD`` train it; every rank's weights are checked against the
same model trained in one process on the whole images (``torch.nn.Conv2d``
with ``padding_mode='reflect'``). The script ends with
``torch custom layer tutorial: OK on P ranks``.
"""

import numpy as np
import torch
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert
from disttensor_nn.torch import all_reduce, broadcast, gather, halo_exchange, scatter

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)
torch.set_num_threads(1)  # one thread per rank


class SplitConv2d(torch.nn.Module):
    """A 3x3 convolution (stride 1, same size) of (N, C, H, W) blocks split over H and W."""

    def __init__(self, in_channels: int, out_channels: int, grid: dt.ProcessGrid):
        super().__init__()
        self.grid = grid
        self.weight = torch.nn.Parameter(0.3 * torch.randn(out_channels, in_channels, 3, 3))
        self.bias = torch.nn.Parameter(torch.zeros(out_channels))

    def forward(self, block: torch.Tensor, dist: dt.Distribution) -> torch.Tensor:
        # The weight is the same on every rank, but each rank applies it to its own block:
        # broadcast's backward sums the ranks' parts of its gradient.
        weight = broadcast(self.weight, self.grid)
        bias = broadcast(self.bias, self.grid)
        ext = halo_exchange(block, dist, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect")
        return torch.nn.functional.conv2d(ext, weight, bias)  # one output per input cell


def mse(out: torch.Tensor, target: torch.Tensor, size: int, grid: dt.ProcessGrid) -> torch.Tensor:
    """The mean squared error over the whole images, the same value on every rank."""
    return all_reduce(((out - target) ** 2).sum(), grid) / size


# ----------------------------------------------------------------- data and layout
grid = dt.ProcessGrid.create(2)
shape = (4, 2, 13, 10)  # (N, C, H, W): uneven blocks on most grids
dist = dt.Distribution(shape, grid, (None, None, 0, 1))
out_dist = dist.replace(global_shape=(4, 3, 13, 10))

torch.manual_seed(0)  # the same images, target and initial weights on every rank
images = torch.randn(shape, dtype=torch.float64)
target = torch.randn((4, 3, 13, 10), dtype=torch.float64)
layer = SplitConv2d(2, 3, grid).double()
x, y = scatter(images, dist), scatter(target, out_dist)  # this rank's blocks

# the serial reference: the same convolution on the whole images, in one process
serial = torch.nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect").double()
with torch.no_grad():
    serial.weight.copy_(layer.weight)
    serial.bias.copy_(layer.bias)

# ----------------------------------------------------------------- training
optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
losses = []
for step in range(5):
    optimizer.zero_grad()
    loss = mse(layer(x, dist), y, target.numel(), grid)
    loss.backward()  # on every rank: the loss is one value every rank holds
    optimizer.step()
    losses.append(loss.item())
    say(f"step {step}: loss {loss.item():.6f}")

# ----------------------------------------------------------------- checks
serial_optimizer = torch.optim.SGD(serial.parameters(), lr=0.1)
serial_losses = []
for _ in range(5):
    serial_optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(serial(images), target)
    loss.backward()
    serial_optimizer.step()
    serial_losses.append(loss.item())

collective_assert(np.allclose(losses, serial_losses, rtol=1e-12), f"{losses} {serial_losses}")
collective_assert(torch.allclose(layer.weight, serial.weight, rtol=1e-12, atol=1e-14)
                  and torch.allclose(layer.bias, serial.bias, rtol=1e-12, atol=1e-14),
                  "weights differ from the serial model's")
with torch.no_grad():
    whole = gather(layer(x, dist), out_dist)  # the output, on every rank
    collective_assert(torch.allclose(whole, serial(images), rtol=1e-12, atol=1e-12))
say(f"torch custom layer tutorial: OK on {comm.size} ranks")
