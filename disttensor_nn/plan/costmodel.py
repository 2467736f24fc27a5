"""The cost model: time and memory of one layer under one distribution, and of a shuffle.

A candidate distribution is a factorisation of the rank count over the
sample dimension and the spatial dimensions, ``(pN, pS1, ..., pSk)``: the
activation ``(N, C, S1, ..., Sk)`` is split by a grid of that shape (channels
are never split); 2-D activations ``(N, F)`` keep the sample split and the
spatial factors become replicas. A layer's cost under a candidate is the
compute of its local kernels on the largest local block (halo included),
plus its halo exchanges (forward) and halo accumulations (backward), plus
the allreduces of its weight gradients and batch-norm statistics.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from disttensor import Distribution

from ..layers.conv import ConvNd
from ..layers.dense import Flatten, Linear
from ..layers.elementwise import LeakyReLU, Sigmoid
from ..layers.norm import BatchNormNd
from ..layers.pool import GlobalAvgPool, _Pool
from ..layers.window_layer import WindowLayer
from ..module import Layer
from ..window import output_layout
from .machine import MachineProfile, default_cache_dir

__all__ = ["candidates", "dist_for", "LayerCost", "CostModel", "KernelTimer"]

Candidate = tuple[int, ...]


def candidates(nprocs: int, nspatial: int) -> list[Candidate]:
    """Every ordered factorisation of ``nprocs`` over (N, S1, ..., Sk)."""
    def rec(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(f, *rest) for f in range(1, n + 1) if n % f == 0 for rest in rec(n // f, k - 1)]
    return rec(nprocs, nspatial + 1)


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


def _max_block(dist: Distribution) -> tuple[int, ...]:
    return tuple(max(b[i + 1] - b[i] for i in range(len(b) - 1)) for b in dist.boundaries)


@dataclass
class LayerCost:
    """Predicted seconds and bytes of one layer under one candidate, per rank."""

    fwd: float = 0.0  # compute, forward
    bwd: float = 0.0  # compute, backward (data and weights)
    comm: float = 0.0  # halo exchanges, halo accumulations, allreduces
    memory: float = 0.0  # bytes kept for backward plus the layer's workspace
    estimated: bool = False  # compute from a model, not a measurement

    @property
    def total(self) -> float:
        """Forward + backward + communication."""
        return self.fwd + self.bwd + self.comm


def _local_twin(layer: Layer) -> Layer:
    """A 1-process copy of ``layer`` whose kernels do the same local work (no padding)."""
    if isinstance(layer, ConvNd):
        s = layer.spec
        return type(layer)(layer.in_channels, layer.out_channels, s.kernel, s.stride, 0,
                           s.dilation, layer.groups, layer.bias is not None, dtype=layer.dtype)
    if isinstance(layer, _Pool):
        s = layer.spec
        return type(layer)(s.kernel, s.stride, 0, s.dilation)
    return layer


def _signature(layer: Layer) -> str:
    if isinstance(layer, ConvNd):
        s = layer.spec
        return (f"conv{layer.nd}:{layer.in_channels}>{layer.out_channels}:k{s.kernel}s{s.stride}"
                f"d{s.dilation}g{layer.groups}b{layer.bias is not None}")
    if isinstance(layer, _Pool):
        s = layer.spec
        return f"{type(layer).__name__}:k{s.kernel}s{s.stride}d{s.dilation}"
    if isinstance(layer, Linear):
        return f"linear:{layer.in_features}>{layer.out_features}"
    if isinstance(layer, BatchNormNd):
        return f"bn:{layer.num_features}:{layer.stats}"
    return type(layer).__name__


class KernelTimer:
    """Measured forward and backward times of a layer's local kernels, cached on disk.

    A measurement runs a 1-process twin of the layer on random data of the
    exact local shape (halo included) and keeps the fastest of ``reps`` runs
    (the least disturbed by other processes).
    Results are stored in ``cache_dir/kernels-<machine>.json`` keyed by layer
    signature, local shape and dtype, so each is measured once per machine.
    With ``measure=False`` a missing entry is estimated from the FLOP rate of
    measured entries of the same kind (the cost is then marked estimated).
    """

    def __init__(self, machine: str, cache_dir: str | None = None, measure: bool = True,
                 reps: int = 5):
        self.path = os.path.join(cache_dir or default_cache_dir(), f"kernels-{machine}.json")
        self.measure, self.reps = measure, reps
        self.table: dict[str, list[float]] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.table = json.load(f)
        self._dirty = False

    def key(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype) -> str:
        """Cache key of a measurement."""
        return f"{_signature(layer)}|{local_in}|{np.dtype(dtype).str}"

    def times(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
              flops: float) -> tuple[float, float, bool]:
        """(forward, backward, estimated) seconds of ``layer`` on a local input shape."""
        key = self.key(layer, local_in, dtype)
        if key in self.table:
            fwd, bwd = self.table[key][:2]
            return fwd, bwd, False
        if self.measure:
            fwd, bwd = self._run(layer, local_in, dtype)
            self.table[key] = [fwd, bwd, flops]
            self._dirty = True
            return fwd, bwd, False
        rate = self._rate(_signature(layer).split(":")[0])
        return flops / rate, 2 * flops / rate, True

    def _rate(self, kind: str) -> float:
        rates = [v[2] / max(v[0], 1e-9) for k, v in self.table.items()
                 if k.split(":")[0] == kind and len(v) > 2 and v[2] > 0]
        return statistics.median(rates) if rates else 5e9

    def _run(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype) -> tuple[float, float]:
        from disttensor import DistArray

        twin = _local_twin(layer)
        if any(n == 0 for n in local_in):
            return 0.0, 0.0
        grid = _self_grid(len(local_in))
        dist = Distribution(local_in, grid, tuple(range(len(local_in))))
        rng = np.random.default_rng(0)
        x = DistArray(rng.standard_normal(local_in).astype(dtype), dist)
        fwd, bwd = [], []
        # In a network the forward input was just written by the layer before
        # (warm), while backward reads what forward saved long ago (cold).
        for _ in range(self.reps + 1):
            x.local[...] = x.local
            t0 = time.perf_counter()
            y = twin.forward(x)
            t1 = time.perf_counter()
            dy = DistArray(np.ones(y.local_shape, y.dtype), y.dist)
            _evict_caches()
            t2 = time.perf_counter()
            twin.backward(dy)
            t3 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
        twin.zero_grad()
        return min(fwd[1:]), min(bwd[1:])

    def save(self) -> None:
        """Write new measurements to the cache file."""
        if not self._dirty:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.table, f)
        os.replace(tmp, self.path)
        self._dirty = False


_SCRATCH: list[np.ndarray] = []


def _evict_caches(nbytes: int = 64 * 2**20) -> None:
    """Write a buffer larger than the last-level cache so that earlier data is evicted."""
    if not _SCRATCH:
        _SCRATCH.append(np.empty(nbytes // 8))
    _SCRATCH[0].fill(1.0)


@lru_cache(maxsize=8)
def _self_grid(ndim: int):
    from mpi4py import MPI

    from disttensor import ProcessGrid

    return ProcessGrid((1,) * ndim, MPI.COMM_SELF)


def machine_id(profile: MachineProfile) -> str:
    """A short identifier of a profile, for cache file names."""
    return hashlib.sha1(profile.name.encode()).hexdigest()[:8] + "-" + profile.name


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
        # ranks sharing a node's cores slow each other's kernels down
        self.contention = max(1.0, min(nprocs, 10**9) / max(profile.cores_per_node, 1)) \
            if profile.measured else 1.0

    # ------------------------------------------------------------ compute
    def _compute(self, layer: Layer, local_in: tuple[int, ...], flops: float,
                 nbytes: float) -> tuple[float, float, bool]:
        if any(n == 0 for n in local_in):
            return 0.0, 0.0, False
        dtype = np.dtype(f"f{self.itemsize}")
        if self.timer is not None:
            f, b, est = self.timer.times(layer, local_in, dtype, flops)
            return f * self.contention, b * self.contention, est
        p = self.profile
        t = flops / (p.peak_flops * p.efficiency) + nbytes / p.mem_bandwidth
        return t, 2 * t, True

    def layer(self, layer: Layer, in_shape: tuple[int, ...], cand: Candidate) -> LayerCost:
        """Cost of ``layer`` on an input of global ``in_shape`` split by ``cand``."""
        p, isz = self.profile, self.itemsize
        dist = dist_for(in_shape, cand)
        block = _max_block(dist)
        n_in = math.prod(block)
        cost = LayerCost()
        split_ranks = self.nprocs // dist.nreplicas
        if isinstance(layer, WindowLayer):
            out_dist, widths = output_layout(layer.spec, dist)
            ext = tuple(n + lo + hi for n, (lo, hi) in zip(block, widths))
            out_block = list(_max_block(out_dist))
            out_block[1] = layer.output_shape(in_shape)[1]
            if isinstance(layer, ConvNd):
                flops = 2.0 * math.prod(out_block) * layer.in_channels // layer.groups * \
                    math.prod(layer.spec.kernel)
                params = sum(q.data.size for q in layer.own_parameters())
                cost.comm += p.allreduce(params * isz, split_ranks)
                ck = layer.in_channels // layer.groups * math.prod(layer.spec.kernel)
                work = min(64 * 2**20, ck * math.prod(out_block) // max(out_block[1], 1) * isz)
            else:
                flops = float(math.prod(out_block) * math.prod(layer.spec.kernel))
                work = 0
            f, b, est = self._compute(layer, ext, flops, (math.prod(ext) + math.prod(out_block))
                                      * isz)
            cost.fwd, cost.bwd, cost.estimated = f, b, est
            cost.comm += 2 * self._halo(block, widths, cand)
            cost.memory = math.prod(ext) * isz * 2 + work  # kept input, gradient of extended
        elif isinstance(layer, BatchNormNd):
            f, b, est = self._compute(layer, block, 8.0 * n_in, 4 * n_in * isz)
            cost.fwd, cost.bwd, cost.estimated = f, b, est
            group = split_ranks if layer.stats == "global" else split_ranks // cand[0]
            cost.comm = 2 * p.allreduce(2 * layer.num_features * 8, group)
            cost.memory = 2 * n_in * isz
        elif isinstance(layer, (LeakyReLU, Sigmoid)):
            f, b, est = self._compute(layer, block, float(n_in), 2 * n_in * isz)
            cost.fwd, cost.bwd, cost.estimated = f, b, est
            cost.memory = n_in * (1 if isinstance(layer, LeakyReLU) else isz)
        elif isinstance(layer, GlobalAvgPool):
            t = n_in * isz / p.mem_bandwidth
            cost.fwd = cost.bwd = t
            cost.comm = p.allreduce(block[0] * block[1] * 8, math.prod(cand[1:]))
        elif isinstance(layer, Flatten):
            if len(in_shape) > 2 and math.prod(cand[1:]) > 1:
                target = (cand[0],) + (1,) * (len(cand) - 1)
                cost.comm = 2 * self.shuffle(in_shape, dist, target)
        elif isinstance(layer, Linear):
            flops = 2.0 * block[0] * layer.in_features * layer.out_features
            f, b, est = self._compute(layer, block, flops, n_in * isz)
            cost.fwd, cost.bwd, cost.estimated = f, b, est
            params = sum(q.data.size for q in layer.own_parameters())
            cost.comm = p.allreduce(params * 8, cand[0])
            cost.memory = n_in * isz
        else:  # other local layers (DepthToSpace, ...): measured like the rest
            f, b, est = self._compute(layer, block, float(n_in), 2 * n_in * isz)
            cost.fwd, cost.bwd, cost.estimated = f, b, est
            cost.memory = n_in * isz
        return cost

    def _halo(self, block: tuple[int, ...], widths, cand: Candidate) -> float:
        """Forward halo exchange: dimension by dimension, both sides at once."""
        t = 0.0
        extent = list(block)
        for d in range(2, len(block)):
            lo, hi = widths[d]
            if cand[d - 1] > 1 and (lo or hi):
                face = math.prod(extent[:d] + extent[d + 1:]) * self.itemsize
                t += self.profile.p2p(face * max(lo, hi))
            extent[d] += lo + hi
        return t

    # ------------------------------------------------------------ shuffles
    def shuffle(self, shape: tuple[int, ...], src: Distribution, dst: Candidate) -> float:
        """Time to redistribute an activation laid out as ``src`` to candidate ``dst``."""
        target = dist_for(shape, dst)
        if target.dim_axes == src.dim_axes and target.grid_shape == src.grid_shape:
            return 0.0
        recv, peers = _received(src, target)
        return self.profile.alltoall(recv * self.itemsize, peers)

    def params_memory(self, model: Layer) -> float:
        """Bytes per rank of parameters, their gradients and momentum buffers."""
        return 3.0 * sum(p.data.nbytes for p in model.parameters())


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
