"""Independent serial references for the disttensor_nn tests, and the layouts they run on.

Nothing here imports ``disttensor_nn``: convolutions are built from
``scipy.signal.correlate`` / ``convolve`` on the globally padded array
(``numpy.pad``), their adjoints from the transposed operations plus a
scatter-add of padding cells into their sources; pooling is a loop over
output positions; batch normalisation is the textbook formula.
"""

from __future__ import annotations

import importlib.util
import itertools
from functools import cache

import numpy as np
import pytest
import scipy.signal as ss
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert

comm = MPI.COMM_WORLD

# the kernel backends a layer test runs in: NumPy's always, PyTorch's where it is installed
# (select them with -k torch)
HAS_TORCH = importlib.util.find_spec("torch") is not None
KERNELS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    not HAS_TORCH, reason='the torch kernels need PyTorch (pip install "disttensor[torch]")'))]


# --------------------------------------------------------------------------- checking
class Checks:
    """Local comparisons, recorded, then one collective assertion in :meth:`finish`.

    Collectives dominate the run time on an oversubscribed machine, so the
    tests compare each rank's block of a DistArray with the same block of the
    global reference (no gather), and every rank's replicated parameters with
    the reference, and agree on the outcome once: every rank raises the same
    AssertionError (naming the failing ranks) or none does.
    """

    def __init__(self) -> None:
        self.errors: list[str] = []

    def close(self, actual, desired, what: str = "", rtol: float = 1e-12,
              atol: float = 1e-12) -> None:
        desired = np.asarray(desired)
        if isinstance(actual, dt.DistArray):
            if actual.shape != desired.shape:
                self.errors.append(f"{what}: shape {actual.shape} != {desired.shape}")
                return
            desired = desired[actual.dist.local_slices()]
            actual = actual.local
        try:
            np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=what)
        except AssertionError as exc:
            self.errors.append(str(exc))

    def equal(self, actual, desired, what: str = "") -> None:
        self.close(actual, desired, what, rtol=0, atol=0)

    def true(self, ok: bool, what: str = "") -> None:
        if not ok:
            self.errors.append(what)

    def finish(self) -> None:
        collective_assert(not self.errors, "\n".join(self.errors[:4])
                          + (f"\n... {len(self.errors) - 4} more" if len(self.errors) > 4 else ""))


