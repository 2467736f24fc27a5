"""The kernel timer: measured times of layers' local kernels, and their cache on disk.

The cost model (:class:`~disttensor_nn.plan.CostModel`) asks a timer for the
forward and backward seconds of a layer's kernels on a local input shape
(:meth:`KernelTimer.times`). The timer runs the layer's 1-process twin
(:meth:`disttensor_nn.Layer.local_twin`) on this process, alone or a whole
network in sequence on every rank at once (:meth:`KernelTimer.measure_chain`),
and keeps the results in ``kernels-v<CACHE_VERSION>-<machine>.json`` under the cache
directory, keyed by the layer's :meth:`~disttensor_nn.Layer.kernel_signature`,
the local shape, the dtype and how the time was taken. A
:class:`QueryRecorder` stands in for a timer to list what a cost model would
ask.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from disttensor import DistArray, Distribution, ProcessGrid, block_cache
from disttensor.backend import (
    array_namespace,
    device_of,
    empty_in_order,
    is_channels_last,
    is_numpy,
)
from disttensor.blockcache import active_block_cache

from ..costspec import CostSpec
from ..kernels import (
    kernels_for,
    layer_supports,
    synchronize,
    threads_now,
    torch_kernels,
    with_backend,
)
from ..layout import MEMORY_FORMATS, to_memory_format
from ..memory import release_free_memory
from ..module import Layer
from ..optim import SGD, Adam
from ..optim.optimizer import CHUNK
from ..parameter import Parameter
from ..window import WindowSpec
from .machine import MachineProfile, default_cache_dir

__all__ = ["KernelTimer", "QueryRecorder", "machine_id", "seconds_on_every_rank", "warm_up"]

WARM_ROUNDS = 2
"""Untimed rounds of a chain before the timed ones (:meth:`KernelTimer.measure_chain`; one
where the first takes more than a quarter of the time allowed). The first timed round after
a single one still faulted pages in and set up kernels: mesh-demo's chain on one rank, two
threads, 4,900 page faults in it against 140 in the next, and the kernels timed 1.3x the
training step's, whose median step comes well after its first."""

CACHE_VERSION = 16
"""Version of the kernels whose times the cache holds: raised when the local kernels change,
or what a time means, so that older times are not reused (they live in another file)."""

SYNCED = "|sync"
"""Suffix of a cache key whose entry is the time until every rank is done (a barrier after
the kernel), kept beside the kernel's own where ranks share cores (:meth:`KernelTimer.times`)."""


