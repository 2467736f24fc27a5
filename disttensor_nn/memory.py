"""Resident memory of this process: current, peak, available, and a profile by phase and layer.

The figures come from the operating system (``/proc/self/status`` and
``/proc/meminfo`` on Linux, ``getrusage`` elsewhere), so they count what
the job really holds: NumPy arrays, MPI buffers, the interpreter. A
:class:`MemoryProfile` resets the kernel's peak counter at each phase and
layer boundary (``/proc/self/clear_refs``), so the peak of each phase
(data, calibration, kernel measurement, planning, forward, backward,
optimizer) and of each layer's forward and backward is its own; with
``tracemalloc`` on it also lists the largest allocations alive at the
training step's peak. Each restart first folds the peak so far into the
profile's whole-run figure (:meth:`MemoryProfile.peak`), so a peak outside
every phase still counts; creating a profile restarts nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["resident_bytes", "peak_resident_bytes", "reset_peak", "available_bytes",
           "release_free_memory", "free_heap_bytes", "map_large_allocations", "keep_heap_top",
           "HEAP_TOP_KEPT", "MALLOPT_MAX",
           "MemoryProfile", "PhaseMemory"]

_PAGE = resource.getpagesize()


def _status(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> int:
    """Bytes of this process resident in memory now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """Peak resident bytes of this process since it started or since :func:`reset_peak`."""
    hwm = _status("VmHWM")
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak() -> bool:
    """Start a new peak (Linux); returns whether the operating system allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> int | None:
    """Memory the operating system can still give processes (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes the C allocator holds free in its heaps, resident or not (glibc's
    ``mallinfo2().fordblks``, all arenas), or None where it cannot say."""
    info = getattr(_LIBC, "mallinfo2", None)
    if info is None:
        return None
    info.restype = _MallInfo2
    return int(info().fordblks)


def release_free_memory(keep: int = 0, if_above: int | None = None) -> bool:
    """Give the memory the C allocator keeps after frees back to the operating system.

    Arrays freed by one phase (the planner's kernel measurement) would
    otherwise stay resident in the allocator's heap. Returns whether memory
    was given back (False where the allocator cannot: glibc's ``malloc_trim``).

    Parameters
    ----------
    keep : int
        Free bytes left resident at the top of the main heap, where the
        next arrays are carved (the training driver keeps the kernels'
        scratch there between steps, so that it is not faulted in afresh
        each step). Free pages below the top, and the heaps of other
        threads, are given back whatever ``keep`` is.
    if_above : int, optional
        Give back only when the allocator holds more than this many bytes
        free (:func:`free_heap_bytes`; always where it cannot say): below
        that, what a step freed is what the next step takes again, warm
        (each page given back would be faulted in anew; a training step
        of the mesh model on two ranks took 62 ms with a trim before each
        step against 51 without, at the same resident peak). The count
        includes pages given back before, whose chunks stay free: the
        training driver's bound is what was free after its last give-back
        plus ``keep`` (``training.loop.Batches``), not a fixed one.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be a non-negative number of bytes, got {keep!r}")
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return False
    if if_above is not None:
        free = free_heap_bytes()
        if free is not None and free <= if_above:
            return False
    trim(ctypes.c_size_t(keep))
    return True


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

MALLOPT_MAX = 2**31 - 1
"""The largest size :func:`map_large_allocations` and :func:`keep_heap_top` set (``mallopt``
takes a C ``int``); larger ones are set to it."""


def map_large_allocations(threshold: int = 2**20) -> bool:
    """Have the C allocator map every allocation of ``threshold`` bytes or more on its own.

    glibc raises its mapping threshold each time a mapped block is freed (up
    to 32 MiB), after which arrays of a few MiB come from the heap, and the
    heap keeps the pages of freed arrays resident wherever a live one sits
    above them: a process whose activations come and go layer after layer
    (a network's forward pass) then holds far more than its live arrays. A
    fixed threshold makes every large array its own mapping, returned to the
    operating system when the array is freed, so the resident peak follows
    the live arrays (what the planner's memory model counts); the cost is a
    page fault per 4 KiB page of each new large array. Returns whether the
    allocator supports it (glibc's ``mallopt``).

    Some glibc versions refuse a threshold above 32 MiB (the largest their
    own adjustment reaches); there 32 MiB is set instead.

    Parameters
    ----------
    threshold : int
        Bytes from which an allocation is mapped on its own.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    value = min(threshold, MALLOPT_MAX)
    if mallopt(_M_MMAP_THRESHOLD, value):
        return True
    return value > 2**25 and bool(mallopt(_M_MMAP_THRESHOLD, 2**25))


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter

HEAP_TOP_KEPT = 2**26
"""Free bytes at the top of the C heap that :func:`keep_heap_top` lets ``free`` keep."""


def keep_heap_top(nbytes: int = HEAP_TOP_KEPT) -> bool:
    """Let the C allocator keep up to ``nbytes`` of free memory at the top of its heap.

    With a fixed mapping threshold (:func:`map_large_allocations`) glibc gives the
    heap's free top back to the operating system on every ``free`` that leaves
    more than 128 KiB there, so scratch arrays of a few MiB made and dropped in
    turn (a data set's synthesis, a kernel's temporaries) fault their pages in
    afresh each time. Above this, :func:`release_free_memory` still gives
    everything back when asked (the training driver asks before every step).
    Measured on mesh-demo, 2 ranks of 2 cores, with the block cache: the wait
    for a synthesised batch 135.1 ms per step by default, 28.7 ms with 64 MiB
    kept, the step's peak 332.4 against 333.8 MiB. Returns whether the
    allocator supports it.

    Parameters
    ----------
    nbytes : int
        Free bytes the heap's top may hold between trims.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, min(nbytes, MALLOPT_MAX)))


@dataclass
class PhaseMemory:
    """Resident bytes of one phase or one layer's pass: peak, at the start and at the end."""

    name: str
    peak: int = 0
    start: int = 0
    end: int = 0
    seconds: float = 0.0
    calls: int = 0
    top: list[tuple[str, int]] = field(default_factory=list)  # (where, bytes) at the peak

    def as_dict(self) -> dict[str, Any]:
        mib = 2.0**20
        d: dict[str, Any] = {"name": self.name, "peak_MiB": self.peak / mib,
                             "start_MiB": self.start / mib, "end_MiB": self.end / mib,
                             "seconds": self.seconds, "calls": self.calls}
        if self.top:
            d["largest_allocations"] = [{"where": w, "MiB": b / mib} for w, b in self.top]
        return d


class MemoryProfile:
    """Peak resident memory by phase and by layer, for one process.

    ``with profile.phase("planning"): ...`` records the phase's peak;
    phases may nest (an outer phase's peak includes its inner ones). A phase
    entered again (``forward`` at every step) keeps the largest peak.
    :meth:`watch` adds forward and backward hooks to layers so that each
    layer's passes are phases of their own (named ``"<name> forward"``).
    With ``top > 0``, ``tracemalloc`` runs and, each time a phase named in
    ``snapshot_phases`` reaches a new peak at a layer boundary, the ``top``
    largest allocation sites alive then are kept.

    Parameters
    ----------
    top : int
        How many allocation sites to list at the training step's peaks (0: no
        tracemalloc).
    snapshot_phases : tuple of str
        The phases whose peaks get the list of allocation sites.
    """

    def __init__(self, top: int = 0,
                 snapshot_phases: tuple[str, ...] = ("forward", "backward")):
        self.phases: dict[str, PhaseMemory] = {}
        self.layers: dict[str, PhaseMemory] = {}
        self._active: list[PhaseMemory] = []
        self.top = top
        self.snapshot_phases = snapshot_phases
        self.lifetime = peak_resident_bytes()
        """Peak resident bytes of the process so far, peaks between phases included."""
        self.exact = os.access("/proc/self/clear_refs", os.W_OK)
        self._tracing = bool(top) and not tracemalloc.is_tracing()
        if self._tracing:
            tracemalloc.start(1)

    def close(self) -> None:
        """Stop ``tracemalloc`` if this profile started it (it slows every allocation)."""
        if self._tracing:
            tracemalloc.stop()
            self._tracing = False

    def _fold(self) -> int:
        """Fold the peak since the last reset into every active phase and into
        :attr:`lifetime` (so no peak is lost, inside a phase or not); start a new peak."""
        hwm = peak_resident_bytes()
        self.lifetime = max(self.lifetime, hwm)
        for ph in self._active:
            ph.peak = max(ph.peak, hwm)
        if self.exact:
            self.exact = reset_peak()
        return hwm

    def peak(self) -> int:
        """Peak resident bytes of this process so far (what the restarts of the kernel's
        count hide included)."""
        return max(self.lifetime, peak_resident_bytes())

    def _enter(self, table: dict[str, PhaseMemory], name: str) -> PhaseMemory:
        self._fold()
        ph = table.setdefault(name, PhaseMemory(name))
        now = resident_bytes()
        if ph.calls == 0:
            ph.start = now
        ph.calls += 1
        ph.peak = max(ph.peak, now)
        self._active.append(ph)
        return ph

    def _leave(self, ph: PhaseMemory, t0: float) -> None:
        before = ph.peak
        hwm = self._fold()
        self._active.remove(ph)
        ph.end = resident_bytes()
        ph.seconds += time.perf_counter() - t0
        if self.top and hwm > before:
            for outer in self._active:
                if outer.name in self.snapshot_phases and hwm >= outer.peak:
                    outer.top = self._largest()

    def _largest(self) -> list[tuple[str, int]]:
        stats = tracemalloc.take_snapshot().statistics("lineno")
        return [(str(s.traceback[0]), s.size) for s in stats[:self.top]]

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseMemory]:
        """Record the peak resident memory of the enclosed code as phase ``name``."""
        ph = self._enter(self.phases, name)
        t0 = time.perf_counter()
        try:
            yield ph
        finally:
            self._leave(ph, t0)

    def watch(self, named_layers: list[tuple[str, Any]]) -> list[Any]:
        """Make every layer's forward and backward a phase; returns the hooks' handles."""
        handles = []
        for name, layer in named_layers:
            for kind, pre, post in (("forward", layer.register_forward_pre_hook,
                                     layer.register_forward_hook),
                                    ("backward", layer.register_full_backward_pre_hook,
                                     layer.register_full_backward_hook)):
                state: dict[str, Any] = {}

                def begin(_layer: Any, *args: Any, label: str = f"{name} {kind}",
                          state: dict[str, Any] = state) -> None:
                    state["ph"] = self._enter(self.layers, label)
                    state["t0"] = time.perf_counter()

                def end(_layer: Any, *args: Any, state: dict[str, Any] = state) -> None:
                    self._leave(state.pop("ph"), state.pop("t0"))

                handles += [pre(begin), post(end)]
        return handles

    def summary(self) -> dict[str, Any]:
        """Phases and layers as plain data (MiB), for printing and the metrics file."""
        return {"exact": self.exact,
                "phases": [p.as_dict() for p in self.phases.values()],
                "layers": [p.as_dict() for p in self.layers.values()]}