def gdots(pairs) -> np.ndarray:
    """Global inner products <a, b> of DistArrays a with global arrays b, in one allreduce."""
    local = np.array([np.vdot(a.local, np.asarray(b)[a.dist.local_slices()]) / a.dist.nreplicas
                      for a, b in pairs], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
    return local

# PyTorch padding_mode -> numpy.pad mode
NP_MODE = {"zeros": "constant", "reflect": "reflect", "circular": "wrap", "replicate": "edge"}


# --------------------------------------------------------------------------- layouts
@cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    """One ProcessGrid per shape over COMM_WORLD (cached: sub-communicators are kept)."""
    return dt.ProcessGrid(shape)


def grid2_shape(p: int) -> tuple[int, int]:
    """A 2-axis grid of p ranks that splits both axes where p allows."""
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


def grid3_shape(p: int) -> tuple[int, int, int]:
    return {1: (1, 1, 1), 2: (1, 1, 2), 3: (1, 3, 1), 4: (2, 1, 2)}[p]


def empty_cuts(n: int, p: int) -> list[int]:
    """Cuts of p blocks over n: the first block empty, later ones uneven (maybe empty)."""
    return [] if p == 1 else [0] + [min(n, 2)] * (p - 2)


def tiny_cuts(n: int, p: int) -> list[int]:
    """Cuts with 1-element blocks at both ends (and an empty one for p = 4)."""
    return {1: [], 2: [1], 3: [1, n - 1], 4: [1, 1, n - 1]}[p]


def layouts(shape: tuple[int, ...]) -> list[tuple[str, dt.Distribution]]:
    """(name, Distribution) of an (N, C, *S) array for this world size.

    Sample-only, each spatial dim alone, all spatial dims together, replicas
    (a grid axis that splits nothing), one dim split over two grid axes, sample
    x first spatial dim, explicit splits with empty blocks and 1-element blocks.
    """
    p = comm.Get_size()
    nd = len(shape) - 2
    names = {1: ["L"], 2: ["H", "W"], 3: ["D", "H", "W"]}[nd]
    none = [None] * len(shape)

    def axes(**where: int) -> list:
        a = list(none)
        for dim, ax in where.items():
            a[int(dim[1:])] = ax
        return a

    g1 = grid((p,))
    out = [("sample", dt.Distribution(shape, g1, axes(d0=0)))]
    for i, nm in enumerate(names):
        if nd == 3 and nm == "H":
            continue  # H is covered by the explicit split below
        out.append((nm, dt.Distribution(shape, g1, axes(**{f"d{2 + i}": 0}))))
    if nd == 2:
        out.append(("HxW", dt.Distribution(shape, grid(grid2_shape(p)), axes(d2=0, d3=1))))
    if nd == 3:
        out.append(("DxHxW", dt.Distribution(shape, grid(grid3_shape(p)),
                                             axes(d2=0, d3=1, d4=2))))
    if p > 1:  # a grid axis that splits nothing: its ranks hold replicas
        g2 = grid(grid2_shape(p) if p != 3 else (3, 1))
        rep_axis = 1 if g2.shape[1] > 1 else 0
        out.append((f"{names[-1]} + replicas",
                    dt.Distribution(shape, g2, axes(**{f"d{len(shape) - 1}": 1 - rep_axis}))))
        # one dimension split over both axes of a 2-D grid, in reversed order
        out.append((f"{names[0]} over two grid axes",
                    dt.Distribution(shape, grid(grid2_shape(p)), axes(d2=(1, 0)))))
    first = names[0]
    out.append((f"sample x {first}",
                dt.Distribution(shape, grid(grid2_shape(p)), axes(d0=0, d2=1))))
    # explicit splits: an empty first block along the first spatial dim ...
    sp = 2 if nd < 3 else 3
    splits = [None] * len(shape)
    splits[sp] = empty_cuts(shape[sp], p)
    out.append((f"{names[sp - 2]} empty blocks",
                dt.Distribution(shape, g1, axes(**{f"d{sp}": 0}), splits)))
    # ... and 1-element blocks along the last one
    splits = [None] * len(shape)
    splits[-1] = tiny_cuts(shape[-1], p)
    out.append((f"{names[-1]} tiny blocks",
                dt.Distribution(shape, g1, axes(**{f"d{len(shape) - 1}": 0}), splits)))
    return out


def dist_like(dist: dt.Distribution, shape: tuple[int, ...]) -> dt.Distribution:
    """Same grid and axes as ``dist`` (default blocks) for another shape."""
    return dt.Distribution(shape, dist.grid, dist.axes)


# --------------------------------------------------------------------------- argument parsing
def as_tuple(v, nd: int) -> tuple[int, ...]:
    return (v,) * nd if isinstance(v, int) else tuple(v)


def pad_pairs(padding, kernel, dilation, nd: int) -> list[tuple[int, int]]:
    """PyTorch-style padding -> (before, after) per spatial dim ('same': extra after)."""
    kernel, dilation = as_tuple(kernel, nd), as_tuple(dilation, nd)
    if padding == "valid":
        return [(0, 0)] * nd
    if padding == "same":
        tot = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return [(t // 2, t - t // 2) for t in tot]
    if isinstance(padding, int):
        return [(padding, padding)] * nd
    return [(p, p) if isinstance(p, int) else tuple(p) for p in padding]


def out_len(n: int, lo: int, hi: int, k: int, s: int, d: int) -> int:
    span = d * (k - 1) + 1
    return 0 if n + lo + hi < span else (n + lo + hi - span) // s + 1


# --------------------------------------------------------------------------- padding adjoint
def fold_padding(a: np.ndarray, shape, pads, np_mode: str) -> np.ndarray:
    """Adjoint of ``numpy.pad`` on the spatial dims: add every padding cell into its source."""
    for i, (n, (lo, hi)) in enumerate(zip(shape[2:], pads)):
        ax = 2 + i
        if np_mode == "constant":
            src = np.pad(np.arange(n), (lo, hi), mode="constant", constant_values=-1)
        else:
            src = np.pad(np.arange(n), (lo, hi), mode=np_mode)
        moved = np.moveaxis(a, ax, 0)
        out = np.zeros((n,) + moved.shape[1:])
        keep = src >= 0
        np.add.at(out, src[keep], moved[keep])
        a = np.moveaxis(out, 0, ax)
    return a


# --------------------------------------------------------------------------- convolution
def _dilate(w: np.ndarray, dilation) -> np.ndarray:
    k = w.shape[2:]
    span = tuple(d * (kk - 1) + 1 for kk, d in zip(k, dilation))
    wd = np.zeros(w.shape[:2] + span)
    wd[(..., *(slice(None, None, d) for d in dilation))] = w
    return wd


def conv_ref(x, w, b, stride, pads, dilation, groups=1, mode="zeros"):
    """Cross-correlation of the padded global input, one scipy call per (n, f, c)."""
    nd = x.ndim - 2
    stride, dilation = as_tuple(stride, nd), as_tuple(dilation, nd)
    xp = np.pad(x, [(0, 0), (0, 0), *pads], mode=NP_MODE[mode])
    wd = _dilate(w, dilation)
    n_, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    out = tuple(out_len(n, lo, hi, k, s, d) for n, (lo, hi), k, s, d in
                zip(x.shape[2:], pads, w.shape[2:], stride, dilation))
    y = np.zeros((n_, f) + out)
    if 0 in out:
        return y
    sub = tuple(slice(None, None, s) for s in stride)
    for n, ff in itertools.product(range(n_), range(f)):
        g = ff // fg
        acc = sum(ss.correlate(xp[n, g * cg + ci], wd[ff, ci], mode="valid", method="direct")
                  for ci in range(cg))
        y[n, ff] = acc[sub]
    if b is not None:
        y += b.reshape((1, f) + (1,) * nd)
    return y


def conv_ref_backward(x, w, dy, stride, pads, dilation, groups=1, mode="zeros"):
    """(dx, dw, db) of :func:`conv_ref` by transposed convolution and correlation."""
    nd = x.ndim - 2
    stride, dilation = as_tuple(stride, nd), as_tuple(dilation, nd)
    xp = np.pad(x, [(0, 0), (0, 0), *pads], mode=NP_MODE[mode])
    wd = _dilate(w, dilation)
    span = wd.shape[2:]
    n_, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    db = dy.sum(axis=(0, *range(2, 2 + nd)))
    if dy.size == 0:
        return np.zeros(x.shape), np.zeros(w.shape), db
    # dy spread out by the stride: u[s*o] = dy[o]
    u = np.zeros(dy.shape[:2] + tuple(s * (o - 1) + 1 for s, o in zip(stride, dy.shape[2:])))
    u[(..., *(slice(None, None, s) for s in stride))] = dy
    dxp = np.zeros(xp.shape)
    dwd = np.zeros(wd.shape)
    for n, ff in itertools.product(range(n_), range(f)):
        g = ff // fg
        for ci in range(cg):
            full = ss.convolve(u[n, ff], wd[ff, ci], mode="full", method="direct")
            dxp[(n, g * cg + ci, *(slice(0, m) for m in full.shape))] += full
            corr = ss.correlate(xp[n, g * cg + ci], u[n, ff], mode="valid", method="direct")
            dwd[ff, ci] += corr[tuple(slice(0, m) for m in span)]
    dw = dwd[(..., *(slice(None, None, d) for d in dilation))]
    dx = fold_padding(dxp, x.shape, pads, NP_MODE[mode])
    return dx, dw, db


# --------------------------------------------------------------------------- pooling
def pool_ref(x, kernel, stride, pads, dilation, op):
    """Max (-inf padding, first maximum) or average (zero padding counted) pooling.

    Returns ``(y, dx_of)``: the output and a function mapping an output
    gradient to the input gradient (a scatter over each window).
    """
    nd = x.ndim - 2
    kernel, stride = as_tuple(kernel, nd), as_tuple(stride, nd)
    dilation = as_tuple(dilation, nd)
    fill = -np.inf if op == "max" else 0.0
    xp = np.pad(x, [(0, 0), (0, 0), *pads], mode="constant", constant_values=fill)
    out = tuple(out_len(n, lo, hi, k, s, d) for n, (lo, hi), k, s, d in
                zip(x.shape[2:], pads, kernel, stride, dilation))
    y = np.zeros(x.shape[:2] + out)
    where = {}
    n_, c = x.shape[:2]
    for o in np.ndindex(*out):
        sl = tuple(slice(s * j, s * j + d * (k - 1) + 1, d)
                   for j, s, d, k in zip(o, stride, dilation, kernel))
        win = xp[(slice(None), slice(None), *sl)].reshape(n_, c, -1)
        if op == "max":
            arg = win.argmax(axis=-1)
            y[(slice(None), slice(None), *o)] = np.take_along_axis(win, arg[..., None], -1)[..., 0]
            where[o] = (sl, arg)
        else:
            y[(slice(None), slice(None), *o)] = win.sum(axis=-1) / np.prod(kernel)
            where[o] = (sl, None)

    def dx_of(dy):
        dxp = np.zeros(xp.shape)
        for o, (sl, arg) in where.items():
            view = dxp[(slice(None), slice(None), *sl)]  # a view: writes land in dxp
            g = dy[(slice(None), slice(None), *o)]
            if op == "max":
                for n, ci in np.ndindex(n_, c):
                    view[(n, ci, *np.unravel_index(arg[n, ci], kernel))] += g[n, ci]
            else:
                view += (g / np.prod(kernel)).reshape((n_, c) + (1,) * nd)
        crop = tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, x.shape[2:]))
        return dxp[(slice(None), slice(None), *crop)]

    return y, dx_of


# --------------------------------------------------------------------------- batch norm
def bn_ref(x, gamma, beta, eps):
    """Training-mode batch norm over (N, *S) per channel; returns y and a backward function."""
    axes = (0, *range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes)
    var = x.var(axis=axes)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean.reshape(shape)) * inv.reshape(shape)
    y = xhat * gamma.reshape(shape) + beta.reshape(shape)

    def backward(dy):
        dbeta = dy.sum(axis=axes)
        dgamma = (dy * xhat).sum(axis=axes)
        m = dy.size / dy.shape[1]
        dx = (gamma * inv).reshape(shape) * (
            dy - dbeta.reshape(shape) / m - xhat * dgamma.reshape(shape) / m)
        return dx, dgamma, dbeta

    count = x.size // x.shape[1]
    return y, backward, mean, var * count / max(count - 1, 1)
