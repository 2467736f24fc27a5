"""Tutorial: train the mesh-tangling model with a spatial split, and read the planner's table.

Run it on any number of ranks::

    mpiexec -n 4 python -m mpi4py docs/tutorials/train_mesh.py

Rank 0 first prints the plan the planner picks for the full-size model (18 x
2048 x 2048 inputs, a mini-batch of 4) on 16 V100 GPUs: planning is
arithmetic on metadata, so it needs neither the GPUs nor 16 ranks. Then the
job trains a small version of the model with every layer's height split over
all its ranks, printing that plan's table and a summary. It ends with
``training tutorial: OK on P ranks``.
"""

import math
import os
import tempfile

from mpi4py import MPI

from disttensor import limit_blas_threads
from disttensor_nn.plan import make_plan
from disttensor_nn.training import TrainConfig, build_model, train

comm = MPI.COMM_WORLD
P = comm.size
say = print if comm.rank == 0 else (lambda *a, **k: None)
limit_blas_threads()               # one BLAS thread per core share: ranks must not compete

# -- 1. The planner on the full-size model: 6 stages of 3 x (conv, ReLU, BN), a 1x1 head
#       to 4096 channels, DepthToSpace(64), sigmoid. Every distribution is a grid
#       (N, H, W) whose product is the rank count; costs come from the machine profile.
model, batch_shape = build_model("mesh", size=(2048, 2048), batch=4)
plan, _ = make_plan(model, batch_shape, nprocs=16, machine="v100-nvlink-edr")
say(f"planner's choice for mesh {batch_shape} on 16 ranks:")
say(plan.table())

cfg = TrainConfig(
    model="mesh-demo",             # 3 stages of 2 x (conv, ReLU, BN), a 1x1 head
    size=(64, 64),                 # a small input, so that the tutorial runs in seconds
    batch=4,
    steps=5,
    machine="v100-nvlink-edr",     # a built-in machine profile: no calibration needed
    progress=False,                # no tqdm bar
    metrics=None,                  # no metrics files
)

# -- 2. A spatial split: every layer's height over all P ranks, grid (N, H, W) =
#       (1, P, 1). The planner prices any assignment; write this one as a plan file.
model, batch_shape = build_model(cfg.model, cfg.size, cfg.batch)
_, planner = make_plan(model, batch_shape, P, cfg.machine)
spatial = planner.uniform_plan((1, P, 1))
path = None
if comm.rank == 0:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="plan-")
    with os.fdopen(fd, "w") as f:
        f.write(spatial.to_json())
cfg.layout = comm.bcast(path, root=0)

# -- 3. Train with it: the loader generates each rank's block of every batch in the
#       first layer's layout, and train() prints the table of the plan it runs.
say("\ntraining with the spatial split:")
summary = train(cfg)

if comm.rank == 0:
    os.remove(cfg.layout)
grids = {tuple(layer["grid"]) for layer in summary["layers"]}
assert grids == {(1, P, 1)}, grids
assert all(math.isfinite(v) for v in summary["history"]), summary["history"]
say(f"training tutorial: OK on {P} ranks")
