"""The cost model: time and memory of one layer under one distribution, and of a shuffle.

A candidate distribution is a factorisation of the rank count over the
sample dimension and the spatial dimensions, ``(pN, pS1, ..., pSk)``: the
activation ``(N, C, S1, ..., Sk)`` is split by a grid of that shape (channels
are never split); 2-D activations ``(N, F)`` keep the sample split and the
spatial factors become replicas. A layer states its work under a candidate
(:meth:`disttensor_nn.Layer.cost_spec`, a :class:`~disttensor_nn.costspec.CostSpec`);
the cost model prices it on a machine profile: the compute of its local
kernels on the largest local block (halo included; measured by a
:class:`~disttensor_nn.plan.KernelTimer` or from the profile's rates), plus
its halo exchanges (forward) and halo accumulations (backward), its
allreduces (weight gradients, batch-norm statistics) and its
redistributions. Nothing here depends on the layer's class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disttensor import Distribution, factorizations

from ..costspec import CostSpec, largest_block
from ..module import Layer
from .machine import MachineProfile
from .timer import KernelTimer, QueryRecorder, machine_id  # noqa: F401 (also importable here)

__all__ = ["candidates", "dist_for", "LayerCost", "CostModel"]

Candidate = tuple[int, ...]


def candidates(nprocs: int, nspatial: int) -> list[Candidate]:
    """Every ordered factorisation of ``nprocs`` over (N, S1, ..., Sk)."""
    return factorizations(nprocs, nspatial + 1)


def dist_for(shape: tuple[int, ...], cand: Candidate) -> Distribution:
    """Pure Distribution of an activation of ``shape`` under ``cand`` (grid shape only)."""
    nsp = len(cand) - 1
    if len(shape) == 2:
        axes = (0, None)
    elif len(shape) == nsp + 2:
        axes = (0, None, *range(1, nsp + 1))
    else:
        raise ValueError(f"activation {shape} does not fit candidate {cand}")
    return Distribution(shape, cand, axes)


@dataclass
class LayerCost:
    """Predicted seconds and bytes of one layer under one candidate, per rank."""

    fwd: float = 0.0  # compute, forward
    bwd: float = 0.0  # compute, backward (data and weights)
    comm: float = 0.0  # halo exchanges, halo accumulations, allreduces
    memory: float = 0.0  # bytes kept from forward to backward (CostSpec.kept)
    estimated: bool = False  # compute from a model, not a measurement
    transient: float = 0.0  # bytes alive only while one pass runs (CostSpec.transient)
    keeps_input: float = 0.0  # bytes of the input block kept (0 when not kept)
    keeps_output: float = 0.0  # bytes of the output block kept (0 when not kept)
    tiled: bool = False  # compute measured on a tile of the block and scaled by FLOPs

    @property
    def total(self) -> float:
        """Forward + backward + communication."""
        return self.fwd + self.bwd + self.comm


class CostModel:
    """Predicts per-rank time and memory of layers and shuffles on a machine.

    Parameters
    ----------
    profile : MachineProfile
    nprocs : int
        Ranks of the job.
    timer : KernelTimer, optional
        Measured kernel times (for the machine the profile describes); without
        it compute comes from the profile's peak rates.
    itemsize : int
        Bytes per activation element.
    """

    def __init__(self, profile: MachineProfile, nprocs: int, timer: KernelTimer | None = None,
                 itemsize: int = 4):
        self.profile, self.nprocs, self.timer, self.itemsize = profile, nprocs, timer, itemsize
        # Ranks sharing a node's cores slow each other's kernels down. Kernel times
        # measured on all ranks at once include that; others are scaled by the
        # oversubscription of the cores.
        self.corun = nprocs if profile.measured else 1
        self.contention = max(1.0, nprocs / max(profile.cores_per_node, 1)) \
            if profile.measured else 1.0

    # ------------------------------------------------------------ compute
    def _compute(self, layer: Layer, local_in: tuple[int, ...], flops: float,
                 nbytes: float) -> tuple[float, float, bool, bool]:
        if any(n == 0 for n in local_in):
            return 0.0, 0.0, False, False
        dtype = np.dtype(f"f{self.itemsize}")
        if self.timer is not None:
            f, b, est, co = self.timer.times(layer, local_in, dtype, flops, self.corun)
            scale = 1.0 if co >= self.corun else self.contention
            tiled = getattr(self.timer, "tiled", None)
            return f * scale, b * scale, est, bool(tiled and tiled(layer, local_in, dtype, co))
        p = self.profile
        t = flops / (p.peak_flops * p.efficiency) + nbytes / p.mem_bandwidth
        return t, 2 * t, True, False

    def layer(self, layer: Layer, in_shape: tuple[int, ...], cand: Candidate) -> LayerCost:
        """Cost of ``layer`` on an input of global ``in_shape`` split by ``cand``.

        The layer states its work (:meth:`~disttensor_nn.Layer.cost_spec`);
        this prices it on the machine profile, with kernel times from the
        timer where there is one.
        """
        dist = dist_for(in_shape, cand)
        spec = layer.cost_spec(dist, self.itemsize)
        _check_spec(layer, spec, dist)
        out_shape = tuple(layer.output_shape(tuple(in_shape)))
        in_bytes = math.prod(largest_block(dist)) * self.itemsize
        out_bytes = math.prod(largest_block(dist_for(out_shape, cand))) * self.itemsize \
            if len(out_shape) in (2, len(cand) + 1) else in_bytes
        cost = LayerCost(memory=spec.kept(in_bytes, out_bytes),
                         transient=spec.transient(in_bytes, out_bytes),
                         keeps_input=in_bytes * spec.keeps_input,
                         keeps_output=out_bytes * spec.keeps_output)
        if spec.timed:
            cost.fwd, cost.bwd, cost.estimated, cost.tiled = self._compute(
                layer, spec.local_shape, spec.flops, spec.nbytes)
        else:
            cost.fwd = cost.bwd = spec.nbytes / self.profile.mem_bandwidth
        cost.comm = sum((self.profile.allreduce(a.nbytes, _ranks_splitting(dist, a.dims))
                         for a in spec.allreduces), 0.0)
        if spec.halo is not None:  # the exchange forward, its accumulation backward
            cost.comm += 2 * self._halo(dist, spec.halo)
        for target in spec.redistributions:  # there forward, back backward
            cost.comm += 2 * self.redistribution(dist, target)
        return cost

    def _halo(self, dist: Distribution, widths: Sequence[tuple[int, int]]) -> float:
        """Forward halo exchange: dimension by dimension, both sides at once."""
        t = 0.0
        extent = list(largest_block(dist))
        for d in range(2, len(extent)):
            lo, hi = widths[d]
            if dist.nblocks[d] > 1 and (lo or hi):
                face = math.prod(extent[:d] + extent[d + 1:]) * self.itemsize
                t += self.profile.p2p(face * max(lo, hi))
            extent[d] += lo + hi
        return t

    # ------------------------------------------------------------ shuffles
    def shuffle(self, shape: tuple[int, ...], src: Distribution, dst: Candidate) -> float:
        """Time to redistribute an activation laid out as ``src`` to candidate ``dst``."""
        return self.redistribution(src, dist_for(shape, dst))

    def redistribution(self, src: Distribution, dst: Distribution) -> float:
        """Time to redistribute an activation from ``src`` to ``dst`` (pure distributions).

        The all-to-all of the largest number of elements one rank receives.
        """
        if dst.dim_axes == src.dim_axes and dst.grid_shape == src.grid_shape:
            return 0.0
        recv, peers = _received(src, dst)
        return self.profile.alltoall(recv * self.itemsize, peers)

    def params_memory(self, model: Layer) -> float:
        """Bytes per rank of parameters, their gradients and momentum buffers."""
        return 3.0 * sum(p.data.nbytes for p in model.parameters())


def _check_spec(layer: Layer, spec: CostSpec, dist: Distribution) -> None:
    """A clear error for a cost spec that does not fit the input it was asked about."""
    where = f"{type(layer).__name__}.cost_spec on a {dist.ndim}-D input"
    if spec.halo is not None and (len(spec.halo) != dist.ndim or
                                  any(lo < 0 or hi < 0 for lo, hi in spec.halo)):
        raise ValueError(f"{where}: halo needs a (before, after) pair of widths >= 0 per "
                         f"dimension, got {spec.halo}")
    for a in spec.allreduces:
        if any(not 0 <= d < dist.ndim for d in a.dims):
            raise ValueError(f"{where}: allreduce over dimensions {a.dims} out of range")


def _ranks_splitting(dist: Distribution, dims: Sequence[int]) -> int:
    """Number of ranks that split ``dims`` of ``dist`` (the size of ``split_axes_comm``)."""
    return math.prod(dist.grid_shape[a] for d in dims for a in dist.dim_axes[d])


def _boxes(dist: Distribution, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and stop of every rank's block, per dimension: arrays of shape (ndim, len(ranks))."""
    coords = np.unravel_index(ranks, dist.grid_shape)
    lo, hi = [], []
    for d, axes in enumerate(dist.dim_axes):
        b = np.asarray(dist.boundaries[d])
        if axes:
            idx = np.ravel_multi_index([coords[a] for a in axes],
                                       [dist.grid_shape[a] for a in axes])
        else:
            idx = np.zeros(len(ranks), dtype=np.intp)
        lo.append(b[idx])
        hi.append(b[idx + 1])
    return np.array(lo), np.array(hi)


def _received(src: Distribution, dst: Distribution) -> tuple[int, int]:
    """Largest number of elements a rank receives in a redistribution, and from how many ranks."""
    ranks = np.arange(dst.nprocs)
    dlo, dhi = _boxes(dst, ranks)
    slo, shi = _boxes(src, ranks)
    size = np.prod(dhi - dlo, axis=0)
    kept = np.prod(np.clip(np.minimum(dhi, shi) - np.maximum(dlo, slo), 0, None), axis=0)
    need = size - kept
    r = int(np.argmax(need))
    if need[r] <= 0:
        return 0, 0
    peers = 1
    for d in range(dst.ndim):
        b = np.asarray(src.boundaries[d])
        peers *= max(1, int(np.count_nonzero((b[:-1] < dhi[d, r]) & (b[1:] > dlo[d, r]))))
    return int(need[r]), max(1, peers - 1)
