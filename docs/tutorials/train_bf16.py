"""Training with bfloat16 activations: float32 weights, 16-bit blocks, halos and messages.

Run: mpiexec -n 4 python -m mpi4py docs/tutorials/train_bf16.py
"""

import numpy as np
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn

grid = dt.ProcessGrid((1, MPI.COMM_WORLD.Get_size()))  # (N, H): the height split over ranks
layout = nn.Layout(grid, (0, None, 1, None))
x = dt.random.default_rng(0).standard_normal(
    (2, 3, 64, 64), np.float32, dist=layout.distribution((2, 3, 64, 64)))
# per-pixel labels: which of the first two channels is larger
target = dt.DistArray(np.argmax(x.local[:, :2], axis=1)[:, None],
                      layout.distribution((2, 1, 64, 64)))


def train(precision: str, steps: int = 6) -> list[float]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, seed=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 2, 3, padding=1, seed=2))
    nn.set_precision(model, precision)           # float32 weights either way
    inputs = x.astype(nn.precision.precision_dtype(precision))
    loss_fn = nn.CrossEntropyLoss()               # computes in float64
    opt = nn.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        y = model(inputs)                         # bfloat16 under "bf16"
        losses.append(loss_fn(y, target))
        model.call_backward(loss_fn.backward())   # float32 weight gradients
        opt.step()
    assert y.dtype == inputs.dtype and model[0].weight.grad.dtype == np.float32
    return losses


fp32, bf16 = train("fp32"), train("bf16")
if grid.rank == 0:
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        print(f"step {step}: loss fp32 {a:.4f}, bf16 {b:.4f}")
assert bf16[-1] < bf16[0] and max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 0.02
if grid.rank == 0:
    print(f"bf16 training tutorial: OK on {MPI.COMM_WORLD.Get_size()} ranks")
