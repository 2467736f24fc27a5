"""Machine profiles: communication constants and compute rates that the cost model reads."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import asdict, dataclass, field

__all__ = ["MachineProfile", "load_profile", "builtin_profiles", "default_cache_dir"]


@dataclass
class MachineProfile:
    """What the cost model needs to know about a machine.

    Communication follows alpha-beta models (seconds, seconds per byte):
    point-to-point ``alpha + beta * bytes``; allreduce (ring)
    ``2 log2(p) alpha + 2 (p-1)/p bytes beta``; all-to-all
    ``(peers) alpha + max_bytes beta``. Compute either comes from
    measurements (``measured=True``: the calibrated kernel-time cache of this
    machine) or from peak rates: ``flops / (peak_flops * efficiency)`` for
    convolutions and GEMMs and ``bytes / mem_bandwidth`` for memory-bound layers.
    """

    name: str
    p2p_alpha: float
    p2p_beta: float
    allreduce_alpha: float
    allreduce_beta: float
    alltoall_alpha: float
    alltoall_beta: float
    peak_flops: float  # per rank, float32
    efficiency: float  # fraction of peak that convolutions reach
    mem_bandwidth: float  # bytes/s per rank
    memory_per_rank: float  # bytes
    cores_per_node: int = 1  # compute units (cores, or GPUs) that ranks of a node share
    measured: bool = False
    device: str = "cpu"  # what a rank computes on: 'cpu' (NumPy) or 'gpu' (CuPy)
    notes: str = ""
    sources: list[str] = field(default_factory=list)
    load_per_core: float | None = None  # of a calibration: the load average per core before it

    def p2p(self, nbytes: float) -> float:
        """Time of one point-to-point message."""
        return self.p2p_alpha + self.p2p_beta * nbytes if nbytes > 0 else 0.0

    def allreduce(self, nbytes: float, p: int) -> float:
        """Time of an allreduce of ``nbytes`` over ``p`` ranks (ring model)."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        return 2 * math.log2(p) * self.allreduce_alpha + 2 * (p - 1) / p * nbytes * \
            self.allreduce_beta

    def alltoall(self, max_bytes: float, peers: int) -> float:
        """Time of a personalised all-to-all whose busiest rank moves ``max_bytes``."""
        if max_bytes <= 0:
            return 0.0
        return peers * self.alltoall_alpha + max_bytes * self.alltoall_beta

    def save(self, path: str) -> None:
        """Write the profile as JSON."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> MachineProfile:
        """Read a profile written by :meth:`save`."""
        with open(path) as f:
            return cls(**json.load(f))


def default_cache_dir() -> str:
    """Where calibrations of this machine are kept (``~/.cache/disttensor``)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "disttensor")


def this_machine_path(cache_dir: str | None = None, device: str = "cpu") -> str:
    """Path of this host's calibrated profile (for ranks computing on ``device``)."""
    suffix = "" if device == "cpu" else f"-{device}"
    return os.path.join(cache_dir or default_cache_dir(),
                        f"machine-{socket.gethostname()}{suffix}.json")


def builtin_profiles() -> dict[str, MachineProfile]:
    """Profiles of published hardware, from public specifications."""
    v100 = MachineProfile(
        name="v100-nvlink-edr",
        # NVLink 2 between GPUs of a node, EDR InfiniBand (100 Gb/s) between nodes;
        # the slower link bounds collectives that span nodes.
        p2p_alpha=5e-6, p2p_beta=1 / 12.5e9,
        allreduce_alpha=10e-6, allreduce_beta=1 / 12.5e9,
        alltoall_alpha=10e-6, alltoall_beta=1 / 12.5e9,
        peak_flops=15.7e12, efficiency=0.5,
        mem_bandwidth=900e9, memory_per_rank=16 * 2**30, cores_per_node=4,
        notes=("One rank per V100 SXM2 16 GB (15.7 TFLOP/s fp32, 900 GB/s HBM2), 4 per node "
               "(LLNL Lassen/Sierra-like). Inter-node: EDR InfiniBand 100 Gb/s = 12.5 GB/s per "
               "link; latencies of a few microseconds; convolutions reaching half of peak "
               "(cuDNN, fp32) is a typical figure."),
        sources=["NVIDIA Tesla V100 datasheet (15.7 TFLOP/s fp32, 900 GB/s)",
                 "InfiniBand EDR: 100 Gb/s per port"],
    )
    h200 = MachineProfile(
        name="h200-nvlink-ndr",
        # NVLink 4 within a node of 8 GPUs, one NDR InfiniBand port (400 Gb/s) per GPU
        # between nodes; collectives spanning nodes are bounded by the InfiniBand link.
        p2p_alpha=3e-6, p2p_beta=1 / 50e9,
        allreduce_alpha=8e-6, allreduce_beta=1 / 50e9,
        alltoall_alpha=8e-6, alltoall_beta=1 / 50e9,
        peak_flops=67e12, efficiency=0.5,
        mem_bandwidth=4.8e12, memory_per_rank=141 * 10**9, cores_per_node=8,
        notes=("One rank per H200 SXM 141 GB (67 TFLOP/s fp32 without tensor cores, 4.8 TB/s "
               "HBM3e), 8 per node with NVLink 4 (450 GB/s per direction); inter-node NDR "
               "InfiniBand 400 Gb/s = 50 GB/s per GPU (DGX H200-like: one ConnectX-7 port per "
               "GPU); fp32 convolutions at half of peak."),
        sources=["NVIDIA H200 Tensor Core GPU datasheet (fp32 67 TFLOP/s, 141 GB HBM3e, "
                 "4.8 TB/s, NVLink 900 GB/s)",
                 "InfiniBand NDR: 400 Gb/s per port"],
    )
    return {v100.name: v100, h200.name: h200}


def load_profile(name_or_path: str, cache_dir: str | None = None) -> MachineProfile:
    """A profile by builtin name, by JSON path, or ``"this"``/``"this-gpu"`` (calibrated here).

    Raises
    ------
    FileNotFoundError
        For ``"this"`` when no calibration exists yet (run
        ``disttensor-plan --calibrate`` under ``mpiexec``).
    """
    profiles = builtin_profiles()
    if name_or_path in profiles:
        return profiles[name_or_path]
    if name_or_path in ("this", "this-gpu"):
        device = "gpu" if name_or_path == "this-gpu" else "cpu"
        path = this_machine_path(cache_dir, device)
        if not os.path.exists(path):
            flag = " --device gpu" if device == "gpu" else ""
            raise FileNotFoundError(
                f"no calibration of this machine at {path}; run "
                f"`mpiexec -n P disttensor-plan --calibrate{flag}` first"
            )
        return MachineProfile.load(path)
    if os.path.exists(name_or_path):
        return MachineProfile.load(name_or_path)
    raise ValueError(f"unknown machine profile {name_or_path!r}; builtin: {sorted(profiles)}, "
                     "'this', or a JSON file")
