"""Distributed batch normalisation with global or per-sample-group statistics."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import (
    array_namespace,
    as_module,
    astype,
    concat,
    device_kw,
    device_of,
    empty,
    is_channels_last,
    is_numpy,
    namespace_dtype,
    numpy_dtype,
    writes_in_place,
)

from ..checks import check_input, check_input_layout
from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for, torch_kernels
from ..module import (
    Layer,
    Parameter,
    allreduce_,
    check_int,
    derived,
    reduce_gradients_,
    split_axes_comm,
)
from ..precision import io_dtype, is_half, to_dtype

__all__ = ["BATCH_NORM_STATS", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "BatchNormNd",
           "set_batch_norm_stats"]

BATCH_NORM_STATS = ("global", "group")
"""What a batch norm's statistics in training may span: the whole batch, or each group of
ranks that holds the same samples (:class:`BatchNormNd`'s ``stats``)."""


def _scratch(xp: ModuleType, shape: tuple[int, ...], dtype: Any) -> Any | None:
    """A buffer for :func:`_into` where the module writes in place (else None)."""
    return empty(xp, shape, dtype) if writes_in_place(xp) else None


def _into(xp: ModuleType, op: str, a: Any, b: Any, out: Any | None) -> Any:
    """``xp.<op>(a, b)``, written into ``out`` where the module writes in place."""
    if out is not None and writes_in_place(xp):
        return getattr(xp, op)(a, b, out=out)
    return getattr(xp, op)(a, b)


NATIVE_BATCH_NORM_MAX = 2**18
"""Elements of a block up to which the torch kernels normalise a block whose statistics
are its own by ATen's training-mode kernel in one call (Welford's statistics) on one
thread; a larger one takes the centred passes there, faster on one thread (a 2-core
AVX-512 machine: ATen's one call 0.12 ms against 0.16 at 64 Ki elements, 2.8 ms against
2.1 at 1.5 Mi, before the per-channel arithmetic the centred passes add, some 0.1 ms).
With more than one PyTorch thread every size takes the one call, which spreads over them
(forward and backward of ``(8, 64, 56, 56)`` on 2 threads: 1.95 ms against 3.28), and so
does a channels-last block (ATen's channels-last kernel, vectorised over the channels:
forward of ``(8, 64, 56, 56)`` on one thread 1.39 ms against 3.58 for the centred passes
on it and 2.65 on a C-order block). Its statistics are PyTorch's own in that layout: the
rows added one after another in float32, relative errors of 5e-6 to 4e-5 in the mean and
inverse deviation on ResNet's and the mesh model's blocks against 5e-8 in C order (the
statistics shared by several ranks are summed in float64 in either layout)."""

_NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""Blocks the one-call path takes (its running statistics are updated in the block's dtype:
not in 16 bits)."""

PART_BYTES = 32 * 2**20
"""Bytes of float32 a 16-bit batch norm converts at once (whole channels; at least one)."""


def _channel_parts(a3: Any) -> list[slice]:
    """Slices of the channels of ``(N, C, M)`` whose float32 copies hold ``PART_BYTES``."""
    n, c, m = a3.shape
    step = max(1, PART_BYTES // max(4 * n * m, 1))
    return [slice(c0, min(c, c0 + step)) for c0 in range(0, max(c, 1), step)]


def _channel_sums(xp: ModuleType, a3: Any, f64: Any) -> Any:
    """Per-channel sums of ``(N, C, M)``: rows in ``a3``'s dtype, then float64 over N."""
    return xp.sum(xp.sum(a3, axis=2), axis=0, dtype=f64)


CHUNK_BYTES = 2**19
"""Bytes of one piece of a NumPy block that the batch norm's element-wise passes take at
once: the piece and its temporary stay in the core's cache between the passes, and the
temporary is that small (a whole-sample temporary was a fresh mapping of the sample's
size in every pass, page faults included)."""


def _pieces(shape3: tuple[int, int, int], itemsize: int) -> list[tuple[int, slice, slice]]:
    """``(sample, channels, positions)`` pieces of an ``(N, C, M)`` block of at most
    :data:`CHUNK_BYTES` each (whole channels where one channel is smaller), in order."""
    n, c, m = shape3
    per = max(1, CHUNK_BYTES // itemsize)
    if m >= per:
        inner = [(slice(k, k + 1), slice(m0, min(m, m0 + per)))
                 for k in range(c) for m0 in range(0, m, per)]
    else:
        step = max(1, per // max(m, 1))
        inner = [(slice(c0, min(c, c0 + step)), slice(None)) for c0 in range(0, c, step)]
    return [(i, cs, ms) for i in range(n) for cs, ms in inner]


def _piece_scratch(shape3: tuple[int, int, int], dtype: Any) -> np.ndarray:
    """A temporary that holds the largest piece of :func:`_pieces` of ``shape3``."""
    dtype = np.dtype(dtype)
    return np.empty(min(shape3[1] * shape3[2], max(1, CHUNK_BYTES // dtype.itemsize)), dtype)


def _moments(xp: ModuleType, x3: Any, y3: Any | None, f64: Any) -> tuple[Any, Any, Any, Any]:
    """``(centre, sum(d), sum(d**2), d)`` per channel of ``(N, C, M)``, ``d = x - centre``
    written into ``y3`` where the module writes in place (``centre``: the mean in the
    input's dtype; the sums in float64: each piece's rows in the input's dtype).

    On NumPy, ``d``, its sums and those of its squares are made piece by piece
    (:func:`_pieces`), each piece read once while in cache."""
    n, c, m = x3.shape
    centre = astype(_channel_sums(xp, x3, f64) / max(n * m, 1), x3.dtype)
    if y3 is not None and is_numpy(xp):
        sum_d, sum_d2 = np.zeros(c, np.float64), np.zeros(c, np.float64)
        tmp = _piece_scratch(x3.shape, x3.dtype)
        cc = centre[:, None]
        for i, cs, ms in _pieces(x3.shape, x3.itemsize):
            d = y3[i, cs, ms]
            np.subtract(x3[i, cs, ms], cc[cs], out=d)
            t = tmp[:d.size].reshape(d.shape)
            np.multiply(d, d, out=t)
            sum_d[cs] += d.sum(axis=1)
            sum_d2[cs] += t.sum(axis=1)
        return centre, sum_d, sum_d2, y3
    y3 = _into(xp, "subtract", x3, centre[:, None], y3)
    sum_d = _channel_sums(xp, y3, f64)
    if writes_in_place(xp):
        sum_d2 = xp.zeros(c, dtype=f64)
        tmp = xp.empty(x3.shape[1:], dtype=x3.dtype)
        for i in range(n):  # one sample at a time
            xp.multiply(y3[i], y3[i], out=tmp)
            sum_d2 += tmp.sum(axis=1)
    else:
        sum_d2 = _channel_sums(xp, y3 * y3, f64)
    return centre, sum_d, sum_d2, y3


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

    All arithmetic uses the input's array module (NumPy or CuPy), or with
    ``kernel_backend="torch"`` PyTorch's: a sum for the centre, the deviations
    from it, ATen's fused batch-norm reduction over them and its
    evaluation-mode kernel as the per-channel affine map forward (two passes
    over the block and two reductions), or, for a block of up to
    :data:`NATIVE_BATCH_NORM_MAX` elements (any size where PyTorch runs more
    than one thread) whose statistics no other rank shares, ATen's
    training-mode kernel in one call (as PyTorch in one process); backward,
    ATen's batch-norm backward in one call where no other rank shares the
    statistics, else its fused reduction and the centred input gradient; the
    running statistics (float64 buffers ``running_mean`` and ``running_var``,
    in the :meth:`~disttensor_nn.Layer.state_dict`) move to it on first use.

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
    kernel_backends = ("numpy", "torch")
    reads_grad_only = True
    shared_statistics = False
    """A twin's: time the backward that sums over other ranks (the layer itself takes it
    whenever other ranks share the statistics, whatever this says)."""

    nd = 0

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 stats: str = "global", dtype: Any = np.float32):
        if stats not in BATCH_NORM_STATS:
            raise ValueError(f"stats must be 'global' or 'group', got {stats!r}")
        num_features = check_int(num_features, "num_features")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.stats, self.dtype = stats, np.dtype(dtype)
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(np.ones(num_features, self.dtype)) if affine else None
        self.bias = Parameter(np.zeros(num_features, self.dtype)) if affine else None
        self.register_buffer("running_mean", np.zeros(num_features, np.float64))
        self.register_buffer("running_var", np.ones(num_features, np.float64))

    def takes_channels_last(self, dist: Distribution) -> bool:
        """With the torch kernels (ATen's batch-norm kernels run on channels-last blocks)."""
        return self.kernel_backend == "torch"

    def compute_dtype(self, dtype: Any, backend: str | None = None,
                      device: str = "cpu") -> np.dtype:
        """16-bit blocks are computed in the parameters' dtype (converted); others as they are."""
        return self.dtype if is_half(dtype) else numpy_dtype(dtype)

    @derived
    def _native(self, dist: Distribution, dtype: np.dtype) -> bool:
        """Whether a block distributed as ``dist`` with elements of ``dtype`` may run ATen's
        one-call batch-norm kernels (:meth:`_native_forward`): the torch kernels, batch
        statistics of this rank's block alone (no other rank shares them), in a dtype ATen
        runs natively and the parameters'."""
        return self.kernel_backend == "torch" and dtype == self.dtype and \
            self.dtype in _NATIVE_DTYPES and (self.training or not self.track_running_stats) \
            and self.stats == "global" and not self.shared_statistics and \
            self._stats_comm(dist).Get_size() == 1

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray):
            check_input(x, self.nd + 2, type(self).__name__)  # raises its TypeError
        dtype = x.dtype
        self._check_layout(x.dist, dtype)
        kept = x.local
        if 0 < kept.size and self._native(x.dist, dtype) and (
                kept.size <= NATIVE_BATCH_NORM_MAX or is_channels_last(kept) or
                torch_kernels.num_threads() > 1):
            return self._native_forward(x, kept)
        axes = (0, *range(2, x.ndim))
        chans = x.dist.local_slices()[1]
        # 16-bit activations: normalised in the parameters' dtype, one slice of channels
        # at a time converted (so that one slice, not the block, is in float32 at once);
        # the 16-bit input is what backward keeps
        kept = x.local
        xp = x.xp
        f64 = namespace_dtype(xp, np.float64)
        n, c = kept.shape[:2]
        kept3 = xp.reshape(kept, (n, c, math.prod(kept.shape[2:])))
        converted = numpy_dtype(kept.dtype) != self.dtype
        parts = _channel_parts(kept3) if converted else [slice(None)]
        x3 = kept3 if not converted else None
        fused = self.kernel_backend == "torch"  # the torch kernels' fused passes
        kernels = kernels_for(kept, "torch") if fused else None
        y3 = None if fused or converted else _scratch(xp, kept3.shape, kept.dtype)
        batch_stats = self.training or not self.track_running_stats
        if batch_stats:
            comm = self._stats_comm(x.dist)
            count = math.prod([x.shape[d] for d in axes]) if self.stats == "global" else (
                x.local_shape[0] * math.prod(x.shape[2:]))
            # sums about this rank's own mean (the centre), so that no sum cancels: with
            # d = x - centre, sum(x) = m * centre + sum(d) and sum(x^2) = sum(d^2) +
            # 2 centre sum(d) + m centre^2 (m values here), rows pairwise in the input's
            # dtype, the rest in float64; y holds d, then becomes the output
            m = n * kept3.shape[2]
            moments = []
            for cs in parts:
                p3 = x3 if not converted else to_dtype(kept3[:, cs], self.dtype)
                if fused:  # the deviations d from the centre, a block of their own
                    *moms, d = kernels.channel_moments(p3)
                    moments.append(moms)
                    y3 = None if converted else d
                else:  # a converted slice is this layer's own: d is written over it
                    *moms, d = _moments(xp, p3, p3 if converted else y3, f64)
                    moments.append(moms)
                    y3 = None if converted else d
            centre, sum_d, sum_d2 = (moments[0][i] if len(moments) == 1 else
                                     concat([mo[i] for mo in moments]) for i in range(3))
            c64 = astype(centre, np.float64)
            sums = allreduce_(self._whole(xp, x.dist, m * c64 + sum_d,
                                          sum_d2 + 2 * c64 * sum_d + m * c64**2), comm)
            mean = sums[:self.num_features] / max(count, 1)
            var = xp.maximum(sums[self.num_features:] / max(count, 1) - mean**2, 0.0)
            if self.training and self.track_running_stats:
                self._update_running(x, mean, var, count)
            mean, var = mean[chans], var[chans]
        else:
            self._follow(kept)
            mean, var, count = self.running_mean[chans], self.running_var[chans], None
            centre = astype(mean, self.dtype)
            if not fused and not converted:
                y3 = _into(xp, "subtract", x3, centre[:, None], y3)
        inv = 1.0 / xp.sqrt(var + self.eps)
        # y = (x - centre) * scale + shift, scale = gamma * inv, shift = beta + (centre -
        # mean) * scale: the large parts cancel before rounding, as in (x - mean) * scale
        scale = astype(self.weight.data[chans], np.float64) * inv if self.affine else inv
        shift = (astype(centre, np.float64) - mean) * scale
        if self.affine:
            shift = shift + astype(self.bias.data[chans], np.float64)
        if converted:  # each slice converted again, normalised, rounded into the output
            y = empty(xp, kept.shape, kept.dtype, device_of(kept))
            out3 = xp.reshape(y, kept3.shape)
            for cs in parts:
                p3 = to_dtype(kept3[:, cs], self.dtype)
                if fused:
                    p3 = kernels.scale_shift(p3, centre[cs], scale[cs], shift[cs])
                else:
                    p3 = _into(xp, "subtract", p3, centre[cs][:, None], p3)
                    p3 = _into(xp, "multiply", p3, astype(scale[cs], p3.dtype)[:, None], p3)
                    p3 = _into(xp, "add", p3, astype(shift[cs], p3.dtype)[:, None], p3)
                out3[:, cs] = to_dtype(p3, kept.dtype)
        else:
            if fused:  # with batch statistics y3 holds the deviations (freed after this)
                y3 = kernels.affine(y3, scale, shift) if batch_stats else \
                    kernels.scale_shift(x3, centre, scale, shift)
            else:
                sc, sh = astype(scale, kept.dtype)[:, None], astype(shift, kept.dtype)[:, None]
                if is_numpy(xp):  # both passes over each piece while it is in cache
                    for i, cs, ms in _pieces(y3.shape, y3.itemsize):
                        p = y3[i, cs, ms]
                        np.multiply(p, sc[cs], out=p)
                        np.add(p, sh[cs], out=p)
                else:
                    y3 = _into(xp, "multiply", y3, sc, y3)
                    y3 = _into(xp, "add", y3, sh, y3)
            y = xp.reshape(y3, kept.shape)
        self._saved = (x.dist, kept, mean, inv, count, batch_stats, centre)
        return DistArray(y, x.dist)

    def _native_forward(self, x: DistArray, kept: Any) -> DistArray:
        """Forward on a block whose statistics are its own (:meth:`_native`): ATen's
        training-mode kernel in one call (as PyTorch in one process), its running
        statistics updated by the same call."""
        running = (self.running_mean, self.running_var) if self.track_running_stats \
            else None
        if running is not None:
            self._follow(kept)
            running = (self.running_mean, self.running_var)
        n, c = kept.shape[:2]
        m = kept.size // max(n * c, 1)
        xp = x.xp
        x3 = kept.reshape((n, c, m)) if type(kept) is np.ndarray else xp.reshape(kept, (n, c, m))
        y3, mean, inv, running = torch_kernels.batch_norm_train(
            x3, self.weight.data if self.affine else None,
            self.bias.data if self.affine else None, self.eps, running, self.momentum)
        if running is not None:
            self.running_mean, self.running_var = running
        self._saved = (x.dist, kept, mean, inv, n * m, True, mean)
        return DistArray(y3.reshape(kept.shape) if type(y3) is np.ndarray else
                         xp.reshape(y3, kept.shape), x.dist)

    def _whole(self, xp: Any, dist: Distribution, *parts: Any) -> Any:
        """Per-channel ``parts`` of this rank's channel slice placed into whole-C zeros, joined."""
        chans = dist.local_slices()[1]
        if chans.stop - chans.start == self.num_features:
            return concat(parts)
        out = xp.zeros(len(parts) * self.num_features, dtype=parts[0].dtype,
                       **device_kw(parts[0]))
        for i, part in enumerate(parts):
            out[i * self.num_features + chans.start:i * self.num_features + chans.stop] = part
        return out

    @derived
    def _check_layout(self, dist: Distribution, dtype: np.dtype) -> bool:
        """The checks of an input distributed as ``dist`` with elements of ``dtype`` (raising
        as :func:`~disttensor_nn.checks.check_input` does), and :meth:`_check_batch`; kept
        once passed (:func:`~disttensor_nn.module.derived`)."""
        check_input_layout(dist, dtype, self.nd + 2, type(self).__name__, self.num_features,
                           io_dtype(self), split_channels=True)
        self._check_batch(dist)
        return True

    @derived
    def _stats_comm(self, dist: Distribution) -> Any:
        """The ranks that share this rank's statistics for an input distributed as ``dist``:
        those that split the channels and, with ``stats="global"``, the samples and space
        (``"group"``: space alone)."""
        dims = range(dist.ndim) if self.stats == "global" else (1, *range(2, dist.ndim))
        return split_axes_comm(dist, tuple(dims))

    def _check_batch(self, dist: Distribution) -> None:
        """Refuse batch statistics over one value per channel, as PyTorch does (all ranks alike).

        With ``stats="group"`` the smallest non-empty sample group counts: its
        variance would be zero and its output all zeros.
        """
        if not (self.training or not self.track_running_stats):
            return
        shape = dist.global_shape
        per_sample = math.prod(shape[2:])
        if self.stats == "global":
            count = shape[0] * per_sample
        else:
            b = dist.boundaries[0]
            count = min((hi - lo for lo, hi in zip(b, b[1:]) if hi > lo), default=0) * per_sample
        if count == 1:
            raise ValueError(f"{type(self).__name__}: expected more than 1 value per channel "
                             f"when training, got input size {shape}"
                             + (" (one sample per group with stats='group')"
                                if self.stats == "group" else ""))

    def _follow(self, like: Any) -> None:
        """Move the running statistics to the array module and device of ``like`` (no copy if
        already there)."""
        if type(like) is np.ndarray and type(self.running_mean) is np.ndarray and \
                type(self.running_var) is np.ndarray:  # where they are (the common case)
            return
        xp, device = array_namespace(like), device_of(like)
        self.running_mean = as_module(self.running_mean, xp, device)
        self.running_var = as_module(self.running_var, xp, device)

    def _update_running(self, x: DistArray, mean: Any, var: Any, count: int) -> None:
        xp = x.xp
        self._follow(x.local)
        unbiased = var * count / max(count - 1, 1)
        stats = concat([mean, unbiased])
        if self.stats == "group":  # average the groups' estimates so all ranks agree
            # (a group whose sample block is empty has no estimate and is left out)
            comm = split_axes_comm(x.dist, (0,))
            has = float(count > 0)
            ones = xp.ones(1, dtype=stats.dtype, **device_kw(stats))
            buf = allreduce_(concat([stats * has, ones * has]), comm)
            stats = buf[:-1] / xp.maximum(buf[-1], 1.0)
        m = self.momentum
        self.running_mean = (1 - m) * self.running_mean + m * stats[:self.num_features]
        self.running_var = (1 - m) * self.running_var + m * stats[self.num_features:]

    @derived
    def _own_statistics(self, dist: Distribution) -> bool:
        """Whether the statistics of an input distributed as ``dist`` are this rank's block's
        alone (no other rank shares them: its channels are whole)."""
        return not self.shared_statistics and self._stats_comm(dist).Get_size() == 1

    def backward(self, dy: DistArray) -> DistArray:
        dist, kept, mean, inv, count, batch_stats, centre = self._saved
        if batch_stats and self.kernel_backend == "torch" and kept.size and \
                (kept.dtype is self.dtype or numpy_dtype(kept.dtype) == self.dtype) and \
                self._own_statistics(dist):
            return self._native_backward(dy, dist, kept, mean, inv)
        chans = dist.local_slices()[1]
        xp = dy.xp
        f64 = namespace_dtype(xp, np.float64)
        n, c = kept.shape[:2]
        kept3 = xp.reshape(kept, (n, c, math.prod(kept.shape[2:])))
        gin3 = xp.reshape(dy.local, kept3.shape)
        # 16-bit activations: in the parameters' dtype one slice of channels at a time
        converted = numpy_dtype(kept.dtype) != self.dtype
        parts = _channel_parts(kept3) if converted else [slice(None)]
        fused = self.kernel_backend == "torch"  # the torch kernels' fused passes
        kernels = kernels_for(kept, "torch") if fused else None
        x3, g3 = (kept3, gin3) if not converted else (None, None)
        dx3 = None
        moments = []
        for cs in parts:
            px, pg = (x3, g3) if not converted else (
                to_dtype(kept3[:, cs], self.dtype), to_dtype(gin3[:, cs], self.dtype))
            if fused:
                moments.append(kernels.grad_moments(pg, px, centre[cs]))
                continue
            cc = astype(centre[cs], pg.dtype)[:, None]
            # dx is the scratch of g * (x - centre) (a converted slice: over the slice)
            pd = px if converted else _scratch(xp, px.shape, pg.dtype)
            # sum(g * xhat) = inv * (sum(g * (x - centre)) + (centre - mean) * sum(g)); rows
            # in the input's dtype, the rest in float64
            if is_numpy(xp):  # piece by piece, each read once while in cache
                sg, sgd = np.zeros(pg.shape[1], np.float64), np.zeros(pg.shape[1], np.float64)
                for i, ks, ms in _pieces(pg.shape, pg.itemsize):
                    d, g = pd[i, ks, ms], pg[i, ks, ms]
                    np.subtract(px[i, ks, ms], cc[ks], out=d)
                    np.multiply(d, g, out=d)
                    sg[ks] += g.sum(axis=1)
                    sgd[ks] += d.sum(axis=1)
                moments.append((sg, sgd))
            else:
                pd = _into(xp, "subtract", px, cc, pd)
                pd = _into(xp, "multiply", pd, pg, pd)
                moments.append((_channel_sums(xp, pg, f64), _channel_sums(xp, pd, f64)))
            dx3 = None if converted else pd
        sum_g, sum_gd = (moments[0][i] if len(moments) == 1 else
                         concat([mo[i] for mo in moments]) for i in range(2))
        offset = mean - astype(centre, np.float64)  # the mean about the centre
        sums = self._whole(xp, dist, sum_g, inv * (sum_gd - offset * sum_g))
        sums = allreduce_(sums, self._stats_comm(dist))
        self._parameter_grads(xp, dist, sums)
        C = self.num_features
        sums = concat([sums[:C][chans], sums[C:][chans]])
        gamma = astype(self.weight.data[chans], np.float64) if self.affine else \
            xp.ones(c, dtype=f64, **device_kw(dy.local))
        scale = gamma * inv
        b = shift = None
        if batch_stats:  # the statistics depend on the input
            # dx = scale * (g - dmean - xhat * dvar) = scale * g + b * (x - centre) + shift
            m = max(count, 1)  # 0 on a rank with no samples in stats="group"
            dmean, dvar = sums[:c] / m, sums[c:] / m
            b = -scale * inv * dvar
            shift = scale * (inv * dvar * offset - dmean)
        if converted:  # each slice converted again, its gradient rounded into the output
            dx = empty(xp, kept.shape, dy.local.dtype, device_of(kept))
            out3 = xp.reshape(dx, kept3.shape)
            for cs in parts:
                px, pg = to_dtype(kept3[:, cs], self.dtype), to_dtype(gin3[:, cs], self.dtype)
                out3[:, cs] = to_dtype(self._input_grad(
                    xp, kernels, px, pg, centre[cs], scale[cs],
                    None if b is None else b[cs], None if shift is None else shift[cs],
                    None), dy.local.dtype)
            return DistArray(dx, dist)
        dx3 = self._input_grad(xp, kernels, x3, g3, centre, scale, b, shift, dx3)
        return DistArray(xp.reshape(dx3, kept.shape), dist)

    def _native_backward(self, dy: DistArray, dist: Distribution, kept: Any, mean: Any,
                         inv: Any) -> DistArray:
        """Backward where no other rank shares the statistics (:meth:`_own_statistics`):
        ATen's batch-norm backward in one call, the channels whole."""
        n, c = kept.shape[:2]
        shape3 = (n, c, kept.size // (n * c))
        g = dy.local
        if type(kept) is np.ndarray and type(g) is np.ndarray:
            x3, g3 = kept.reshape(shape3), g.reshape(shape3)
        else:
            x3, g3 = dy.xp.reshape(kept, shape3), dy.xp.reshape(g, shape3)
        dx3, sum_g, sum_gx = torch_kernels.batch_norm_backward(
            g3, x3, self.weight.data if self.affine else None, mean, inv)
        if self.affine and self.stats == "global":
            self.bias.add_grad_(sum_g)
            self.weight.add_grad_(sum_gx)
        else:
            self._parameter_grads(dy.xp, dist, self._whole(dy.xp, dist, sum_g, sum_gx))
        return DistArray(dx3.reshape(kept.shape) if type(dx3) is np.ndarray else
                         dy.xp.reshape(dx3, kept.shape), dist)

    def _parameter_grads(self, xp: Any, dist: Distribution, sums: Any) -> None:
        """Add the whole-C ``(sum(dy), sum(dy * xhat))`` of the ranks that share the
        statistics to the parameters' gradients (``stats="group"``: summed over the sample
        groups first)."""
        if not self.affine:
            return
        C = self.num_features
        if self.stats == "group":  # summed as the other layers' are: in the gradient buckets
            reduce_gradients_([(self.bias, to_dtype(sums[:C], self.dtype)),
                               (self.weight, to_dtype(sums[C:], self.dtype))],
                              split_axes_comm(dist, (0,)))
            return
        self.bias.add_grad_(sums[:C])
        self.weight.add_grad_(sums[C:])

    @staticmethod
    def _input_grad(xp: Any, kernels: Any, x3: Any, g3: Any, centre: Any, scale: Any,
                    b: Any, shift: Any, dx3: Any) -> Any:
        """``scale * g + b * (x - centre) + shift`` (``scale * g`` without batch statistics:
        ``b`` None) on ``(N, C, M)``, into the scratch ``dx3`` where given."""
        if b is not None and kernels is not None:
            return kernels.affine_grad(g3, x3, centre, scale, b, shift)
        sc = astype(scale, g3.dtype)[:, None]
        if b is not None:
            cc = astype(centre, g3.dtype)[:, None]
            bx, bs = astype(b, g3.dtype)[:, None], astype(shift, g3.dtype)[:, None]
            if is_numpy(xp):  # piece by piece: each piece's passes run in cache
                dx3 = _scratch(xp, g3.shape, g3.dtype) if dx3 is None else dx3
                tmp = _piece_scratch(g3.shape, g3.dtype)
                for i, cs, ms in _pieces(g3.shape, g3.itemsize):
                    d = dx3[i, cs, ms]
                    t = tmp[:d.size].reshape(d.shape)
                    np.multiply(g3[i, cs, ms], sc[cs], out=d)
                    np.subtract(x3[i, cs, ms], cc[cs], out=t)
                    np.multiply(t, bx[cs], out=t)
                    np.add(d, t, out=d)
                    np.add(d, bs[cs], out=d)
                return dx3
            if writes_in_place(xp):
                dx3 = _scratch(xp, g3.shape, g3.dtype) if dx3 is None else dx3
                tmp = xp.empty(x3.shape[1:], dtype=g3.dtype)
                for i in range(x3.shape[0]):  # one sample at a time
                    xp.multiply(g3[i], sc, out=dx3[i])
                    xp.subtract(x3[i], cc, out=tmp)
                    xp.multiply(tmp, bx, out=tmp)
                    xp.add(dx3[i], tmp, out=dx3[i])
                    xp.add(dx3[i], bs, out=dx3[i])
                return dx3
            return g3 * sc + (x3 - cc) * bx + bs
        if kernels is not None:
            return kernels.affine(g3, scale, xp.zeros_like(scale))
        return _into(xp, "multiply", g3, sc, dx3)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """Eight FLOPs per element; the input is kept for backward (not the normalised input).

        Two allreduces of ``2 C`` float64 sums (statistics forward, the
        input gradient's sums backward) over the ranks that share the
        statistics: those splitting N and space (``stats="global"``) or space
        only (``"group"``), and those splitting C. On a channel slice the
        kernels are timed on the block of every channel (the twin's) and
        scaled by the slice's share.
        """
        block = largest_block(dist)
        n = math.prod(block)
        spatial = tuple(range(2, dist.ndim))
        chans = (1,) if dist.nblocks[1] > 1 else ()
        sums = Allreduce(2 * self.num_features * 8,
                         (0, *chans, *spatial) if self.stats == "global" else (*chans, *spatial))
        # a channel slice: timed on the twin's block of every channel, scaled by the slice
        twin = (block[0], self.num_features, *block[2:])
        share = block[1] / self.num_features if chans else 1.0
        whole = math.prod(twin) if chans else n
        # 16-bit activations: normalised on float32 copies of a slice of channels at a time
        # (backward: the input's, the gradient's and their result's)
        cvt = 3 * min(n * self.dtype.itemsize, max(PART_BYTES, math.prod(block[2:]) * block[0]
                                                   * self.dtype.itemsize)) \
            if io_dtype(self) != self.dtype else 0
        # statistics shared with other ranks: the twin is timed on that backward (the torch
        # kernels' one-call backward is for statistics of this rank alone)
        shares = any(dist.nblocks[d] > 1 for d in (
            (1, *range(2, dist.ndim)) if self.stats == "group" else range(dist.ndim)))
        timed = None
        if shares and self.kernel_backend == "torch" and not self.shared_statistics:
            timed = self.local_twin()
            timed.shared_statistics = True
        return CostSpec(twin if chans else block, flops=8.0 * whole, nbytes=4 * whole * itemsize,
                        allreduces=(sums, sums), keeps_input=True,
                        # the torch kernels' forward holds the deviations beside the output
                        # (the NumPy passes: a temporary of one piece; CuPy's: of one sample)
                        workspace=(n * itemsize if self.kernel_backend == "torch" and not cvt
                                   else min(n // max(block[0], 1) * itemsize, CHUNK_BYTES))
                        + cvt, share=share,
                        twin=timed)

    def kernel_signature(self) -> str:
        return f"bn:{self.num_features}:{self.stats}" + (
            ":shared" if self.shared_statistics else "")

    def local_twin(self) -> BatchNormNd:
        twin = type(self)(self.num_features, self.eps, self.momentum, self.affine,
                          self.track_running_stats, stats=self.stats, dtype=self.dtype)
        twin.shared_statistics = self.shared_statistics
        twin.activation_dtype = self.activation_dtype  # 16-bit blocks, float32 statistics
        return twin


class BatchNorm1d(BatchNormNd):
    """Batch normalisation of (N, C, L); see :class:`BatchNormNd`."""

    nd = 1


class BatchNorm2d(BatchNormNd):
    """Batch normalisation of (N, C, H, W); see :class:`BatchNormNd`."""

    nd = 2


class BatchNorm3d(BatchNormNd):
    """Batch normalisation of (N, C, D, H, W); see :class:`BatchNormNd`."""

    nd = 3


def set_batch_norm_stats(model: Layer, stats: str) -> int:
    """Set ``stats`` (``"global"`` or ``"group"``) on every batch norm of ``model``.

    Before planning: the planner prices each batch norm by its statistics
    (:class:`BatchNormNd`).

    Parameters
    ----------
    model : Layer
        The network (or one layer); its :class:`BatchNormNd` layers are set.
    stats : {'global', 'group'}
        ``"global"``: the whole batch's statistics, as one process;
        ``"group"``: each group of ranks holding the same samples its own.

    Returns
    -------
    int
        How many batch norms were set.

    Raises
    ------
    ValueError
        For ``stats`` other than ``"global"`` and ``"group"``.
    """
    if stats not in BATCH_NORM_STATS:
        raise ValueError(f"stats must be 'global' or 'group', got {stats!r}")
    layers = [m for _, m in model.named_modules() if isinstance(m, BatchNormNd)]
    for m in layers:
        m.stats = stats
    return len(layers)
