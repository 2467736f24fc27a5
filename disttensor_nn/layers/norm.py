"""Distributed batch normalisation with global or per-sample-group statistics."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution

from ..costspec import Allreduce, CostSpec, largest_block
from ..module import Layer, Parameter, allreduce_, check_input, check_int, split_axes_comm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "BatchNormNd"]


class BatchNormNd(Layer):
    """Batch normalisation over (N, C, *S) DistArrays split over N and space.

    Per-channel sums and sums of squares are computed locally (in float64)
    and summed with one allreduce over the ranks that share the statistics:

    * ``stats="global"``: all ranks that split N or space, i.e. the statistics
      of the whole mini-batch, exactly as on one process;
    * ``stats="group"``: only the ranks that split space, i.e. each group of
      ranks that holds whole samples normalises over its own samples.
      Running statistics are then averaged over the groups so that every rank
      keeps the same ones.

    Backward allreduces the two per-channel sums the input gradient needs over
    the same ranks; the scale and shift gradients are summed over all ranks.

    The channels may be split too: each rank computes the statistics of its
    channel slice, and the sums travel in one allreduce of all ``2 C`` of
    them over the ranks above and those that split C, so that the
    parameters, their gradients and the running statistics stay whole and
    identical on every rank (``2 C`` float64 values, the same message as
    without the channel split).

    All arithmetic uses the input's array module (NumPy or CuPy); the running
    statistics (float64 buffers ``running_mean`` and ``running_var``, in the
    :meth:`~disttensor_nn.Layer.state_dict`) move to it on first use.

    Parameters
    ----------
    num_features : int
        Number of channels C.
    eps, momentum, affine, track_running_stats
        As ``torch.nn.BatchNorm2d``.
    stats : {'global', 'group'}
    dtype : dtype
        Parameter dtype; inputs must match it.
    """

    saved_for_backward = ("_saved",)

    nd = 0

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 stats: str = "global", dtype: Any = np.float32):
        if stats not in ("global", "group"):
            raise ValueError(f"stats must be 'global' or 'group', got {stats!r}")
        num_features = check_int(num_features, "num_features")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.stats, self.dtype = stats, np.dtype(dtype)
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(np.ones(num_features, self.dtype)) if affine else None
        self.bias = Parameter(np.zeros(num_features, self.dtype)) if affine else None
        self.register_buffer("running_mean", np.zeros(num_features, np.float64))
        self.register_buffer("running_var", np.ones(num_features, np.float64))

    def forward(self, x: DistArray) -> DistArray:
        check_input(x, self.nd + 2, type(self).__name__, self.num_features, self.dtype,
                    split_channels=True)
        self._check_batch(x)
        axes = (0, *range(2, x.ndim))
        chans = x.dist.local_slices()[1]
        xl = x.local
        xp = x.xp
        n, c = xl.shape[:2]
        x3 = xl.reshape(n, c, math.prod(xl.shape[2:]))
        y = xp.empty(xl.shape, dtype=xl.dtype)
        y3 = y.reshape(x3.shape)
        batch_stats = self.training or not self.track_running_stats
        if batch_stats:
            spatial = tuple(range(2, x.ndim))
            comm = split_axes_comm(x.dist, (1, *(axes if self.stats == "global" else spatial)))
            count = np.prod([x.shape[d] for d in axes]) if self.stats == "global" else (
                x.local_shape[0] * np.prod(x.shape[2:]))
            # sums about this rank's own mean (the centre), so that no sum cancels: with
            # d = x - centre, sum(x) = m * centre + sum(d) and sum(x^2) = sum(d^2) +
            # 2 centre sum(d) + m centre^2 (m values here), rows pairwise in the input's
            # dtype, the rest in float64; y holds d, then becomes the output
            m = n * x3.shape[2]
            centre = (x3.sum(axis=2).sum(axis=0, dtype=np.float64) / max(m, 1)).astype(xl.dtype)
            xp.subtract(x3, centre[:, None], out=y3)
            sum_d = y3.sum(axis=2).sum(axis=0, dtype=np.float64)
            sum_d2 = xp.zeros(c, dtype=np.float64)
            tmp = xp.empty(x3.shape[1:], dtype=xl.dtype)
            for i in range(n):  # one sample at a time: the scratch stays in cache
                xp.multiply(y3[i], y3[i], out=tmp)
                sum_d2 += tmp.sum(axis=1)
            c64 = centre.astype(np.float64)
            sums = self._whole(xp, x.dist, m * c64 + sum_d,
                               sum_d2 + 2 * c64 * sum_d + m * c64**2)
            sums = allreduce_(sums, comm)
            mean = sums[:self.num_features] / max(count, 1)
            var = xp.maximum(sums[self.num_features:] / max(count, 1) - mean**2, 0.0)
            if self.training and self.track_running_stats:
                self._update_running(x, mean, var, count)
            mean, var = mean[chans], var[chans]
        else:
            self._follow(xp)
            mean, var, count = self.running_mean[chans], self.running_var[chans], None
            centre = mean.astype(xl.dtype)
            xp.subtract(x3, centre[:, None], out=y3)
        inv = 1.0 / xp.sqrt(var + self.eps)
        # y = (x - centre) * scale + shift, scale = gamma * inv, shift = beta + (centre -
        # mean) * scale: the large parts cancel before rounding, as in (x - mean) * scale
        scale = self.weight.data[chans].astype(np.float64) * inv if self.affine else inv
        shift = (centre.astype(np.float64) - mean) * scale
        if self.affine:
            shift = shift + self.bias.data[chans]
        xp.multiply(y3, scale.astype(xl.dtype)[:, None], out=y3)
        xp.add(y3, shift.astype(xl.dtype)[:, None], out=y3)
        self._saved = (x.dist, xl, mean, inv, count, batch_stats, centre)
        return DistArray(y, x.dist)

    def _whole(self, xp: Any, dist: Distribution, *parts: Any) -> Any:
        """Per-channel ``parts`` of this rank's channel slice placed into whole-C zeros, joined."""
        chans = dist.local_slices()[1]
        if chans.stop - chans.start == self.num_features:
            return xp.concatenate(parts)
        out = xp.zeros(len(parts) * self.num_features, dtype=parts[0].dtype)
        for i, part in enumerate(parts):
            out[i * self.num_features + chans.start:i * self.num_features + chans.stop] = part
        return out

    def _check_batch(self, x: DistArray) -> None:
        """Refuse batch statistics over one value per channel, as PyTorch does (all ranks alike).

        With ``stats="group"`` the smallest non-empty sample group counts: its
        variance would be zero and its output all zeros.
        """
        if not (self.training or not self.track_running_stats):
            return
        per_sample = math.prod(x.shape[2:])
        if self.stats == "global":
            count = x.shape[0] * per_sample
        else:
            b = x.dist.boundaries[0]
            count = min((hi - lo for lo, hi in zip(b, b[1:]) if hi > lo), default=0) * per_sample
        if count == 1:
            raise ValueError(f"{type(self).__name__}: expected more than 1 value per channel "
                             f"when training, got input size {x.shape}"
                             + (" (one sample per group with stats='group')"
                                if self.stats == "group" else ""))

    def _follow(self, xp: ModuleType) -> None:
        """Move the running statistics to the array module ``xp`` (no copy if already there)."""
        self.running_mean = xp.asarray(self.running_mean)
        self.running_var = xp.asarray(self.running_var)

    def _update_running(self, x: DistArray, mean: Any, var: Any, count: int) -> None:
        xp = x.xp
        self._follow(xp)
        unbiased = var * count / max(count - 1, 1)
        stats = xp.concatenate([mean, unbiased])
        if self.stats == "group":  # average the groups' estimates so all ranks agree
            # (a group whose sample block is empty has no estimate and is left out)
            comm = split_axes_comm(x.dist, (0,))
            has = float(count > 0)
            buf = allreduce_(xp.concatenate([stats * has, xp.full(1, has)]), comm)
            stats = buf[:-1] / xp.maximum(buf[-1], 1.0)
        m = self.momentum
        self.running_mean = (1 - m) * self.running_mean + m * stats[:self.num_features]
        self.running_var = (1 - m) * self.running_var + m * stats[self.num_features:]

    def backward(self, dy: DistArray) -> DistArray:
        dist, xl, mean, inv, count, batch_stats, centre = self._saved
        axes = (0, *range(2, dy.ndim))
        chans = dist.local_slices()[1]
        g = dy.local
        xp = dy.xp
        n, c = xl.shape[:2]
        x3 = xl.reshape(n, c, math.prod(xl.shape[2:]))
        g3 = g.reshape(x3.shape)
        cc = centre.astype(g.dtype)[:, None]
        dx = xp.empty(xl.shape, dtype=g.dtype)
        dx3 = dx.reshape(x3.shape)
        xp.subtract(x3, cc, out=dx3)  # dx is the scratch of g * (x - centre)
        xp.multiply(dx3, g3, out=dx3)
        # sum(g * xhat) = inv * (sum(g * (x - centre)) + (centre - mean) * sum(g)); rows
        # in the input's dtype, the rest in float64
        sum_g = g3.sum(axis=2).sum(axis=0, dtype=np.float64)
        sum_gd = dx3.sum(axis=2).sum(axis=0, dtype=np.float64)
        sums = self._whole(xp, dist, sum_g,
                           inv * (sum_gd + (centre.astype(np.float64) - mean) * sum_g))
        if self.stats == "group":
            sums = allreduce_(sums, split_axes_comm(dist, (1, *range(2, dy.ndim))))
            param_sums = allreduce_(sums.copy(), split_axes_comm(dist, (0,)))
        else:
            sums = allreduce_(sums, split_axes_comm(dist, (1, *axes)))
            param_sums = sums
        C = self.num_features
        if self.affine:
            self.bias.grad += param_sums[:C].astype(self.dtype)
            self.weight.grad += param_sums[C:].astype(self.dtype)
        sums = xp.concatenate([sums[:C][chans], sums[C:][chans]])
        gamma = self.weight.data[chans].astype(np.float64) if self.affine else xp.ones(c)
        scale = gamma * inv
        if batch_stats:  # the statistics depend on the input
            # dx = scale * (g - dmean - xhat * dvar) = scale * g + b * (x - centre) + shift
            m = max(count, 1)  # 0 on a rank with no samples in stats="group"
            dmean, dvar = sums[:c] / m, sums[c:] / m
            b = -scale * inv * dvar
            shift = scale * (inv * dvar * (mean - centre.astype(np.float64)) - dmean)
            bx, bs = b.astype(g.dtype)[:, None], shift.astype(g.dtype)[:, None]
            tmp = xp.empty(x3.shape[1:], dtype=g.dtype)
            sc = scale.astype(g.dtype)[:, None]
            for i in range(n):  # one sample at a time: the scratch stays in cache
                xp.multiply(g3[i], sc, out=dx3[i])
                xp.subtract(x3[i], cc, out=tmp)
                xp.multiply(tmp, bx, out=tmp)
                xp.add(dx3[i], tmp, out=dx3[i])
                xp.add(dx3[i], bs, out=dx3[i])
        else:
            xp.multiply(g3, scale.astype(g.dtype)[:, None], out=dx3)
        return DistArray(dx, dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """Eight FLOPs per element; the input is kept for backward (not the normalised input).

        Two allreduces of ``2 C`` float64 sums (statistics forward, the
        input gradient's sums backward) over the ranks that share the
        statistics: those splitting N and space (``stats="global"``) or space
        only (``"group"``), and those splitting C.
        """
        block = largest_block(dist)
        n = math.prod(block)
        spatial = tuple(range(2, dist.ndim))
        chans = (1,) if dist.nblocks[1] > 1 else ()
        sums = Allreduce(2 * self.num_features * 8,
                         (0, *chans, *spatial) if self.stats == "global" else (*chans, *spatial))
        return CostSpec(block, flops=8.0 * n, nbytes=4 * n * itemsize, allreduces=(sums, sums),
                        keeps_input=True, workspace=n // max(block[0], 1) * itemsize)

    def kernel_signature(self) -> str:
        return f"bn:{self.num_features}:{self.stats}"

    def local_twin(self) -> BatchNormNd:
        return type(self)(self.num_features, self.eps, self.momentum, self.affine,
                          self.track_running_stats, stats=self.stats, dtype=self.dtype)


class BatchNorm1d(BatchNormNd):
    """Batch normalisation of (N, C, L); see :class:`BatchNormNd`."""

    nd = 1


class BatchNorm2d(BatchNormNd):
    """Batch normalisation of (N, C, H, W); see :class:`BatchNormNd`."""

    nd = 2


class BatchNorm3d(BatchNormNd):
    """Batch normalisation of (N, C, D, H, W); see :class:`BatchNormNd`."""

    nd = 3
