"""Tutorial: an unchanged PyTorch U-Net on images split by height and width.

Run it on any number of ranks::

    mpiexec -n 4 python -m mpi4py docs/tutorials/torch_parallelize.py

The model is plain PyTorch (convolutions, batch norm, max pooling, a
transposed convolution, ``torch.cat`` skips), written for one process.
``parallelize`` traces it and runs it on this rank's block of the image;
``torch.optim.Adam`` trains it for a few steps, one sample per step (the
samples too large for one device that spatial parallelism is for). Every
step's loss and the weights after the last one are checked against the same
model trained in one process on the whole images. The script ends with
``torch parallelize tutorial: OK on P ranks``.
"""

import copy

import torch
from mpi4py import MPI
from torch import nn

import disttensor as dt
from disttensor.testing import collective_assert
from disttensor_nn.torch import gather, parallelize

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)
torch.set_num_threads(1)  # one thread per rank


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """One level down and up, with a skip connection: a model written for one process."""

    def __init__(self):
        super().__init__()
        self.down = block(1, 8)
        self.pool = nn.MaxPool2d(2)
        self.bottom = block(8, 8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.out = nn.Sequential(block(16, 8), nn.Conv2d(8, 1, 1))

    def forward(self, x):
        skip = self.down(x)
        y = self.up(self.bottom(self.pool(skip)))
        return self.out(torch.cat([y, skip], dim=1))


# ----------------------------------------------------------------- the parallel model
torch.manual_seed(0)  # the same weights, images and targets on every rank
model = UNet().double()
serial = copy.deepcopy(model)  # the reference, trained in one process below
shape = (1, 1, 24, 20)  # (N, C, H, W): one sample per step
grid = tuple(MPI.Compute_dims(comm.size, 2))
pm = parallelize(model, shape, layout=(1, 1, *grid))  # H and W split over the ranks
say(f"input blocks: {pm.input_dist}")

images = torch.randn((4, *shape[1:]), dtype=torch.float64)  # four samples
targets = torch.randn((4, *shape[1:]), dtype=torch.float64)
# this rank's block of each sample (from a file, each rank would read its block instead)
blocks = [dt.DistArray.from_global(images[i:i + 1], pm.input_dist, xp=torch)
          for i in range(len(images))]

# ----------------------------------------------------------------- training
optimizer = torch.optim.Adam(pm.parameters(), lr=0.01)  # on the parallel model's parameters
losses = []
for step, x in enumerate(blocks):
    optimizer.zero_grad()
    y = pm(x)  # a DistArray of torch tensors
    loss = ((gather(y.local, y.dist) - targets[step:step + 1]) ** 2).mean()  # on every rank
    loss.backward()  # every parameter's gradient: one process's on the whole batch
    optimizer.step()
    losses.append(loss.item())
    say(f"step {step}: loss {loss.item():.6f}")

# ----------------------------------------------------------------- checks
serial_optimizer = torch.optim.Adam(serial.parameters(), lr=0.01)
serial_losses = []
for step in range(len(images)):
    serial_optimizer.zero_grad()
    loss = ((serial(images[step:step + 1]) - targets[step:step + 1]) ** 2).mean()
    loss.backward()
    serial_optimizer.step()
    serial_losses.append(loss.item())

collective_assert(all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, serial_losses)),
                  f"{losses} {serial_losses}")
same = all(torch.allclose(a, b, rtol=1e-10, atol=1e-12)
           for a, b in zip(pm.state_dict().values(), serial.state_dict().values()))
collective_assert(same, "weights or batch statistics differ from the serial model's")
say(f"torch parallelize tutorial: OK on {comm.size} ranks")
