"""Tutorial: your own distributed layers, from halo exchange, its adjoint and redistribution.

Run it on any number of ranks::

    mpiexec -n 4 python -m mpi4py docs/tutorials/stencil_layer.py

Part 1 writes a 2-D median filter (forward only) with one halo exchange.
Part 2 writes a 3-D stencil layer with a backward pass: the halo adjoint
sends the gradient of every halo cell back to its owner, and a
redistribution plan moves the input into the layout the layer computes in
(and, through its adjoint, the gradient back). Both are checked against a
serial reference; the script ends with ``stencil layer tutorial: OK on P ranks``.
"""

import numpy as np
from mpi4py import MPI
from numpy.lib.stride_tricks import sliding_window_view

import disttensor as dt
from disttensor.testing import assert_allclose, collective_assert
from disttensor_nn import Conv3d, Layer, Layout, ReLU, Sequential

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)


# ----------------------------------------------------------------- part 1: median filter
def median_filter(x: dt.DistArray, size: int = 3, mode: str = "reflect") -> dt.DistArray:
    """``size``-wide median filter of an N-D DistArray; ``mode`` as in ``numpy.pad``."""
    r = size // 2
    ext = x.exchange_halo(r, mode=mode)        # this block plus r cells on every side
    windows = sliding_window_view(ext, (size,) * x.ndim)
    med = np.median(windows, axis=tuple(range(-x.ndim, 0)))
    return dt.DistArray.from_local(med, x.dist)  # one output per input cell: same layout


grid = dt.ProcessGrid.create(2)
g0 = grid.shape[0]
# Rows in uneven blocks, the first only 1 row high: narrower than the halo of a 7 x 7 filter.
rows = [] if g0 == 1 else [1, *(1 + c for c in dt.block_boundaries(59, g0 - 1)[1:-1])]
image_dist = dt.Distribution((60, 45), grid, splits=[rows, None])
image = dt.random.default_rng(1).random(image_dist)
filtered = median_filter(image, size=7)

g = image.to_global()                          # serial reference: numpy.pad, then windows
ref = np.median(sliding_window_view(np.pad(g, 3, mode="reflect"), (7, 7)), axis=(-2, -1))
assert_allclose(filtered, ref, rtol=0, atol=0)
say(f"median filter on {image_dist}: equals the serial filter")


# ----------------------------------------------------------------- part 2: a stencil layer
class Laplace3d(Layer):
    """``y = x + alpha * laplacian(x)`` on (N, C, D, H, W), zero outside the volume.

    The 7-point Laplacian reads one cell on each side in D, H and W, so the
    halo is one cell wide there (and zero for N and C). The layer computes in
    ``compute_layout`` (None: wherever the input is).
    """

    WIDTHS = ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1))
    CENTRE = (slice(None), slice(None), slice(1, -1), slice(1, -1), slice(1, -1))

    def __init__(self, alpha: float, compute_layout: Layout | None = None):
        self.alpha, self.compute_layout = alpha, compute_layout

    @classmethod
    def _neighbours(cls):
        """The six shifted views of the extended block, as index tuples."""
        for d in (2, 3, 4):
            for lo, hi in ((0, -2), (2, None)):
                idx = list(cls.CENTRE)
                idx[d] = slice(lo, hi)
                yield tuple(idx)

    def forward(self, x: dt.DistArray) -> dt.DistArray:
        self._move = None
        if self.compute_layout is not None and Layout.of(x.dist) != self.compute_layout:
            target = self.compute_layout.distribution(x.shape)
            self._move = dt.redistribution_plan(x.dist, target)   # cached by the pair
            x = self._move(x)                                      # one MPI_Alltoallw
        self._dist = x.dist
        ext = x.exchange_halo(self.WIDTHS)                         # zeros beyond the edges
        centre = ext[self.CENTRE]
        lap = sum(ext[n] for n in self._neighbours()) - 6 * centre
        return dt.DistArray.from_local(centre + self.alpha * lap, x.dist)

    def backward(self, dy: dt.DistArray) -> dt.DistArray:
        # The transpose of the local stencil, applied to dy, lands on the extended block ...
        g = dy.local
        dext = np.zeros(tuple(n + 2 * (d > 1) for d, n in enumerate(g.shape)), g.dtype)
        dext[self.CENTRE] += (1 - 6 * self.alpha) * g
        for n in self._neighbours():
            dext[n] += self.alpha * g
        # ... and the halo adjoint adds every halo cell into the cell it was copied from.
        dx = dt.halo_accumulate(dext, self._dist, self.WIDTHS)
        return dx if self._move is None else self._move.adjoint(dx)  # back to the input layout


N, C, SPACE = 2, 3, (6, 7, 5)
line = dt.ProcessGrid((comm.size,))                    # a 1-D grid for the sample split
samples = dt.Distribution((N, C, *SPACE), line, axes=(0, None, None, None, None))
spatial = Layout(grid, (None, None, 0, 1, None))        # D and H over the 2-D grid
layer = Laplace3d(0.1, compute_layout=spatial)

rng = dt.random.default_rng(2)
x = rng.standard_normal(samples)                       # on 4 ranks, two sample blocks are empty
y = layer.forward(x)
say(f"Laplace3d: input {x.dist.axes} on {x.dist.grid_shape} -> output {y.dist.axes} "
    f"on {y.dist.grid_shape}")

# Forward against the serial stencil.
gx = x.to_global()
p = np.pad(gx, Laplace3d.WIDTHS)
c = p[Laplace3d.CENTRE]
ref = c + 0.1 * (sum(p[n] for n in Laplace3d._neighbours()) - 6 * c)
assert_allclose(y, ref, rtol=1e-12, atol=1e-12)

# Backward is the adjoint of forward: <L x, v> == <x, L* v> for any x and v.
v = rng.standard_normal(y.dist)
lhs = float(np.vdot(y, v))
rhs = float(np.vdot(x, layer.backward(v)))
collective_assert(abs(lhs - rhs) <= 1e-12 * abs(lhs), f"<Lx, v> = {lhs}, <x, L*v> = {rhs}")
say(f"adjoint test: <L x, v> = {lhs:.12f} = <x, L* v> = {rhs:.12f}")

# The layer in a network, against the same network on one process.
def network(compute_layout):
    return Sequential(Conv3d(C, 4, 3, padding=1, dtype=np.float64, seed=5),
                      Laplace3d(0.1, compute_layout), ReLU())


model = network(spatial)
out = model.forward(x)
dx = model.backward(dt.random.default_rng(3).standard_normal(out.dist))

self_grid = dt.ProcessGrid((1,), MPI.COMM_SELF)         # every rank alone: the reference
whole = dt.Distribution(x.shape, self_grid)
ref_model = network(None)
ref_out = ref_model.forward(dt.DistArray.from_global(gx, whole))
ref_dy = dt.random.default_rng(3).standard_normal(ref_out.dist)  # the same global values
ref_dx = ref_model.backward(ref_dy)
assert_allclose(out, ref_out.local, rtol=1e-10, atol=1e-12)
assert_allclose(dx, ref_dx.local, rtol=1e-10, atol=1e-12)
assert_allclose(model[0].weight.grad, ref_model[0].weight.grad, rtol=1e-10, atol=1e-12)
say("Conv3d -> Laplace3d -> ReLU: output, input gradient and weight gradient equal 1 process")
say(f"stencil layer tutorial: OK on {comm.size} ranks")
