"""The kernel timer: measured times of layers' local kernels, and their cache on disk.

The cost model (:class:`~disttensor_nn.plan.CostModel`) asks a timer for the
forward and backward seconds of a layer's kernels on a local input shape
(:meth:`KernelTimer.times`). The timer runs the layer's 1-process twin
(:meth:`disttensor_nn.Layer.local_twin`) on this process, alone or a whole
network in sequence on every rank at once (:meth:`KernelTimer.measure_chain`),
and keeps the results in ``kernels-<machine>.json`` under the cache
directory, keyed by the layer's :meth:`~disttensor_nn.Layer.kernel_signature`,
the local shape, the dtype and how the time was taken. A
:class:`QueryRecorder` stands in for a timer to list what a cost model would
ask.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.backend import is_numpy

from ..kernels import kernels_for, synchronize
from ..module import Layer
from .machine import MachineProfile, default_cache_dir

__all__ = ["KernelTimer", "QueryRecorder", "machine_id"]


class KernelTimer:
    """Measured forward and backward times of layers' local kernels, cached on disk.

    Two kinds of measurement, each keyed by layer signature, local input
    shape and dtype and stored in ``cache_dir/kernels-<machine>.json`` so
    that it is taken once per machine:

    - *in sequence* (:meth:`measure_chain`): 1-process twins of a whole
      network's layers, at the local shapes of one candidate distribution,
      run forward in order and backward in reverse, as in a training
      iteration, on every rank of a communicator at once. Each layer then
      meets the caches, allocator state and memory-bandwidth sharing it meets
      in the network; a layer's time is the slowest rank's, median over
      repetitions. The number of ranks that ran at once is part of the key.
    - *alone* (:meth:`times` on a miss): the twin on its own, forward on a
      freshly written input and backward after the caches were flushed (what
      a layer sees when the rest of the network ran in between); fastest of
      ``reps`` runs.

    With ``measure=False`` a missing entry is estimated from the FLOP rate of
    measured entries of the same kind (the cost is then marked estimated).
    With ``xp`` (e.g. ``cupy``) the twins and their data live in that array
    module, and the device is synchronised before every clock reading
    (:func:`disttensor_nn.kernels.synchronize`); its name is part of the keys.
    """

    def __init__(self, machine: str, cache_dir: str | None = None, measure: bool = True,
                 reps: int = 5, xp: ModuleType | None = None):
        self.path = os.path.join(cache_dir or default_cache_dir(), f"kernels-{machine}.json")
        self.measure, self.reps = measure, reps
        self.xp = np if xp is None else xp
        self._where = "" if is_numpy(self.xp) else f"|{self.xp.__name__}"
        self.table: dict[str, list[float]] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.table = json.load(f)
        self._dirty = False

    def key(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
            corun: int = 0) -> str:
        """Cache key of a measurement: alone (``corun=0``) or in sequence on ``corun`` ranks."""
        where = f"seq{corun}" if corun else "alone"
        return (f"{layer.kernel_signature()}|{tuple(local_in)}|{np.dtype(dtype).str}|{where}"
                f"{self._where}")

    def times(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype,
              flops: float, corun: int = 1) -> tuple[float, float, bool, int]:
        """(forward s, backward s, estimated, ranks that ran at once) of ``layer``.

        An in-sequence measurement taken on ``corun`` ranks is preferred, then
        one taken in sequence on a single rank, then one of the twin alone
        (measured now if missing and ``measure`` is on); the last element
        says on how many ranks at once the time was taken, so that the
        caller can account for ranks sharing the node otherwise.
        """
        for co in dict.fromkeys((corun, 1)):
            entry = self.table.get(self.key(layer, local_in, dtype, co))
            if entry is not None:
                return entry[0], entry[1], False, co
        key = self.key(layer, local_in, dtype)
        if key in self.table:
            fwd, bwd = self.table[key][:2]
            return fwd, bwd, False, 1
        if self.measure:
            fwd, bwd = self._run(layer, local_in, dtype)
            self.table[key] = [fwd, bwd, flops]
            self._dirty = True
            return fwd, bwd, False, 1
        rate = self._rate(layer.kernel_signature().split(":")[0])
        return flops / rate, 2 * flops / rate, True, 1

    def _rate(self, kind: str) -> float:
        rates = [v[2] / max(v[0], 1e-9) for k, v in self.table.items()
                 if k.split(":")[0] == kind and len(v) > 2 and v[2] > 0]
        return statistics.median(rates) if rates else 5e9

    def _twin(self, layer: Layer) -> Layer:
        twin = layer.local_twin()
        return twin if is_numpy(self.xp) else twin.to(self.xp)

    def _clock(self) -> float:
        synchronize(self.xp)
        return time.perf_counter()

    def _run(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype) -> tuple[float, float]:
        if any(n == 0 for n in local_in):
            return 0.0, 0.0
        xp = self.xp
        twin = self._twin(layer)
        x = _self_array(xp.asarray(np.random.default_rng(0).standard_normal(local_in)
                                   .astype(dtype)))
        fwd, bwd = [], []
        for _ in range(self.reps + 1):
            x.local[...] = x.local
            t0 = self._clock()
            y = twin.forward(x)
            t1 = self._clock()
            dy = _self_array(xp.ones(y.local_shape, y.dtype))
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

    def measure_chain(self, queries: Sequence[tuple[Layer, tuple[int, ...], Any, float]],
                      comm: Any = None, reps: int = 3, max_seconds: float = 10.0) -> None:
        """Time a sequence of layers as in a training iteration (collective over ``comm``).

        ``queries`` lists, in network order, each layer with its local input
        shape, dtype and FLOP count (what
        :meth:`CostModel.layer <disttensor_nn.plan.CostModel.layer>` asks
        :meth:`times` for). Every rank of ``comm`` runs the same twins at the
        same time; the results, identical on every rank afterwards, are
        stored under the ``corun = comm size`` key. After one untimed round,
        rounds repeat ``reps`` times or until ``max_seconds`` have passed.

        When a node holds more of these ranks than it has cores, ranks wait at
        every synchronisation in training for peers that the operating system
        has descheduled; each layer's time then includes a barrier after it,
        so that this wait is measured too.
        """
        comm = MPI.COMM_SELF if comm is None else comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        oversubscribed = comm.allreduce(node.Get_size() > (os.cpu_count() or 1), op=MPI.LOR)
        node.Free()
        sync = comm.Barrier if oversubscribed else _nothing
        # empty blocks cost nothing (CostModel never asks for them)
        live = [i for i, (_, shape, _, _) in enumerate(queries) if all(n > 0 for n in shape)]
        xp = self.xp
        twins = [self._twin(queries[i][0]) for i in live]
        rng = np.random.default_rng(0)
        inputs = [xp.asarray(rng.standard_normal(queries[i][1]).astype(queries[i][2]))
                  for i in live]
        grads: list[np.ndarray | None] = [None] * len(live)
        fwd = np.zeros((reps, len(live)))
        bwd = np.zeros((reps, len(live)))
        start, done = time.perf_counter(), 0
        for r in range(-1, reps):
            comm.Barrier()
            outs, prev = [], None
            for j, twin in enumerate(twins):
                # the layer before wrote this input just now: hand its output on where
                # it fits, otherwise write a fresh copy (untimed)
                x = _self_array(prev if prev is not None and prev.shape == inputs[j].shape
                                else inputs[j].copy())
                t0 = self._clock()
                y = twin.forward(x)
                sync()
                t1 = self._clock()
                outs.append(y)
                prev = y.local
                if r >= 0:
                    fwd[r, j] = t1 - t0
            for j in reversed(range(len(twins))):
                y = outs.pop()
                if grads[j] is None:
                    grads[j] = xp.asarray(rng.standard_normal(y.local_shape).astype(y.dtype))
                dy = _self_array(grads[j].copy())  # the layer after wrote it just now
                t0 = self._clock()
                twins[j].backward(dy)
                sync()
                t1 = self._clock()
                if r >= 0:
                    bwd[r, j] = t1 - t0
            for twin in twins:
                twin.zero_grad()
            if r >= 0:
                done = r + 1
                stop = comm.allreduce(time.perf_counter() - start > max_seconds, op=MPI.LOR)
                if stop:
                    break
        del twins, inputs, grads, outs
        self._release_workspace()
        fwd, bwd = fwd[:done], bwd[:done]
        comm.Allreduce(MPI.IN_PLACE, fwd, op=MPI.MAX)  # a layer lasts until its slowest rank
        comm.Allreduce(MPI.IN_PLACE, bwd, op=MPI.MAX)
        samples: dict[str, list[tuple[float, float, float]]] = {}
        for j, i in enumerate(live):
            layer, shape, dtype, flops = queries[i]
            key = self.key(layer, shape, dtype, comm.Get_size())
            samples.setdefault(key, []).extend(
                (f, b, flops) for f, b in zip(fwd[:, j], bwd[:, j]))
        for key, vals in samples.items():
            self.table[key] = [statistics.median(v[0] for v in vals),
                               statistics.median(v[1] for v in vals), vals[0][2]]
        self._dirty = True

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


class QueryRecorder:
    """Stands in for a :class:`KernelTimer` and records what a cost model asks it.

    ``CostModel(profile, p, QueryRecorder())`` answers zero compute time; its
    ``queries`` then hold, in order, the ``(layer, local shape, dtype, flops)``
    that :meth:`KernelTimer.measure_chain` takes.
    """

    def __init__(self) -> None:
        self.queries: list[tuple[Layer, tuple[int, ...], np.dtype, float]] = []

    def times(self, layer: Layer, local_in: tuple[int, ...], dtype: np.dtype, flops: float,
              corun: int = 1) -> tuple[float, float, bool, int]:
        self.queries.append((layer, tuple(local_in), np.dtype(dtype), flops))
        return 0.0, 0.0, False, corun


def _nothing() -> None:
    pass


def _self_array(local: Any) -> DistArray:
    """``local`` as a DistArray on a 1-process grid."""
    grid = _self_grid(local.ndim)
    return DistArray(local, Distribution(local.shape, grid, tuple(range(local.ndim))))


def _evict_caches(nbytes: int = 64 * 2**20) -> None:
    """Write a buffer larger than the last-level cache so that earlier data is evicted.

    The buffer is freed again: memory held by the planner would be missing
    for training.
    """
    np.ones(nbytes // 8)


@lru_cache(maxsize=8)
def _self_grid(ndim: int) -> ProcessGrid:
    return ProcessGrid((1,) * ndim, MPI.COMM_SELF)


def machine_id(profile: MachineProfile) -> str:
    """A short identifier of a profile, for cache file names."""
    return hashlib.sha1(profile.name.encode()).hexdigest()[:8] + "-" + profile.name