class KernelTimer:
    """Measured forward and backward times of layers' local kernels, cached on disk.

    Two kinds of measurement, each keyed by layer signature, local input
    shape and dtype and stored in ``cache_dir/kernels-v<CACHE_VERSION>-<machine>.json`` so
    that it is taken once per machine:

    - *in sequence* (:meth:`measure_chain`): 1-process twins of a whole
      network's layers, at the local shapes of the candidate distributions,
      run forward in order and backward in reverse, as in a training
      iteration, on every rank of a communicator at once. Each layer then
      meets the caches, allocator state and memory-bandwidth sharing it meets
      in the network; a layer's time is the slowest rank's, mean over
      repetitions where several ranks ran at once (a step lasts the sum of
      its layers' times and of their waits for each other, whose expectation
      is the sum of their means: on a machine whose cores are now and then
      taken by others the median would leave those spells out), and median
      over repetitions for one rank alone (its step is the sum of its own
      layers' times, and the step time the driver reports is a median over
      steps: one slow repetition of a layer would otherwise move the whole
      prediction).
      The number of ranks that ran at once is part of the key.
      Each distinct shape is timed once; large blocks are timed on a tile
      (:meth:`tile`, at most :attr:`tile_bytes` of input and
      :attr:`tile_flops`) and scaled by FLOPs, in segments that fit the
      memory budget, so measuring never needs the memory training needs.
    - *alone* (:meth:`times` on a miss): the twin on its own, forward on a
      freshly written input and backward after the caches were flushed (what
      a layer sees when the rest of the network ran in between); fastest of
      ``reps`` runs.

    With ``measure=False`` a missing entry is estimated from the FLOP rate of
    measured entries of the same kind (the cost is then marked estimated).
    With ``xp`` (e.g. ``cupy``) the twins and their data live in that array
    module, and the device is synchronised before every clock reading
    (:func:`disttensor_nn.kernels.synchronize`); its name is part of the keys,
    and so is a layer's ``kernel_backend`` other than NumPy's (each backend's
    kernels are timed apart, and the planner keeps the faster).
    With ``memory_format="channels_last"`` every 4-D or 5-D input and output
    gradient a twin is given lies channels-last
    (:func:`~disttensor_nn.layout.to_memory_format`, as the training driver
    puts a plan's input so), so that the layers that take such blocks are timed
    on them and the others with the copy the calling protocol makes for them;
    the format is part of the keys.
    """

    tile_bytes: float = 64 * 2**20
    """Largest input a twin is timed on; larger blocks are timed on a tile (:meth:`tile`)."""
    tile_flops: float = 4e9
    """Most forward FLOPs a twin is timed with; larger blocks are timed on a tile."""

    def __init__(self, machine: str, cache_dir: str | None = None, measure: bool = True,
                 reps: int = 5, xp: ModuleType | None = None,
                 memory_format: str = "contiguous"):
        if memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory_format must be one of {MEMORY_FORMATS}, got "
                             f"{memory_format!r}")
        self.path = os.path.join(cache_dir or default_cache_dir(),
                                 f"kernels-v{CACHE_VERSION}-{machine}.json")
        self.measure, self.reps = measure, reps
        self.memory_format = memory_format
        self.xp = np if xp is None else xp
        self._where = "" if is_numpy(self.xp) else f"|{self.xp.__name__}"
        self.table: dict[str, list[float]] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.table = json.load(f)
        self._dirty = False

    def key(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
            corun: int = 0) -> str:
        """Cache key of a measurement: alone (``corun=0``) or in sequence on ``corun`` ranks,
        with this rank's kernel threads now (:func:`~disttensor_nn.kernels.threads_now`): a
        time taken on two threads says nothing of one."""
        pool, blas = threads_now()
        where = (f"seq{corun}" if corun else "alone") + f"|t{pool}.{blas}"
        nodx = "" if layer.input_grad else "|nodx"  # backward without the input gradient
        kernels = layer.kernel_backend if layer.kernel_backend not in (None, "numpy") else ""
        layout = "|cl" if self.memory_format == "channels_last" and len(local_in) in (4, 5) \
            else ""
        return (f"{layer.kernel_signature()}{nodx}|{tuple(local_in)}|{np.dtype(dtype).str}|"
                f"{where}{self._where}" + (f"|{kernels}" if kernels else "") + layout)

    def _laid_out(self, a: DistArray) -> DistArray:
        """``a`` in this timer's memory format (4-D and 5-D arrays; others as they are)."""
        if self.memory_format == "contiguous" or a.ndim not in (4, 5):
            return a
        return to_memory_format(a, self.memory_format)

    def _order(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """How an array of ``shape`` lies in memory in this timer's format (None: C order)."""
        if self.memory_format == "contiguous" or len(shape) not in (4, 5):
            return None
        return (0, *range(2, len(shape)), 1)

    def times(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
              flops: float, corun: int = 1, synced: bool = False
              ) -> tuple[float, float, bool, int]:
        """(forward s, backward s, estimated, ranks that ran at once) of ``layer``.

        An in-sequence measurement taken on ``corun`` ranks is preferred, then
        one taken in sequence on a single rank, then one of the twin alone
        (measured now if missing and ``measure`` is on); the last element
        says on how many ranks at once the time was taken, so that the
        caller can account for ranks sharing the node otherwise.

        ``synced`` says whether the layer waits for the other ranks after each
        pass (it exchanges a halo or sums over them): where ranks share cores,
        the time until the slowest rank is done is then taken
        (:meth:`measure_chain` keeps both), else the kernel's own.
        """
        for co in dict.fromkeys((corun, 1)):
            key = self.key(layer, local_in, dtype, co)
            entry = self.table.get(key)
            if entry is not None:
                both = self.table.get(key + SYNCED) if synced else None
                fwd, bwd = (entry if both is None else both)[:2]
                return fwd, bwd, False, co
        key = self.key(layer, local_in, dtype)
        if key in self.table:
            fwd, bwd = self.table[key][:2]
            return fwd, bwd, False, 1
        if self.measure:
            tile = self.tile(layer, local_in)
            fwd, bwd = self._run(layer, tile, dtype)
            factor = self.scale(layer, local_in, tile)
            self.table[key] = [fwd * factor, bwd * factor, flops] + \
                (["tile"] if factor != 1.0 else [])
            self._dirty = True
            return fwd * factor, bwd * factor, False, 1
        rate = self._rate(layer.kernel_signature().split(":")[0])
        return flops / rate, 2 * flops / rate, True, 1

    update_elements: int = 2**22
    """Elements on which :meth:`update_time` times the per-element cost."""
    update_params: int = 64
    """Small parameters on which :meth:`update_time` times the per-parameter cost."""

    def update_key(self, slots: int, dtype: Any, corun: int = 0,
                   kernels: str | None = None) -> str:
        """Cache key of an optimizer update's costs (:meth:`update_time`): alone
        (``corun=0``) or on ``corun`` ranks at once, with this rank's threads now, in the
        optimizer's ``kernels`` (:attr:`~disttensor_nn.optim.Optimizer.kernel_backend`)."""
        pool, blas = threads_now()
        where = (f"seq{corun}" if corun else "alone") + f"|t{pool}.{blas}"
        backend = f"|{kernels}" if kernels not in (None, "numpy") else ""
        return f"update:{int(slots)}|{np.dtype(dtype).str}|{where}{backend}{self._where}"

    def update_time(self, slots: int, params: int, elements: int, dtype: Any = np.float32,
                    corun: int = 1, kernels: str | None = None) -> float:
        """Seconds of one optimizer step (and the gradients zeroed for the next) over
        ``params`` parameters of ``elements`` elements in all, of ``dtype``.

        ``slots`` arrays of state per parameter name the optimizer:
        :class:`~disttensor_nn.optim.SGD` without (0) and with momentum (1),
        :class:`~disttensor_nn.optim.Adam` (2), with AMSGrad (3). The cost is
        one per parameter plus one per element, timed on ``update_params``
        small parameters and on ``update_elements`` elements: on ``corun`` ranks
        at once where :meth:`measure_update` took it, else on one, else alone
        now (kept in the cache with the kernels; with ``measure`` off, 0); the
        optimizer's ``kernels`` are its ``kernel_backend``.
        """
        for co in dict.fromkeys((corun, 1, 0)):
            entry = self.table.get(self.update_key(slots, dtype, co, kernels))
            if entry is not None:
                break
        else:
            if not self.measure:
                return 0.0
            entry = self.table[self.update_key(slots, dtype, 0, kernels)] = \
                self._update_costs(slots, dtype, kernels)
            self._dirty = True
        per_param, per_element = entry[:2]
        return params * per_param + elements * per_element

    def update_bytes(self, slots: int, dtype: Any) -> float:
        """Bytes :meth:`measure_update` allocates: the parameter, its gradient and state."""
        return float((2 + slots) * self.update_elements * np.dtype(dtype).itemsize)

    def measure_update(self, slots: int, dtype: Any, comm: Any,
                       kernels: str | None = None) -> bool:
        """Time the update costs of :meth:`update_time` on every rank of ``comm`` at once
        (the slowest rank's), unless every rank has them for this many ranks already.
        Collective; whether anything was timed."""
        key = self.update_key(slots, dtype, comm.Get_size(), kernels)
        if not comm.allreduce(key not in self.table, op=MPI.LOR):
            return False
        comm.Barrier()
        costs = np.array(self._update_costs(slots, dtype, kernels))
        comm.Allreduce(MPI.IN_PLACE, costs, op=MPI.MAX)
        self.table[key] = [float(c) for c in costs]
        self._dirty = True
        return True

    def _update_costs(self, slots: int, dtype: Any, kernels: str | None = None
                      ) -> list[float]:
        """``[seconds per parameter, seconds per element]`` of the optimizer of ``slots``.

        The elements are timed on parameters of ``4 * CHUNK`` elements each
        (``update_elements`` in all, more than a cache holds), which the update sweeps
        as it sweeps a model's large parameters: over the threads (the NumPy kernels'
        pool in pieces, or PyTorch's with the torch kernels). Parameters under 128 KiB
        would take one piece on one thread and miss what the threads gain. (Their
        arrays, mapped by the C allocator, raise its mapping threshold to their size
        for the rest of planning; the training driver sets its own after planning.)
        """
        piece = 4 * CHUNK
        count = max(1, self.update_elements // piece)
        small = self._time_update(slots, [16] * self.update_params, dtype, kernels)
        per_param = small / self.update_params
        big = self._time_update(slots, [piece] * count, dtype, kernels)
        return [per_param, max(big - count * per_param, 0.0) / (count * piece)]

    def _time_update(self, slots: int, sizes: Sequence[int], dtype: Any,
                     kernels: str | None = None) -> float:
        """Median seconds of ``step()`` and ``zero_grad()`` of the optimizer of ``slots``
        (in ``kernels``) over parameters of ``sizes`` (their gradients filled, the state
        made first)."""
        xp = self.xp
        params = [Parameter(xp.zeros(n, dtype=dtype)) for n in sizes]
        for q in params:
            q.grad[...] = 1e-3
        opt = SGD(params, lr=1e-3, momentum=0.9 if slots else 0.0) if slots < 2 else \
            Adam(params, lr=1e-3, amsgrad=slots > 2)
        opt.kernel_backend = kernels
        runs = []
        for r in range(self.reps + 1):
            t0 = self._clock()
            opt.step()
            opt.zero_grad()
            t1 = self._clock()
            for q in params:
                q.grad[...] = 1e-3
            if r:  # the first makes the state
                runs.append(t1 - t0)
        return float(np.median(runs))

    def _rate(self, kind: str) -> float:
        rates = [v[2] / max(v[0], 1e-9) for k, v in self.table.items()
                 if k.split(":")[0] == kind and len(v) > 2 and v[2] > 0]
        return statistics.median(rates) if rates else 5e9

    def _twin(self, layer: Layer) -> Layer:
        twin = layer.local_twin()
        twin.input_grad = layer.input_grad  # a first layer's backward skips the input gradient
        twin.kernel_backend = layer.kernel_backend  # the kernels it is timed with
        twin.activation_dtype = layer.activation_dtype  # 16-bit blocks, float32 weights
        return twin if is_numpy(self.xp) else twin.to(self.xp)

    def _clock(self) -> float:
        synchronize(self.xp)
        return time.perf_counter()

    def _run(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype) -> tuple[float, float]:
        if any(n == 0 for n in local_in):
            return 0.0, 0.0
        xp = self.xp
        twin = self._twin(layer)
        x = self._laid_out(_self_array(xp.asarray(
            np.random.default_rng(0).standard_normal(local_in).astype(dtype))))
        fwd, bwd = [], []
        for _ in range(self.reps + 1):
            x.local[...] = x.local
            t0 = self._clock()
            y = twin.forward(x)
            t1 = self._clock()
            dy = self._laid_out(_self_array(xp.ones(y.local_shape, y.dtype)))
            _evict_caches()
            t2 = self._clock()
            twin.backward(dy)
            t3 = self._clock()
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
        del twin, x, y, dy
        self._release_workspace()
        return min(fwd[1:]), min(bwd[1:])

    def _release_workspace(self) -> None:
        # scratch buffers grown for measured shapes would stay allocated during training
        release = getattr(kernels_for(self.xp.zeros(1)), "release_workspace", None)
        if release is not None:
            release()

    def tile(self, layer: Layer, local_in: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``layer``'s twin is timed on in place of ``local_in``.

        ``local_in`` itself when its input is at most :attr:`tile_bytes` and
        its forward at most :attr:`tile_flops`; otherwise a block of fewer
        samples and a smaller, nearly square spatial extent that is within
        both (and no smaller than the layer's window needs). The time
        measured on the tile is scaled to ``local_in`` by the ratio of the
        forward FLOPs (:meth:`scale`), so big layers are timed in bounded
        memory and time, and layers whose large local blocks share a tile are
        timed once.
        """
        shape = tuple(local_in)
        elems = math.prod(shape)
        flops = max(_flops(layer, shape), float(elems))
        cap = min(self.tile_bytes / 4, elems * self.tile_flops / flops)  # elements
        if elems <= cap or len(shape) < 3:
            return shape
        n, c, spatial = shape[0], shape[1], shape[2:]
        per_sample = c * math.prod(spatial)
        n = max(1, min(n, int(cap // per_sample)))
        if n * per_sample <= cap:
            return (n, c, *spatial)
        least = _least_spatial(layer, shape)
        side = max(1, int((cap / c) ** (1 / len(spatial))))
        tile = [max(lo, min(s, side)) for s, lo in zip(spatial, least)]
        # dimensions shorter than the side leave room for the others
        for d in sorted(range(len(spatial)), key=lambda d: spatial[d]):
            rest = cap / (c * math.prod(tile[:d] + tile[d + 1:]))
            tile[d] = max(least[d], min(spatial[d], int(rest)))
        return (1, c, *tile)

    @staticmethod
    def scale(layer: Layer, local_in: tuple[int, ...], tile: tuple[int, ...]) -> float:
        """Factor from the time on ``tile`` to the time on ``local_in``: the FLOPs' ratio."""
        if tuple(tile) == tuple(local_in):
            return 1.0
        full = _flops(layer, tuple(local_in)) or float(math.prod(local_in))
        part = _flops(layer, tuple(tile)) or float(math.prod(tile))
        return full / max(part, 1.0)

    def tiled(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
              corun: int = 1) -> bool:
        """Whether the cached time of ``layer`` on ``local_in`` was scaled from a tile."""
        for co in dict.fromkeys((corun, 1, 0)):
            entry = self.table.get(self.key(layer, local_in, dtype, co))
            if entry is not None:
                return len(entry) > 3 and entry[3] == "tile"
        return False

    def measure_chain(self, queries: Sequence[tuple[Layer, tuple[int, ...], Any, float]],
                      comm: Any = None, reps: int = 3, max_seconds: float = 10.0,
                      memory: float | None = None, progress: bool = False) -> int:
        """Time a sequence of layers as in a training iteration (collective over ``comm``).

        ``queries`` lists, in network order, each layer with its local input
        shape, dtype and FLOP count (what
        :meth:`CostModel.layer <disttensor_nn.plan.CostModel.layer>` asks
        :meth:`times` for). Every rank of ``comm`` runs the same twins at the
        same time; the results, identical on every rank afterwards, are
        stored under the ``corun = comm size`` key.

        Each distinct (signature, shape, dtype) is timed once: entries
        already in the cache and repeats are skipped, and large blocks are
        timed on a tile (:meth:`tile`) and scaled by FLOPs (marked so,
        :meth:`tiled`). The chain is run in segments whose twins' arrays fit
        ``memory`` bytes (a quarter of it, at most 1 GiB; every twin and
        array of a segment is released before the next): forward in order,
        backward in reverse, untimed rounds (:data:`WARM_ROUNDS`), then rounds until ``reps``
        were taken or the segment's share of ``max_seconds`` has passed (at
        least one). Each layer's input is newly written before its forward
        (the layer before wrote it), but the first layer's (the first query's
        layer and its copies for other kernel backends, on every layout asked),
        which is read out of the caches, as the data loader's block is in
        training.

        When a node holds more of these ranks than it has cores, ranks wait at
        every synchronisation in training for peers that the operating system
        has descheduled; each layer is then followed by a barrier, and its time
        until the barrier is passed is kept too (under the key with
        :data:`SYNCED`), for the layers that synchronise in the layout priced
        (:meth:`times`); the others' waits fall to the next that does, as in
        training. Returns the number of distinct shapes timed.
        """
        _twins[0] = weakref.WeakKeyDictionary()  # released when the chain is timed
        try:
            return self._measure_chain(queries, comm, reps, max_seconds, memory, progress)
        finally:
            _twins[0] = None

    def _measure_chain(self, queries: Sequence[tuple[Layer, tuple[int, ...], Any, float]],
                       comm: Any, reps: int, max_seconds: float, memory: float | None,
                       progress: bool) -> int:
        comm = MPI.COMM_SELF if comm is None else comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        oversubscribed = comm.allreduce(node.Get_size() > (os.cpu_count() or 1), op=MPI.LOR)
        node.Free()
        sync = comm.Barrier if oversubscribed else _nothing
        corun = comm.Get_size()
        queries = [(layer, tuple(shape), dtype, flops) for layer, shape, dtype, flops in queries]
        keys = [self.key(layer, shape, dtype, corun) for layer, shape, dtype, _ in queries]
        # what any rank lacks is timed on every rank: the ranks' caches may differ (a cache
        # per node, a file rewritten between loads), their timing rounds must not
        missing = np.array([key not in self.table for key in keys], dtype=np.int8)
        comm.Allreduce(MPI.IN_PLACE, missing, op=MPI.MAX)
        jobs: dict[str, _Job] = {}
        for (layer, shape, dtype, flops), key, miss in zip(queries, keys, missing):
            if any(n == 0 for n in shape) or not miss:
                continue  # empty blocks cost nothing (CostModel never asks for them)
            tile = self.tile(layer, shape)
            tkey = self.key(layer, tile, dtype, corun)
            job = jobs.setdefault(tkey, _Job(layer, tile, np.dtype(dtype),
                                             _flops(layer, tile), {}))
            job.targets[key] = (self.scale(layer, shape, tile), flops)
        if not jobs:
            return 0
        # the first layer reads the data loader's block (on each layout asked), which no
        # layer wrote just before it: its input is timed out of the caches
        origin = _origin(queries[0][0])  # its copies for other backends share its parameters
        first = {key for (layer, *_), key in zip(queries, keys) if _origin(layer) == origin}
        for job in jobs.values():
            job.cold_input = not first.isdisjoint(job.targets)
        limit = min(2.0**30, (memory or 4 * 2.0**30) / 4)
        segments: list[list[_Job]] = [[]]
        used = 0.0
        for job in jobs.values():
            need = job.memory()
            if segments[-1] and used + need > limit:
                segments.append([])
                used = 0.0
            segments[-1].append(job)
            used += need
        bar = tqdm(total=len(jobs), desc="timing kernels", unit="shape", leave=False,
                   disable=True if (comm.Get_rank() or not progress) else None)
        for segment in segments:  # the time allowed is shared by the segments' sizes
            self._run_segment(segment, comm, sync, reps,
                              max_seconds * len(segment) / len(jobs), int(min(limit, 2**26)))
            bar.update(len(segment))
        bar.close()
        for tkey, job in jobs.items():
            fwd, bwd = job.result
            self.table[tkey] = [fwd, bwd, job.targets.get(tkey, (1.0, job.flops))[1]]
            for key, (factor, flops) in job.targets.items():
                if key != tkey:
                    self.table[key] = [fwd * factor, bwd * factor, flops, "tile"]
            if job.synced is not None:
                for key, (factor, _) in {tkey: (1.0, 0.0), **job.targets}.items():
                    self.table[key + SYNCED] = [t * factor for t in job.synced]
        self._dirty = True
        return len(jobs)

    def _run_segment(self, jobs: list[_Job], comm: Any, sync: Any, reps: int,
                     max_seconds: float, evict_bytes: int = 2**26) -> None:
        """Time ``jobs`` in order (forward, then backward in reverse) on every rank at once
        (a first layer's input out of the caches: ``evict_bytes`` written over them)."""
        xp = self.xp
        twins = [self._twin(job.layer) for job in jobs]
        # one source of random values, copied into each input and gradient just before use
        # ("the layer before wrote it just now") and never kept per layer
        largest = max(max(math.prod(job.shape), math.prod(job.out_shape)) for job in jobs)
        source = xp.asarray(np.random.default_rng(0).standard_normal(largest)
                            .astype(np.float32))
        # [kernel, until the barrier after it] x (reps, layers): equal without a barrier
        fwd = np.zeros((2, reps, len(jobs)))
        bwd = np.zeros((2, reps, len(jobs)))
        start, done = 0.0, 0
        synced = sync is not _nothing
        # the blocks come from a cache, reused from one repetition to the next, as the
        # training driver's steps reuse theirs (no page faults after the untimed rounds)
        with block_cache(2**31) if is_numpy(xp) else contextlib.nullcontext():
            r = -WARM_ROUNDS
            start = time.perf_counter()
            while r < reps:
                comm.Barrier()
                if r == 0:
                    start = time.perf_counter()  # the untimed rounds take no share
                outs: list[Any] = []
                prev = None
                for j, (job, twin) in enumerate(zip(jobs, twins)):
                    if prev is not None and prev.shape == job.shape and \
                            prev.dtype == job.dtype and (self._order(job.shape) is None) != \
                            is_channels_last(prev):  # in this timer's format
                        x = _self_array(prev)  # the layer before wrote it just now
                    else:
                        x = _self_array(_fresh(source, job.shape, job.dtype,
                                               self._order(job.shape)))
                        if job.cold_input:
                            _evict_caches(evict_bytes)
                    prev = None
                    t0 = self._clock()
                    y = twin.forward(x)
                    t1 = self._clock()
                    sync()
                    t2 = self._clock() if synced else t1
                    del x
                    outs.append(y)
                    prev = y.local
                    if r >= 0:
                        fwd[:, r, j] = t1 - t0, t2 - t0
                prev = None
                for j in reversed(range(len(jobs))):
                    y = outs.pop()
                    # in the output's layout, as the layer after gives it back
                    dy = _self_array(_fresh(source, y.local_shape, y.dtype, self._order(
                        y.local_shape) if is_channels_last(y.local) else None))
                    del y
                    t0 = self._clock()
                    twins[j].backward(dy)
                    t1 = self._clock()
                    sync()
                    t2 = self._clock() if synced else t1
                    del dy
                    if r >= 0:
                        bwd[:, r, j] = t1 - t0, t2 - t0
                for twin in twins:
                    twin.zero_grad()
                if r >= 0:
                    done = r + 1
                    if comm.allreduce(time.perf_counter() - start > max_seconds, op=MPI.LOR):
                        break
                elif comm.allreduce(time.perf_counter() - start > max_seconds / 4, op=MPI.LOR):
                    r = -1  # a long round warms up enough: the timed rounds follow
                r += 1
            del outs
        del twins, source
        self._release_workspace()
        release_free_memory()
        fwd, bwd = np.ascontiguousarray(fwd[:, :done]), np.ascontiguousarray(bwd[:, :done])
        comm.Allreduce(MPI.IN_PLACE, fwd, op=MPI.MAX)  # a layer lasts until its slowest rank
        comm.Allreduce(MPI.IN_PLACE, bwd, op=MPI.MAX)
        # the expected step of ranks that wait for each other; one rank's median step
        estimate = np.mean if comm.Get_size() > 1 else np.median
        for j, job in enumerate(jobs):
            job.result = (float(estimate(fwd[0, :, j])), float(estimate(bwd[0, :, j])))
            if synced:
                job.synced = (float(np.mean(fwd[1, :, j])), float(np.mean(bwd[1, :, j])))

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


def warm_up(layers: Sequence[tuple[Layer, tuple[int, ...]]], dtype: Any = np.float32,
            backends: Sequence[str | None] = (None,)) -> None:
    """Run every layer's local kernels once, forward and backward, on one small sample.

    ``layers`` pairs each layer with its global input shape ``(N, C, S..)``.
    Each runs as a 1-process twin (:meth:`~disttensor_nn.Layer.local_twin`)
    on one sample of its channels and a small spatial extent (at least its
    window), in network order, on this process alone. What stays resident
    afterwards is what every training step holds besides its arrays: the
    code of the kernels and of the libraries under them (BLAS, the array
    module) and the buffers those keep, so that a process baseline measured
    after it includes them. The kernels' scratch and the arrays are freed.
    A layer with kernels in several of ``backends`` (names of
    :data:`disttensor_nn.kernels.BACKENDS`; None: the layer's own) runs in
    each, so that every library a plan may choose is loaded too.
    """
    queries = []
    # (a backend that cannot run the layer's blocks of ``dtype`` is left out: never chosen)
    variants = [with_backend(layer, b) if b in layer.kernel_backends and layer_supports(
        layer, b, dtype) else layer
        for layer, _ in layers for b in backends]
    shapes = [shape for _, shape in layers for _ in backends]
    seen: set[int] = set()
    for layer, shape in zip(variants, shapes):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        spec = getattr(layer, "spec", None)
        pads = [lo + hi for lo, hi in spec.padding] if isinstance(spec, WindowSpec) \
            else [0] * (len(shape) - 2)
        # the twin runs on the padded block (window layers drop their padding)
        queries.append((layer, tuple(shape[:2]) + tuple(n + p for n, p in zip(shape[2:], pads)),
                        np.dtype(dtype), 0.0))
    timer = KernelTimer("warm-up", cache_dir=os.devnull, measure=False)  # never read or saved
    timer.tile_bytes = 0.0  # every block is cut to its smallest tile: one sample, short sides
    timer.measure_chain(queries, MPI.COMM_SELF, reps=1)
    del timer
    gc.collect()  # the twins' parameters sit in reference cycles
    release_free_memory()


class QueryRecorder:
    """Stands in for a :class:`KernelTimer` and records what a cost model asks it.

    ``CostModel(profile, p, QueryRecorder())`` answers zero compute time; its
    ``queries`` then hold, in order, the ``(layer, local shape, dtype, flops)``
    that :meth:`KernelTimer.measure_chain` takes.
    """

    def __init__(self) -> None:
        self.queries: list[tuple[Layer, tuple[int, ...], np.dtype, float]] = []

    def times(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype, flops: float,
              corun: int = 1, synced: bool = False) -> tuple[float, float, bool, int]:
        self.queries.append((layer, tuple(local_in), np.dtype(dtype), flops))
        return 0.0, 0.0, False, corun


@dataclass
class _Job:
    """One distinct (signature, shape, dtype) to time, and the cache keys its time answers."""

    layer: Layer
    shape: tuple[int, ...]
    dtype: np.dtype
    flops: float
    targets: dict[str, tuple[float, float]]  # key -> (time factor, FLOPs of that key's block)
    result: tuple[float, float] = (0.0, 0.0)
    synced: tuple[float, float] | None = None  # until the barrier after it, where there is one
    cold_input: bool = False  # the network's first layer: its input comes from memory

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(_metadata_twin(self.layer).output_shape(self.shape))

    def memory(self) -> float:
        """Bytes the twin needs between its forward and backward, and while running them."""
        spec = _spec(self.layer, self.shape)
        io = (math.prod(self.shape) + 2 * math.prod(self.out_shape)) * self.dtype.itemsize
        return io + spec.saved + spec.workspace


# twins for shapes and cost specs while measure_chain runs (None: not kept)
_twins: list[weakref.WeakKeyDictionary | None] = [None]


def _metadata_twin(layer: Layer) -> Layer:
    """``layer.local_twin()`` for shapes and cost specs, never run. While
    :meth:`KernelTimer.measure_chain` runs, one per layer is kept (again when its kernel
    signature changes): building one draws its weights, and the chain asks many times."""
    cache = _twins[0]
    if cache is None:
        return layer.local_twin()
    signature = layer.kernel_signature()
    entry = cache.get(layer)
    if entry is None or entry[0] != signature:
        entry = cache[layer] = (signature, layer.local_twin())
    return entry[1]


def _spec(layer: Layer, shape: tuple[int, ...]) -> CostSpec:
    """The cost spec of ``layer``'s twin on a whole local block of ``shape`` (one process)."""
    nd = len(shape)
    return _metadata_twin(layer).cost_spec(Distribution(shape, (1,) * nd, tuple(range(nd))))


def _flops(layer: Layer, shape: tuple[int, ...]) -> float:
    """Forward FLOPs of ``layer``'s twin on a local block of ``shape``."""
    return float(_spec(layer, shape).flops)


def _least_spatial(layer: Layer, shape: tuple[int, ...]) -> list[int]:
    """Smallest spatial extent worth timing: 32 (short rows are not measured) or the
    layer's window span (kernel with dilation) if longer, at most the block's own."""
    spec = getattr(layer, "spec", None)
    spans = [d * (k - 1) + 1 for k, d in zip(spec.kernel, spec.dilation)] \
        if isinstance(spec, WindowSpec) else [1] * (len(shape) - 2)
    return [min(n, max(32, span)) for n, span in zip(shape[2:], spans)]


def _fresh(source: Any, shape: tuple[int, ...], dtype: Any,
           order: tuple[int, ...] | None = None) -> Any:
    """A newly written array of ``shape`` filled from ``source`` (random values; sized
    to the largest input or output of the segment, so it holds enough), its axes lying in
    memory in ``order`` (:func:`~disttensor.backend.empty_in_order`; None: C order).

    Inside a block cache (NumPy) the array is one of its blocks, as a layer's
    input and output gradient are in training: from the C heap, it would move
    the heap's top under the kernels' scratch, faulting pages in that the
    training step does not. Where PyTorch is loaded and runs several threads,
    they write it.
    """
    values = source[:math.prod(shape)].reshape(shape)
    out = empty_in_order(array_namespace(values), tuple(shape), dtype, order,
                         device_of(values))
    if active_block_cache() is not None and is_numpy(values) and \
            torch_kernels.loaded() and torch_kernels.num_threads() > 1:
        # written over PyTorch's threads, as the layer before in training writes it: each
        # thread's part in its own core's cache (one-rank mesh-demo on two threads: the
        # plan's step 75.0 ms against 66 measured when one thread wrote it, 71.0 now)
        torch_kernels.copy_(out, values)
    else:
        out[...] = values
    return out


def seconds_on_every_rank(fn: Callable[[], Any], comm: Any, reps: int = 5) -> float:
    """Seconds ``fn()`` takes run on every rank of ``comm`` at once (after a barrier each
    time): the slowest rank's median of ``reps`` calls after an untimed one, the same on
    every rank (collective)."""
    times = []
    for _ in range(reps + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(comm.allreduce(statistics.median(times[1:]), op=MPI.MAX))


def _nothing() -> None:
    pass


def _self_array(local: Any) -> DistArray:
    """``local`` as a DistArray on a 1-process grid, laid out as a one-rank job lays out its
    blocks: the samples over the grid's axis and no other dimension on one.

    A dimension on a grid axis of one rank is still a split dimension to the layers that
    ask which axes split it: the channels on one made a convolution's twin run the
    channel-parallel path (a gather of its input's channels and a sum of its partial
    outputs, copies the layer never makes: the mesh model's 16 -> 16 convolution on
    (4, 16, 128, 128) channels-last blocks, two threads, timed 2.8 / 5.2 ms forward /
    backward against 1.7 / 3.3 as it runs)."""
    axes = (0,) + (None,) * (local.ndim - 1) if local.ndim else ()
    return DistArray(local, Distribution(local.shape, _self_grid(), axes))


def _origin(layer: Layer) -> tuple[int, ...]:
    """What identifies ``layer`` and the planner's copies of it for other kernel backends
    (:func:`~disttensor_nn.kernels.with_backend`): its parameters, or itself without."""
    own = tuple(id(p) for p in layer.own_parameters())
    return own or (id(layer),)


def _evict_caches(nbytes: int = 64 * 2**20) -> None:
    """Write a buffer larger than the last-level cache so that earlier data is evicted.

    The buffer is freed again: memory held by the planner would be missing
    for training.
    """
    np.ones(nbytes // 8)


@lru_cache(maxsize=1)
def _self_grid() -> ProcessGrid:
    return ProcessGrid((1,), MPI.COMM_SELF)


def machine_id(profile: MachineProfile) -> str:
    """A short identifier of a profile, for cache file names."""
    return hashlib.sha1(profile.name.encode()).hexdigest()[:8] + "-" + profile.name
