"""A plain PyTorch U-Net trained domain-parallel: ``mpiexec -n 2 python examples/torch_unet.py``.

One 512 x 512 image per step, its layout per layer chosen by the planner.
"""

import torch
from mpi4py import MPI
from torch import nn

import disttensor as dt
from disttensor_nn.torch import gather, parallelize


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):  # written for one process; nothing in it knows about ranks
    def __init__(self):
        super().__init__()
        self.down, self.pool, self.bottom = block(1, 16), nn.MaxPool2d(2), block(16, 16)
        self.up, self.out = nn.ConvTranspose2d(16, 16, 2, stride=2), nn.Conv2d(32, 1, 1)

    def forward(self, x):
        skip = self.down(x)
        return self.out(torch.cat([self.up(self.bottom(self.pool(skip))), skip], dim=1))


torch.manual_seed(0)  # the same weights and data on every rank
pm = parallelize(UNet(), (1, 1, 512, 512), layout="auto", machine="v100-nvlink-edr")
optimizer = torch.optim.Adam(pm.parameters(), lr=1e-2)
losses = []
for _ in range(20):
    image = torch.rand(1, 1, 512, 512)
    x = dt.DistArray.from_global(image, pm.input_dist, xp=torch)  # this rank's block
    y = pm(x)
    loss = ((gather(y.local, y.dist) - (image > 0.5).float()) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
if MPI.COMM_WORLD.rank == 0:
    print(pm.plan.table(), f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} in 20 steps")
