"""Tutorial: least squares on a distributed data matrix, written as plain NumPy code.

Run it on any number of ranks::

    mpiexec -n 4 python -m mpi4py docs/tutorials/array_programming.py

It prints, on rank 0, the layout of every intermediate result and the fitted
weights, checks everything against NumPy on the gathered data, and ends with
the line ``array programming tutorial: OK on P ranks``.
"""

import numpy as np
from mpi4py import MPI

import disttensor as dt
from disttensor.ops import implicit_redistribution
from disttensor.testing import assert_allclose, collective_assert

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)

# -- 1. Data: a (1000, 8) matrix in blocks of rows and columns over a 2-D grid.
grid = dt.ProcessGrid.create(2)                    # (2, 2) on 4 ranks, (3, 1) on 3
rng = dt.random.default_rng(seed=7)
X = rng.normal(5.0, 2.0, (1000, 8), grid=grid)     # same global values on any grid
noise = rng.normal(0.0, 0.1, (1000,), grid=grid, axes=((0, 1),))
say("X      ", X)                                  # the repr is metadata: same on every rank

# -- 2. Standardise the columns: reductions send partial sums along grid axis 0 only.
mu, sd = X.mean(axis=0), X.std(axis=0)
Z = (X - mu) / sd
say("mu     ", mu)
say("Z      ", Z)

# -- 3. Targets from known weights; `Z @ w` with a NumPy vector is a distributed product.
w_true = np.linspace(-1.0, 1.0, 8)
y = Z @ w_true + noise
say("y      ", y)

# -- 4. Normal equations: Z.T @ Z and Z.T @ y by SUMMA, then an 8 x 8 solve on every rank.
G = Z.T @ Z
b = Z.T @ y
w = np.linalg.solve(G.to_global(), b.to_global())  # small: gather it everywhere
say("G      ", G)
say("w      ", np.round(w, 4))

# -- 5. Residuals, their RMS and the largest ones (a boolean mask selects them).
r = y - Z @ w
rms = float(np.sqrt(np.mean(r**2)))               # a 0-d DistArray, turned into a float
big = r[np.abs(r) > 2.5 * rms]
say(f"rms    {rms:.5f}; {big.shape[0]} residuals beyond 2.5 rms")

# -- 6. Explicit data movement: forbid implicit moves, redistribute by hand.
slabs = Z.dist.with_axes(((0, 1), None))           # rows over all ranks, whole columns
with implicit_redistribution(False):
    try:
        Z + Z.redistribute(slabs)                   # operands laid out differently
    except ValueError as exc:
        say("refused:", type(exc).__name__, "-", str(exc).split("; ")[1].split(" (")[0])
    Zs = Z.redistribute(slabs)                      # one MPI_Alltoallw
    row_norms = np.sqrt(np.sum(Zs * Zs, axis=1))    # now purely local work
say("norms  ", row_norms)

# -- 7. Check against NumPy on the gathered arrays (collective assertions).
Xg, ng = X.to_global(), noise.to_global()
Zg = (Xg - Xg.mean(axis=0)) / Xg.std(axis=0)
yg = Zg @ w_true + ng
wg, *_ = np.linalg.lstsq(Zg, yg, rcond=None)
assert_allclose(Z, Zg, rtol=1e-12, atol=1e-12)
assert_allclose(y, yg, rtol=1e-12, atol=1e-12)
assert_allclose(w, wg, rtol=1e-9, atol=1e-12)
assert_allclose(row_norms, np.linalg.norm(Zg, axis=1), rtol=1e-12)
collective_assert(np.allclose(w, w_true, atol=0.02), f"weights {w} far from {w_true}")
say(f"array programming tutorial: OK on {comm.size} ranks")
