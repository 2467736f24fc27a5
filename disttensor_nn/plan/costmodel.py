"""The cost model: time and memory of one layer under one distribution, and of a shuffle.

A candidate distribution is a factorisation of the rank count over the
sample dimension and the spatial dimensions, ``(pN, pS1, ..., pSk)``: the
activation ``(N, C, S1, ..., Sk)`` is split by a grid of that shape; with
channel splits (``candidates(..., channels=True)``) over the channels too,
``(pN, pC, pS1, ..., pSk)``, and convolutions then split their filters as
their input's channels (each rank computes ``F / pC`` output channels from
the input gathered along C, and holds that slice of the weights).
2-D activations ``(N, F)`` keep the sample split and the other factors
become replicas. A layer states its work under a candidate
(:meth:`disttensor_nn.Layer.cost_spec`, a :class:`~disttensor_nn.costspec.CostSpec`);
the cost model prices it on a machine profile: the compute of its local
kernels on the largest local block (halo included; measured by a
:class:`~disttensor_nn.plan.KernelTimer` or from the profile's rates), plus
its halo exchanges (forward) and halo accumulations (backward), its
allreduces (weight gradients, batch-norm statistics) and its
redistributions. Nothing here depends on the layer's class.

Messages are priced by where their ranks live (:class:`MachineProfile`'s
two levels): ranks fill nodes in order and a grid is laid over them
row-major, so its last axes stay inside a node: the spatial splits, or
with ``CostModel.inner = "sample"`` the sample split (see :func:`dist_for`;
the planner tries both on machines of several nodes). :func:`step_time` turns
the per-layer costs of a plan into the time of one training step when
gradient reductions overlap backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from disttensor import Distribution, factorizations
from disttensor.backend import numpy_dtype

from ..costspec import CostSpec, largest_block
from ..kernels import BACKENDS, layer_supports, optimizer_backend, with_backend
from ..kernels.numpy_kernels import get_num_threads
from ..module import Layer
from ..optim.optimizer import CHUNK, STAGES
from .machine import MachineProfile
from .timer import KernelTimer, QueryRecorder, machine_id  # noqa: F401 (also importable here)

__all__ = ["candidates", "dist_for", "NODE_INNER", "LayerCost", "CostModel", "StepTime",
           "step_time", "ranks_per_node_of", "same_placement"]

Candidate = tuple[int, ...]


def candidates(nprocs: int, nspatial: int, channels: bool = False) -> list[Candidate]:
    """Every ordered factorisation of ``nprocs`` over (N, S1, ..., Sk), or (N, C, S1, ..., Sk)."""
    return factorizations(nprocs, nspatial + 1 + bool(channels))


NODE_INNER = ("space", "sample")
"""Which grid axes a plan keeps inside a node (see :func:`dist_for`)."""


def dist_for(shape: tuple[int, ...], cand: Candidate, split_channels: bool = True,
             inner: str = "space") -> Distribution:
    """Pure Distribution of an activation of ``shape`` under ``cand`` (grid shape only).

    Under a grid over (N, C, S..), ``split_channels=False`` keeps the
    channels whole: the ranks along the channel axis hold replicas.

    Ranks fill nodes in order and the grid is row-major over them, so its
    last axes stay inside a node. ``inner="space"`` lays the grid out in the
    candidate's order, ``(pN, [pC,] pS1, ..., pSk)``: the spatial splits stay
    inside a node (halo exchanges on the fast links) and the sample split
    spans nodes. ``inner="sample"`` moves the sample axis last,
    ``([pC,] pS1, ..., pSk, pN)``: the ranks that split the batch share a
    node (gradient reductions over them on the fast links first) and the
    spatial splits span nodes.
    """
    if inner not in NODE_INNER:
        raise ValueError(f"inner must be one of {NODE_INNER}, got {inner!r}")
    return _dist_for(tuple(shape), tuple(cand), bool(split_channels), inner)


@lru_cache(maxsize=65536)
def _dist_for(shape: tuple[int, ...], cand: Candidate, split_channels: bool,
              inner: str) -> Distribution:
    """:func:`dist_for` (a Distribution is immutable: one object serves every caller)."""
    nsp = len(cand) - 1
    if len(shape) == 2:
        axes = (0, None)
    elif len(shape) == nsp + 2:
        axes = (0, None, *range(1, nsp + 1))
    elif len(shape) == len(cand) and len(shape) > 2:  # (pN, pC, pS..): channels split too
        axes = (0, 1 if split_channels else None, *range(2, len(shape)))
    else:
        raise ValueError(f"activation {shape} does not fit candidate {cand}")
    grid = tuple(cand)
    if inner == "sample" and len(cand) > 1:  # grid axis 0 (the sample split) moves last
        last = len(cand) - 1
        grid = grid[1:] + grid[:1]
        axes = tuple(None if a is None else last if a == 0 else a - 1 for a in axes)
    return Distribution(shape, grid, axes)


@dataclass
class LayerCost:
    """Predicted seconds and bytes of one layer under one candidate, per rank."""

    fwd: float = 0.0  # compute, forward
    bwd: float = 0.0  # compute, backward (data and weights)
    comm: float = 0.0  # halo exchanges, halo accumulations, allreduces, redistributions
    memory: float = 0.0  # bytes kept from forward to backward (CostSpec.kept)
    estimated: bool = False  # compute from a model, not a measurement
    transient: float = 0.0  # bytes alive only while one pass runs (CostSpec.transient)
    keeps_input: float = 0.0  # bytes of the input block kept (0 when not kept)
    keeps_output: float = 0.0  # bytes of the output block kept (0 when not kept)
    tiled: bool = False  # compute measured on a tile of the block and scaled by FLOPs
    grad: float = 0.0  # of comm: the weight-gradient reduction (may overlap backward)
    hidden: float = 0.0  # of comm: halo traffic hidden behind the layer's own kernels
    kernels: str = ""  # the kernel backend priced ("" for a layer without a choice)

    @property
    def total(self) -> float:
        """Forward + backward + the communication not hidden inside the layer."""
        return self.fwd + self.bwd + self.comm - self.hidden

    @property
    def blocking(self) -> float:
        """Communication that stalls this layer's kernels (all of it but ``grad``, ``hidden``)."""
        return self.comm - self.grad - self.hidden


@dataclass
class StepTime:
    """Time of one training step along its critical path, and how it divides."""

    time: float  # the step
    compute: float  # kernels
    exposed: float  # communication on the critical path
    hidden: float  # communication overlapped with kernels

    @property
    def comm(self) -> float:
        """All communication."""
        return self.exposed + self.hidden


def step_time(costs: Sequence[LayerCost], overlap: bool = True) -> StepTime:
    """The critical path of a training step whose layers, in network order, cost ``costs``.

    Forward runs every layer (kernels, then half of its blocking
    communication: halo exchanges, statistics, a shuffle given as a
    ``LayerCost`` of communication alone); backward runs them in reverse
    (kernels, the other half). With ``overlap`` a layer's gradient reduction
    (``grad``) starts when its backward ends and the previous reduction has,
    the network reducing one at a time in the order they come; the step ends
    when both backward and the last reduction have. With backward times
    ``b_l`` and reductions ``r_l`` (``l = 1..L``, backward from ``L`` down),
    the reductions end at ``max_l (sum_{m >= l} b_m + sum_{m <= l} r_m)``
    after forward. Without ``overlap`` everything adds up.
    """
    compute = sum(c.fwd + c.bwd for c in costs)
    comm = sum(c.comm for c in costs)
    halo_hidden = sum(c.hidden for c in costs)
    if not overlap:
        t = compute + comm - halo_hidden
        return StepTime(t, compute, t - compute, halo_hidden)
    t = sum(c.fwd + c.blocking / 2 for c in costs)
    done = net = 0.0  # backward so far; the end of the reductions queued so far
    for c in reversed(costs):
        done += c.bwd + c.blocking / 2
        if c.grad > 0:
            net = max(net, done) + c.grad
    t += max(done, net)
    exposed = max(t - compute, 0.0)  # not below zero by rounding
    return StepTime(t, compute, exposed, max(comm - exposed, 0.0))


@lru_cache(maxsize=4096)
def _node_spread(grid_shape: tuple[int, ...], axes: tuple[int, ...], node: int) -> tuple[int, int]:
    """(ranks, ranks in one node) of the communicator over grid ``axes`` holding rank 0.

    Ranks fill nodes of ``node`` ranks in order; the grid is row-major.
    """
    strides = [math.prod(grid_shape[a + 1:]) for a in range(len(grid_shape))]
    ranks = np.zeros(1, dtype=np.int64)
    for a in axes:
        ranks = (ranks[:, None] + strides[a] * np.arange(grid_shape[a])[None, :]).ravel()
    return len(ranks), int(np.count_nonzero(ranks < node))


def ranks_per_node_of(dist: Distribution, axes: Sequence[int], node: int) -> tuple[int, int]:
    """Size of the communicator over grid ``axes`` of ``dist``, and its ranks in one node.

    Ranks are placed node-major (``node`` per node) and the grid row-major
    over them, so the last grid axes stay inside a node.
    """
    return _node_spread(tuple(dist.grid_shape), tuple(sorted(set(axes))), max(1, node))


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
        Bytes per activation element (float32's 4 by default; ignored with ``dtype``).
    overlap : bool, optional
        Gradient reductions run in buckets of ``bucket_bytes`` that overlap
        the rest of backward (:func:`step_time`); a layer's share of a
        bucket's latency is its share of the bucket's bytes. False: each
        layer's reduction blocks. Default: True, except on a calibrated CPU
        machine, where ranks have no spare core to progress messages while
        they compute (measured on 2 ranks of 2 cores: bucketed non-blocking
        reductions were no faster than blocking ones, and slower for
        ResNet-18's 11.7 M parameters).
    bucket_bytes : float
        Bytes of gradients per bucket (default: the runtime's default bucket,
        1 MiB).
    training : bool
        Price a training step (forward, backward, gradient reductions; the
        activations kept for backward; parameters with gradients and
        momenta) or, with False, an inference pass (forward alone, nothing
        kept, the parameters alone).
    backends : sequence of str, optional
        Kernel backends to choose among (:data:`disttensor_nn.kernels.BACKENDS`):
        a layer with kernels in several of them
        (:attr:`~disttensor_nn.Layer.kernel_backends`) is priced with each and
        the fastest is kept (:attr:`LayerCost.kernels`; the first on a tie);
        a backend that cannot run the arrays' dtype is left out. None: each
        layer's own ``kernel_backend``.
    shard_state : {"none", "optimizer", "gradients", "full"}
        The parameters' state sharded over the ranks that replicate them
        (:func:`disttensor_nn.optim.shard_state`), as :meth:`params_memory`
        counts it. Each layer's gradient sums over R > 1 ranks are priced as
        the stage runs them, with the profile's collectives
        (:meth:`~disttensor_nn.plan.MachineProfile.allreduce_terms`,
        :meth:`~disttensor_nn.plan.MachineProfile.allgather`,
        :meth:`~disttensor_nn.plan.MachineProfile.reduce_scatter`), for a
        gradient of G bytes and weights of W bytes (``nbytes`` and ``weights``
        of the layer's :class:`~disttensor_nn.costspec.Allreduce`):
        ``"none"``, the allreduce of G (bucketed, overlapped with backward
        where ``overlap`` is); ``"optimizer"``, the same and an all-gather of W
        after the step (blocking); ``"gradients"``, a reduce-scatter of G and
        that all-gather, both blocking; ``"full"``, the reduce-scatter of G
        and an all-gather of W before the layer's forward and again before
        its backward, hidden (with ``overlap``) up to the layer's own kernel
        time in each pass: the runtime starts it while the layer before runs,
        taken to run as long.
    state_slots : int
        Arrays of optimizer state per parameter: 1 for SGD with momentum
        (the default), 0 without, 2 for Adam and AdamW, 3 with AMSGrad.
    dtype : dtype, optional
        The activations' dtype, which the kernels are timed in and whose
        itemsize the activations, halos and messages count (bfloat16 or
        float16 under :func:`disttensor_nn.set_precision`); default the
        floating dtype of ``itemsize`` bytes. Parameters and their gradients
        count their own dtype's bytes.
    runs_as : callable, optional
        ``runs_as(dist)``: the distribution the runtime holds for a candidate's
        distribution ``dist`` (pure), where it differs: a runtime that never
        splits a dimension of length one (:func:`disttensor_nn.torch.pricing.as_run`)
        holds replicas there. Each layer is priced on it. The moves between two
        layers' distributions are priced on the candidates' own: a move into
        replicas waits for every rank, which its bytes do not show, and priced
        as a move between blocks it comes closer to what a step measures
        (``docs/performance.md``). Default: the candidate's own.
    """

    def __init__(self, profile: MachineProfile, nprocs: int, timer: KernelTimer | None = None,
                 itemsize: int = 4, overlap: bool | None = None, bucket_bytes: float = 2**20,
                 training: bool = True, backends: Sequence[str] | None = None,
                 shard_state: str = "none", state_slots: int = 1, dtype: Any = None,
                 runs_as: Callable[[Distribution], Distribution] | None = None):
        self.dtype = np.dtype(f"f{itemsize}" if dtype is None else dtype)
        self.runs_as = runs_as
        self.profile, self.nprocs, self.timer = profile, nprocs, timer
        self.itemsize = self.dtype.itemsize
        if shard_state not in STAGES:
            raise ValueError(f"unknown shard_state {shard_state!r}; the stages are "
                             f"{', '.join(STAGES)}")
        if isinstance(state_slots, bool) or not isinstance(state_slots, int) or \
                state_slots < 0:
            raise ValueError(f"state_slots must be an int >= 0, got {state_slots!r}")
        self.shard_state, self.state_slots = shard_state, state_slots
        if backends is not None:
            backends = tuple(backends)
            for b in backends:
                if b not in BACKENDS:
                    raise ValueError(f"unknown kernel backend {b!r}; expected some of "
                                     f"{list(BACKENDS)}")
        self.backends = backends
        self.training = bool(training)
        if overlap is None:
            overlap = not (profile.measured and profile.device == "cpu")
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.inner = "space"  # the grid axes inside a node (dist_for); the planner sets it
        # Ranks sharing a node's cores slow each other's kernels down. Kernel times
        # measured on all ranks at once include that; others are scaled by the
        # oversubscription of the cores.
        self.corun = nprocs if profile.measured else 1
        self.contention = max(1.0, nprocs / max(profile.cores_per_node, 1)) \
            if profile.measured else 1.0

    def held(self, dist: Distribution) -> Distribution:
        """The distribution the runtime holds for a candidate's ``dist``: ``runs_as``'s (a
        runtime that keeps some dimensions whole, say), or ``dist`` itself."""
        return dist if self.runs_as is None else self.runs_as(dist)

    # ------------------------------------------------------------ compute
    def _compute(self, layer: Layer, local_in: tuple[int, ...], flops: float,
                 nbytes: float, share: float = 1.0,
                 synced: bool = False) -> tuple[float, float, bool, bool]:
        if any(n == 0 for n in local_in):
            return 0.0, 0.0, False, False
        dtype = self.dtype
        if self.timer is not None:
            f, b, est, co = self.timer.times(layer, local_in, dtype, flops, self.corun,
                                             synced=synced)
            scale = (1.0 if co >= self.corun else self.contention) * share
            tiled = getattr(self.timer, "tiled", None)
            return f * scale, b * scale, est, bool(tiled and tiled(layer, local_in, dtype, co))
        p = self.profile
        t = p.kernel_time(flops * share, nbytes * share)  # backward: data and weights
        return t, 2 * t, True, False

    def variants(self, layer: Layer) -> list[Layer]:
        """``layer`` as it runs with each backend the model chooses among (itself if none)."""
        if self.backends is None or not layer.kernel_backends:
            return [layer]
        device = "gpu" if self.profile.device == "gpu" else "cpu"
        dtype = self.dtype
        # 16-bit blocks: the dtype each backend computes them in (float32 where it has no
        # 16-bit kernel)
        names = [b for b in self.backends if b in layer.kernel_backends and
                 layer_supports(layer, b, dtype, device)]
        return [with_backend(layer, b) for b in names] or [layer]

    def layer(self, layer: Layer, in_shape: tuple[int, ...], cand: Candidate,
              split_channels: bool = True, split_out: bool | None = None) -> LayerCost:
        """Cost of ``layer`` on an input of global ``in_shape`` split by ``cand``.

        The layer states its work (:meth:`~disttensor_nn.Layer.cost_spec`);
        this prices it on the machine profile, with kernel times from the
        timer where there is one. Under a grid over (N, C, S..),
        ``split_channels`` says whether the input's channels are split (or
        whole, replicated along the channel axis) and ``split_out`` the same
        of the output (default: as the input). With several kernel backends
        (``backends``) the fastest one's cost, forward and backward (forward
        alone in inference), named in :attr:`LayerCost.kernels`.
        """
        costs = [self._layer(v, in_shape, cand, split_channels, split_out)
                 for v in self.variants(layer)]
        return min(costs, key=lambda c: c.fwd + (c.bwd if self.training else 0.0))

    def _layer(self, layer: Layer, in_shape: tuple[int, ...], cand: Candidate,
               split_channels: bool, split_out: bool | None) -> LayerCost:
        dist = self.held(dist_for(in_shape, cand, split_channels, inner=self.inner))
        spec = layer.cost_spec(dist, self.itemsize)
        _check_spec(layer, spec, dist)
        out_shape = tuple(layer.output_shape(tuple(in_shape)))
        in_bytes = math.prod(largest_block(dist)) * self.itemsize
        split_out = split_channels if split_out is None else split_out
        out_bytes = in_bytes
        if len(out_shape) in (2, len(cand), len(cand) + 1):
            out_bytes = math.prod(largest_block(self.held(
                dist_for(out_shape, cand, split_out, inner=self.inner)))) * self.itemsize
        training = self.training
        copies = 0  # channels-last blocks: the calling protocol's copies for a layer that
        # takes none (its input in C order, its output put back; backward the same)
        if getattr(self.timer, "memory_format", "contiguous") == "channels_last" and \
                len(in_shape) in (4, 5) and not layer.takes_channels_last(dist):
            copies = in_bytes + out_bytes
        cost = LayerCost(memory=spec.kept(in_bytes, out_bytes, training),
                         transient=spec.transient(in_bytes, out_bytes, training) + copies,
                         keeps_input=in_bytes * spec.keeps_input * training,
                         keeps_output=out_bytes * spec.keeps_output * training,
                         kernels=(layer.kernel_backend or "numpy") if layer.kernel_backends
                         else "")
        if spec.timed:
            timed = layer if spec.twin is None else with_backend(spec.twin, layer.kernel_backend)
            cost.fwd, cost.bwd, cost.estimated, cost.tiled = self._compute(
                timed, spec.local_shape, spec.flops, spec.nbytes, spec.share,
                self._synced(spec))
        else:
            cost.fwd = cost.bwd = spec.nbytes / self.profile.mem_bandwidth
        passes = 2 if training else 1  # forward and backward, or forward alone
        if not training:
            cost.bwd = 0.0
        gathers = 0.0  # stage "full": the weights' all-gathers before forward and backward
        for a in spec.allreduces:
            if a.gradient and not training:
                continue
            spread = self._spread(dist, a.dims, a.axes)
            if a.gradient and spread[0] > 1 and self.shard_state != "none":
                gathered = self.profile.allgather(a.nbytes if a.weights is None else a.weights,
                                                  *spread)
                if self.shard_state != "optimizer":  # reduce-scattered, blocking
                    cost.comm += self.profile.reduce_scatter(a.nbytes, *spread)
                    if self.shard_state == "gradients":  # the updated pieces gathered
                        cost.comm += gathered
                    else:
                        gathers += gathered
                    continue
                cost.comm += gathered  # "optimizer": after the step, blocking
            lat, bw = self.profile.allreduce_terms(a.nbytes, *spread)
            if self.overlap and a.gradient:  # in a bucket with others
                cost.grad += lat * min(1.0, a.nbytes / self.bucket_bytes) + bw
            else:
                cost.comm += lat + bw
        cost.comm += cost.grad + 2 * gathers
        if spec.halo is not None:  # the exchange forward, its accumulation backward
            halo = self._halo(dist, spec.halo)
            cost.comm += passes * halo
            if getattr(layer, "overlap", False):  # interior kernels run meanwhile
                cost.hidden = min(halo, cost.fwd * _interior(dist, spec.halo)) + \
                    min(halo, cost.bwd / 2)  # backward: while the weight gradient computes
        for target in spec.redistributions:  # there forward, back backward
            cost.comm += passes * self.redistribution(dist, target)
        if gathers and self.overlap:  # each started while the layer before runs, taken
            # to run as long as this one (which hides halo traffic of its own only)
            cost.hidden += min(gathers, cost.fwd) + min(gathers, cost.bwd)
        return cost

    @staticmethod
    def _synced(spec: CostSpec) -> bool:
        """Whether a layer of cost ``spec`` is taken to wait for other ranks after each
        pass: where its kind of layer communicates at all (a halo, a sum over ranks, a
        redistribution), whether or not it does on this layout.

        Ranks drift apart in the layers between two waits and meet again at the
        next: a convolution whose block has no halo on one layout still runs
        between two batch norms that sum over the ranks, and its drift is paid
        at the second. Only layers that never communicate (element-wise ones)
        are taken at their kernel's time: on 4 ranks sharing 2 cores a ReLU's
        measured 0.5 ms in training against 2.0 ms with a barrier after it.
        """
        return bool(spec.halo is not None and any(lo or hi for lo, hi in spec.halo)) or \
            bool(spec.allreduces) or bool(spec.redistributions)

    def _spread(self, dist: Distribution, dims: Sequence[int],
                extra: Sequence[int] = ()) -> tuple[int, int]:
        axes = [a for d in dims for a in dist.dim_axes[d]] + list(extra)
        return ranks_per_node_of(dist, axes, self.profile.node_size)

    def _halo(self, dist: Distribution, widths: Sequence[tuple[int, int]]) -> float:
        """Forward halo exchange: dimension by dimension, both sides at once."""
        t = 0.0
        extent = list(largest_block(dist))
        for d in range(2, len(extent)):
            lo, hi = widths[d]
            if dist.nblocks[d] > 1 and (lo or hi):
                face = math.prod(extent[:d] + extent[d + 1:]) * self.itemsize
                p, local = self._spread(dist, [d])
                t += self.profile.p2p(face * max(lo, hi), inter=local < p)
            extent[d] += lo + hi
        return t

    # ------------------------------------------------------------ shuffles
    def shuffle(self, shape: tuple[int, ...], src: Distribution, dst: Candidate) -> float:
        """Time to redistribute an activation laid out as ``src`` to candidate ``dst``."""
        return self.redistribution(src, dist_for(shape, dst, inner=self.inner))

    def redistribution(self, src: Distribution, dst: Distribution) -> float:
        """Time to redistribute an activation from ``src`` to ``dst`` (pure distributions).

        The all-to-all of the largest number of elements one rank receives.
        """
        if dst.dim_axes == src.dim_axes and dst.grid_shape == src.grid_shape:
            return 0.0
        recv, peers = _received(src, dst)
        return self.profile.alltoall(recv * self.itemsize, peers,
                                     inter=self.nprocs > self.profile.node_size)

    def redistributions(self, srcs: Sequence[Distribution],
                        dsts: Sequence[Distribution]) -> np.ndarray:
        """:meth:`redistribution` from each of ``srcs`` to each of ``dsts``: a matrix.

        The same figures, computed for all destinations of a source at once
        (one all-to-all price per distinct (bytes, peers) pair).
        """
        out = np.zeros((len(srcs), len(dsts)))
        if not srcs or not dsts:
            return out
        recv = np.zeros(out.shape, dtype=np.int64)
        peers = np.zeros(out.shape, dtype=np.int64)
        dlo = np.stack([_all_boxes(d)[0] for d in dsts])  # (dsts, ndim, ranks)
        dhi = np.stack([_all_boxes(d)[1] for d in dsts])
        size = np.prod(dhi - dlo, axis=1)
        for i, src in enumerate(srcs):
            recv[i], peers[i] = _received_many(src, dlo, dhi, size)
        same = np.array([[d.dim_axes == s.dim_axes and d.grid_shape == s.grid_shape
                          for d in dsts] for s in srcs])
        inter = self.nprocs > self.profile.node_size
        pairs, where = np.unique(np.stack([recv.ravel(), peers.ravel()], axis=1), axis=0,
                                 return_inverse=True)
        price = np.array([self.profile.alltoall(int(r) * self.itemsize, int(q), inter=inter)
                          for r, q in pairs])
        out = price[where.ravel()].reshape(out.shape)
        out[same] = 0.0
        return out

    def redistribution_bounds(self, srcs: Sequence[Distribution], dsts: Sequence[Distribution],
                              ranks: np.ndarray) -> np.ndarray:
        """Lower bounds of :meth:`redistributions` from what ``ranks`` alone receive.

        The busiest rank receives at least what any of ``ranks`` does, from at
        least one peer, and an all-to-all costs no less for more bytes or peers.
        """
        recv = np.zeros((len(srcs), len(dsts)), dtype=np.int64)
        if not srcs or not dsts:
            return recv.astype(float)
        dlo = np.stack([_all_boxes(d)[0][:, ranks] for d in dsts])  # (dsts, ndim, ranks)
        dhi = np.stack([_all_boxes(d)[1][:, ranks] for d in dsts])
        size = np.prod(dhi - dlo, axis=1)
        for i, src in enumerate(srcs):
            slo, shi = (b[:, ranks] for b in _all_boxes(src))
            kept = np.prod(np.clip(np.minimum(dhi, shi[None]) - np.maximum(dlo, slo[None]), 0,
                                   None), axis=1)
            recv[i] = (size - kept).max(axis=1)
        inter = self.nprocs > self.profile.node_size
        values, where = np.unique(recv, return_inverse=True)
        price = np.array([self.profile.alltoall(int(r) * self.itemsize, 1, inter=inter)
                          for r in values])
        return price[where.ravel()].reshape(recv.shape)

    def params_memory(self, model: Layer, local_grads: Sequence[float] | None = None) -> float:
        """Bytes per rank of the parameters' state: in training the parameters, their
        gradients and momentum buffers, and the larger of what backward and the
        optimizer add to them; in inference the parameters alone.

        The runtime's gradient buckets hold every layer's local gradients from its
        backward to the end of backward (:class:`~disttensor_nn.module.GradientBuckets`),
        those under ``bucket_bytes`` also as a copy in a fused bucket, and on
        several ranks the MPI library's temporaries for the reductions in flight
        (:attr:`MachineProfile.reduce_scratch` per byte); ``local_grads`` gives
        their sizes (the layers' gradient allreduces, some summed in float64;
        default: the parameters' own sizes). The optimizer's
        update of one parameter makes a temporary of its size (Adam) or of a
        piece of it (SGD, :func:`disttensor_nn.optim.by_chunks`). Whole parameters:
        an upper bound where a plan shards some of them.

        With :attr:`shard_state` (:func:`disttensor_nn.optim.shard_state`) the
        ``state_slots`` arrays of optimizer state count ``1 / nprocs`` of
        their size (``"optimizer"``), and so do the reduced gradients
        (``"gradients"``), whose local parts are then reduced one layer at a
        time (a blocking Reduce_scatter: one layer's parts in flight), and
        the optimizer's temporaries are of a piece's size; ``"full"`` counts
        the weights so too, plus the two largest gathered whole (a layer's for
        its pass, the next layer's gathered meanwhile). Each parameter's
        piece is ``1 / nprocs`` of it whenever every grid axis splits the
        samples, space or the channels (a channel-sharded block of ``1 / c``
        is shared by ``nprocs / c`` ranks).

        The gradients held count every parameter's, though the weight
        gradients a kernel gives away are dropped at ``zero_grad``
        (:meth:`~disttensor_nn.Parameter.zero_grad`) and take no memory in the
        forward pass: a bound, which the C heap's scratch between the kernels'
        arrays, left out here, takes up (ResNet-18 at 112^2, batch 8, one rank:
        596-601 MiB measured against 603 predicted).
        """
        # the dtype's itemsize, not the data's: under sharded weights a rank holds a piece
        sizes = [math.prod(p.shape) * numpy_dtype(p.dtype).itemsize for p in model.parameters()]
        if not self.training:
            return float(sum(sizes))
        grads = sizes if local_grads is None else list(local_grads)
        stage = STAGES.index(self.shard_state)
        share = 1.0 / self.nprocs if stage >= 1 else 1.0
        if stage >= 2:  # reduce-scattered one layer at a time, blocking
            pending = max(grads, default=0.0)
            held = sum(sizes) * share
        else:
            pending = sum(grads) + sum(n for n in grads if n < self.bucket_bytes)
            held = sum(sizes)
        if self.nprocs > 1:  # the reductions in flight: the MPI library's temporaries
            pending += self.profile.reduce_scratch * (pending if stage >= 2 else sum(grads))
        state = self.state_slots * sum(sizes) * share
        weights = float(sum(sizes))
        if stage >= 3:  # 1/P of the weights; a layer's gathered for its pass, and the
            # next one's gathered meanwhile: at most the two largest whole
            weights = weights * share + sum(sorted(sizes)[-2:])
        # the update's temporaries: SGD's sweep over pieces needs a piece's scratch per
        # thread of the NumPy kernels, Adam's a temporary of the parameter's size
        temp = max(sizes, default=0) * share
        if self.state_slots < 2:
            temp = min(temp, CHUNK * get_num_threads() * max(
                (numpy_dtype(p.dtype).itemsize for p in model.parameters()), default=4))
        return float(weights + held + state + max(pending, temp))

    def update_time(self, model: Layer) -> float:
        """Seconds per training step of the optimizer's update of ``model``'s parameters
        (and their gradients zeroed for the next step), as the kernel timer measures it
        (:meth:`KernelTimer.update_time`: the optimizer that keeps ``state_slots`` arrays
        per parameter, this rank's pieces under sharded state, in the kernels
        :func:`~disttensor_nn.kernels.optimizer_backend` picks from the backends the
        layers choose among); 0 in inference and
        without a timer that measures it (rate profiles)."""
        update = getattr(self.timer, "update_time", None)
        if not self.training or update is None:
            return 0.0
        params = list(model.parameters())
        share = 1.0 / self.nprocs if STAGES.index(self.shard_state) >= 1 else 1.0
        elements = sum(math.prod(p.shape) for p in params) * share
        dtype = numpy_dtype(params[0].dtype) if params else np.dtype(np.float32)
        return update(self.state_slots, len(params), int(elements), dtype, self.corun,
                      optimizer_backend(self.backends))

    def local_gradient_bytes(self, layer: Layer, in_shape: tuple[int, ...]) -> list[float]:
        """Bytes of the local gradients ``layer`` hands to the reduction (its gradient
        allreduces under one rank: whole parameters)."""
        if not any(True for _ in layer.parameters()):
            return []
        nsp = max(len(in_shape) - 2, 0)
        spec = layer.cost_spec(dist_for(tuple(in_shape), (1,) * (nsp + 1), inner=self.inner),
                               self.itemsize)
        return [a.nbytes for a in spec.allreduces if a.gradient]


def same_placement(a: Distribution, b: Distribution) -> bool:
    """Whether every rank holds the same block under ``a`` and ``b`` (grids may differ)."""
    if a.global_shape != b.global_shape or a.nprocs != b.nprocs:
        return False
    return all(np.array_equal(x, y) for x, y in zip(_all_boxes(a), _all_boxes(b)))


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


def _interior(dist: Distribution, widths: Sequence[tuple[int, int]]) -> float:
    """Fraction of the largest block whose outputs need no halo cell."""
    frac = 1.0
    for d, (lo, hi) in enumerate(widths):
        if dist.nblocks[d] > 1 and (lo or hi):
            e = largest_block(dist)[d]
            frac *= max(0, e - lo - hi) / e
    return frac


@lru_cache(maxsize=4096)
def _all_boxes(dist: Distribution) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_boxes` of every rank (read-only arrays, shared by every caller)."""
    lo, hi = _boxes(dist, np.arange(dist.nprocs))
    lo.flags.writeable = hi.flags.writeable = False
    return lo, hi


def _over(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with its last (ranks) axis repeated cyclically to ``n`` ranks."""
    m = a.shape[-1]
    return a if m == n else np.take(a, np.arange(n) % m, axis=-1)


def _received_many(src: Distribution, dlo: np.ndarray, dhi: np.ndarray, size: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_received` from ``src`` to each destination whose blocks start at ``dlo``
    and stop at ``dhi`` (``(destinations, ndim, ranks)``, :func:`_all_boxes`), of
    ``size`` elements (``(destinations, ranks)``), all over the same ranks (or one
    side over a grid of one process: a block every rank holds)."""
    slo, shi = _all_boxes(src)
    # a layout over a grid of fewer processes (the small tensors' layouts over part of
    # the ranks, the others holding replicas; one process: every rank holds it whole) is
    # priced with its boxes repeated over the ranks
    n = max(dlo.shape[2], slo.shape[1])
    dlo, dhi, size = (_over(a, n) for a in (dlo, dhi, size))
    slo, shi = _over(slo, n), _over(shi, n)
    kept = np.prod(np.clip(np.minimum(dhi, shi[None]) - np.maximum(dlo, slo[None]), 0, None),
                   axis=1)
    need = size - kept
    r = np.argmax(need, axis=1)
    k = np.arange(len(dlo))
    most = need[k, r]
    peers = np.ones(len(dlo), dtype=np.int64)
    for d in range(src.ndim):
        b = np.asarray(src.boundaries[d])
        lo, hi = dlo[k, d, r][:, None], dhi[k, d, r][:, None]
        peers *= np.maximum(1, np.count_nonzero((b[None, :-1] < hi) & (b[None, 1:] > lo),
                                                axis=1))
    busy = most > 0
    return np.where(busy, most, 0), np.where(busy, np.maximum(1, peers - 1), 0)


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
    dlo, dhi = _all_boxes(dst)
    recv, peers = _received_many(src, dlo[None], dhi[None], np.prod(dhi - dlo, axis=0)[None])
    return int(recv[0]), int(peers[0])
