"""Machine profiles: communication constants and compute rates that the cost model reads."""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field, fields

__all__ = ["MachineProfile", "load_profile", "builtin_profiles", "default_cache_dir"]


@dataclass
class MachineProfile:
    """What the cost model needs to know about a machine.

    Communication follows alpha-beta models (seconds, seconds per byte):
    point-to-point ``alpha + beta * bytes``; allreduce (ring)
    ``2 log2(p) alpha + 2 (p-1)/p bytes beta``; all-to-all
    ``(peers) alpha + max_bytes beta``. These constants describe the link
    between ranks of one node. A profile with ``inter_alpha`` and
    ``inter_beta`` has a second level: nodes of ``ranks_per_node`` ranks
    (placed node-major: ranks ``0 .. ranks_per_node-1`` share node 0)
    joined by a network whose NIC ``nic_share`` ranks share; an allreduce
    whose ranks span nodes is hierarchical (reduce-scatter in the node,
    allreduce across nodes, allgather in the node), and messages between
    nodes use the inter-node constants. Without them every message uses the
    first set (one level, as profiles written before the second level).

    Compute either comes from measurements (``measured=True``: the calibrated
    kernel-time cache of this machine) or from rates (:meth:`kernel_time`):
    ``max(flops / (peak_flops * eff(flops)), bytes / mem_bandwidth) +
    launch_overhead``, where the efficiency of a kernel
    ``eff(f) = efficiency * f / (f + efficiency_half_flops)`` falls for small
    local problems (flat when ``efficiency_half_flops`` is 0). The curve is
    the same as a fixed cost of ``efficiency_half_flops / (peak_flops *
    efficiency)`` seconds per compute-bound kernel on top of a flat rate.
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
    ranks_per_node: int = 0  # ranks placed on one node (0: cores_per_node)
    inter_alpha: float | None = None  # latency between nodes (None: one level)
    inter_beta: float | None = None  # seconds per byte of one NIC
    nic_share: int = 1  # ranks of a node that share one NIC
    efficiency_half_flops: float = 0.0  # FLOPs of a kernel reaching half of `efficiency`
    launch_overhead: float = 0.0  # seconds per kernel (launch, framework)
    # resident bytes the MPI library adds per byte of non-blocking allreduces in flight at
    # once (its temporary buffers; measured by calibration, 0 where unknown)
    reduce_scratch: float = 0.0
    # ranks of one node that ran the calibration (0: not a calibration, or one written before
    # this was recorded); its constants hold for jobs with as many ranks per node
    calibrated_ranks_per_node: int = 0
    # the method of the calibration (0: not a calibration, or one taken before methods were
    # numbered); a cached calibration of an older method is taken again
    calibration_method: int = 0

    @property
    def node_size(self) -> int:
        """Ranks per node."""
        return max(1, self.ranks_per_node or self.cores_per_node)

    @property
    def two_level(self) -> bool:
        """Whether messages between nodes have their own constants."""
        return self.inter_alpha is not None and self.inter_beta is not None

    def _inter(self) -> tuple[float, float]:
        """(alpha, beta) of a rank's traffic between nodes, its NIC shared by ``nic_share``."""
        if not self.two_level:
            return self.p2p_alpha, self.p2p_beta
        return float(self.inter_alpha), float(self.inter_beta) * max(1, self.nic_share)

    def kernel_time(self, flops: float, nbytes: float, launches: int = 1) -> float:
        """Rate-model time of ``launches`` kernels doing ``flops`` and moving ``nbytes``."""
        eff = self.efficiency
        if self.efficiency_half_flops > 0 and flops > 0:
            eff *= flops / (flops + self.efficiency_half_flops)
        t = max(flops / (self.peak_flops * eff) if flops > 0 else 0.0,
                nbytes / self.mem_bandwidth)
        return t + launches * self.launch_overhead

    def p2p(self, nbytes: float, inter: bool = False) -> float:
        """Time of one point-to-point message (``inter``: between nodes)."""
        if nbytes <= 0:
            return 0.0
        alpha, beta = self._inter() if inter and self.two_level else (self.p2p_alpha,
                                                                       self.p2p_beta)
        return alpha + beta * nbytes

    def allreduce_terms(self, nbytes: float, p: int, local: int | None = None
                        ) -> tuple[float, float]:
        """(latency, bandwidth) seconds of an allreduce of ``nbytes`` over ``p`` ranks.

        ``local`` ranks of the communicator share each node (default: as many
        as fit, ``min(p, node_size)``). Within a node, or on a one-level
        profile, the latency of recursive doubling (reduce-scatter and
        allgather, ``log2(p)`` steps each: ``2 log2(p) alpha``) with the
        bandwidth of a ring (``2 (p-1)/p bytes beta``), as MPI libraries'
        Rabenseifner allreduce has.
        Across ``m = p / local`` nodes, hierarchical: reduce-scatter and
        allgather in the node (``log2(local) alpha + (local-1)/local bytes
        beta`` each) around an allreduce of ``bytes / local`` across the nodes
        with the inter-node constants.
        """
        if p <= 1 or nbytes <= 0:
            return 0.0, 0.0
        k = min(p, self.node_size if local is None else max(1, local))
        if not self.two_level or k >= p:
            return (2 * math.log2(p) * self.allreduce_alpha,
                    2 * (p - 1) / p * nbytes * self.allreduce_beta)
        m = math.ceil(p / k)
        ia, ib = self._inter()
        lat = 2 * math.log2(k) * self.allreduce_alpha + 2 * math.log2(m) * ia
        bw = 2 * (k - 1) / k * nbytes * self.allreduce_beta + \
            2 * (m - 1) / m * nbytes / k * ib
        return lat, bw

    def allreduce(self, nbytes: float, p: int, local: int | None = None) -> float:
        """Time of an allreduce of ``nbytes`` over ``p`` ranks (:meth:`allreduce_terms`)."""
        return sum(self.allreduce_terms(nbytes, p, local))

    def allgather(self, nbytes: float, p: int, local: int | None = None) -> float:
        """Time of an allgather over ``p`` ranks of pieces that make ``nbytes`` in all.

        Half of :meth:`allreduce_terms`' allreduce of ``nbytes``, both terms:
        the allreduce it models is a reduce-scatter followed by this
        allgather (``log2(p) alpha + (p-1)/p bytes beta`` within a node).
        """
        return sum(self.allreduce_terms(nbytes, p, local)) / 2

    def reduce_scatter(self, nbytes: float, p: int, local: int | None = None) -> float:
        """Time of a reduce-scatter of ``nbytes`` over ``p`` ranks into one piece each:
        the other half of :meth:`allreduce_terms`' allreduce (:meth:`allgather`)."""
        return sum(self.allreduce_terms(nbytes, p, local)) / 2

    def alltoall(self, max_bytes: float, peers: int, inter: bool = False) -> float:
        """Time of a personalised all-to-all whose busiest rank moves ``max_bytes``.

        ``inter``: its ranks span nodes, so the busiest rank's bytes cross its
        (shared) NIC.
        """
        if max_bytes <= 0:
            return 0.0
        if inter and self.two_level:
            alpha, beta = self._inter()
            return peers * alpha + max_bytes * beta
        return peers * self.alltoall_alpha + max_bytes * self.alltoall_beta

    def save(self, path: str) -> None:
        """Write the profile as JSON.

        The fields of the second network level, of the rate model's curve and
        the reductions' scratch are written only when set, so a profile that uses neither
        stays readable by versions that do not know them (a calibration's
        ``calibration_method`` is written: versions before it do not read its
        profiles, later ones leave out what they do not know).
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data = asdict(self)
        for name, default in _OPTIONAL_FIELDS.items():
            if data[name] == default:
                del data[name]
        # a file of its own: jobs that start together may write the same profile at once
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> MachineProfile:
        """Read a profile written by :meth:`save` (by this version or another: fields this
        version does not know are left out, those it knows and the file lacks keep their
        defaults)."""
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


#: Fields added after the first profiles, with the defaults that leave them out of a file.
_OPTIONAL_FIELDS = {"ranks_per_node": 0, "inter_alpha": None, "inter_beta": None,
                    "nic_share": 1, "efficiency_half_flops": 0.0, "launch_overhead": 0.0,
                    "reduce_scratch": 0.0, "calibrated_ranks_per_node": 0,
                    "calibration_method": 0}


def default_cache_dir() -> str:
    """Where calibrations of this machine are kept (``~/.cache/disttensor``)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "disttensor")


def this_machine_path(cache_dir: str | None = None, device: str = "cpu",
                      one_rank: bool = False, per_node: int | None = None) -> str:
    """Path of this host's calibrated profile (for ranks computing on ``device``).

    With ``one_rank``, the path of the compute rates measured by one rank alone
    (:func:`~disttensor_nn.plan.calibrate.calibrate_compute`), which has no
    communication figures and is never read as ``"this"``. With ``per_node``,
    the path where the last calibration taken with that many ranks per node is kept
    (:func:`~disttensor_nn.plan.calibrate.calibrate` writes it beside the one ``"this"``
    reads, and :func:`~disttensor_nn.plan.calibrate.stale_calibration` puts it back
    for a job of that many).
    """
    if one_rank and per_node:
        raise ValueError("this_machine_path: one_rank and per_node name different files")
    suffix = ("" if device == "cpu" else f"-{device}") + ("-1rank" if one_rank else "") + (
        f"-{int(per_node)}-per-node" if per_node else "")
    return os.path.join(cache_dir or default_cache_dir(),
                        f"machine-{socket.gethostname()}{suffix}.json")


#: Efficiency curve of fp32 cuDNN convolutions on a V100 (see ``v100-dgx1``'s notes).
V100_EFFICIENCY = 0.90
V100_HALF_FLOPS = 5e8
V100_LAUNCH = 4e-6


def builtin_profiles() -> dict[str, MachineProfile]:
    """Profiles of published hardware, from public specifications."""
    compute_note = (
        "Compute: max(FLOPs / (peak * eff(FLOPs)), bytes / HBM bandwidth) + {launch:.0f} us per "
        "kernel, eff(f) = {eff} * f / (f + {half:.2g}) for a kernel of f FLOPs (a kernel of "
        "{half:.2g} FLOPs reaches half the efficiency of a large one). The three constants are "
        "fitted (grid search, largest relative error) to NVIDIA's published ResNet-50 v1.5 "
        "fp32 figures for one V100 16 GB (DeepLearningExamples, PyTorch, DGX-1): training "
        "367 img/s at batch 112 and inference latency at batch 8-256 (11.5-214.5 ms), all "
        "within 10%; batches 1-4 (about 10 ms whatever the batch: host-bound) are not "
        "described. An efficiency of 0.9 counted in direct-convolution FLOPs reflects cuDNN's "
        "Winograd and FFT algorithms, which do fewer.")
    v100_sources = [
        "NVIDIA Tesla V100 datasheet: 15.7 TFLOP/s fp32, 900 GB/s HBM2, NVLink 300 GB/s",
        "NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5: DGX-1 16GB FP32 367 img/s on 1 "
        "GPU, 2855 img/s on 8 (batch 112 per GPU) https://github.com/NVIDIA/DeepLearningExamples"
        "/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5",
        "InfiniBand EDR: 100 Gb/s (12.5 GB/s) per port",
    ]
    v100 = MachineProfile(
        name="v100-nvlink-edr",
        # In a node: NVLink 2 (3 bricks between neighbouring GPUs, ~75 GB/s per direction);
        # between nodes: two EDR InfiniBand ports per node of 4 GPUs.
        p2p_alpha=5e-6, p2p_beta=1 / 60e9,
        allreduce_alpha=8e-6, allreduce_beta=1 / 60e9,
        alltoall_alpha=8e-6, alltoall_beta=1 / 60e9,
        peak_flops=15.7e12, efficiency=V100_EFFICIENCY,
        mem_bandwidth=900e9, memory_per_rank=16 * 2**30, cores_per_node=4,
        ranks_per_node=4, inter_alpha=10e-6, inter_beta=1 / 12.5e9, nic_share=2,
        efficiency_half_flops=V100_HALF_FLOPS, launch_overhead=V100_LAUNCH,
        notes=("One rank per V100 SXM2 16 GB (15.7 TFLOP/s fp32, 900 GB/s HBM2), 4 per node "
               "(LLNL Lassen/Sierra-like, the machines of the LBANN/distconv results). In a "
               "node: NVLink 2, three bricks (75 GB/s per direction) between GPUs, taken as "
               "60 GB/s achieved; between nodes: dual-rail EDR InfiniBand, 12.5 GB/s per port, "
               "two GPUs per port, 10 us latency. " + compute_note.format(
                   launch=V100_LAUNCH * 1e6, eff=V100_EFFICIENCY, half=V100_HALF_FLOPS)),
        sources=v100_sources,
    )
    dgx1 = MachineProfile(
        name="v100-dgx1",
        # 8 V100 per node on the NVLink hybrid cube mesh; 4 EDR ports per node.
        p2p_alpha=5e-6, p2p_beta=1 / 40e9,
        allreduce_alpha=8e-6, allreduce_beta=1 / 120e9,
        alltoall_alpha=8e-6, alltoall_beta=1 / 40e9,
        peak_flops=15.7e12, efficiency=V100_EFFICIENCY,
        mem_bandwidth=900e9, memory_per_rank=16 * 2**30, cores_per_node=8,
        ranks_per_node=8, inter_alpha=10e-6, inter_beta=1 / 12.5e9, nic_share=2,
        efficiency_half_flops=V100_HALF_FLOPS, launch_overhead=V100_LAUNCH,
        notes=("NVIDIA DGX-1 with 8 V100 SXM2 16 GB on the NVLink hybrid cube mesh (6 links "
               "of 25 GB/s per GPU; a ring allreduce over the 8 GPUs taken at 120 GB/s bus "
               "bandwidth, a point-to-point message between two GPUs at 40 GB/s) and 4 EDR "
               "InfiniBand ports (two GPUs per port). " + compute_note.format(
                   launch=V100_LAUNCH * 1e6, eff=V100_EFFICIENCY, half=V100_HALF_FLOPS)),
        sources=v100_sources + ["NVIDIA DGX-1 with Tesla V100 system architecture white paper "
                                "(hybrid cube-mesh NVLink, 4 EDR IB ports)"],
    )
    h200_scale = 67e12 / 15.7e12
    h200 = MachineProfile(
        name="h200-nvlink-ndr",
        # NVLink 4 through NVSwitch within a node of 8 GPUs, one NDR InfiniBand port
        # (400 Gb/s) per GPU between nodes.
        p2p_alpha=3e-6, p2p_beta=1 / 300e9,
        allreduce_alpha=6e-6, allreduce_beta=1 / 360e9,
        alltoall_alpha=6e-6, alltoall_beta=1 / 300e9,
        peak_flops=67e12, efficiency=V100_EFFICIENCY,
        mem_bandwidth=4.8e12, memory_per_rank=141 * 10**9, cores_per_node=8,
        ranks_per_node=8, inter_alpha=8e-6, inter_beta=1 / 50e9, nic_share=1,
        efficiency_half_flops=V100_HALF_FLOPS * h200_scale, launch_overhead=6e-6,
        notes=("One rank per H200 SXM 141 GB (67 TFLOP/s fp32 without tensor cores, 4.8 TB/s "
               "HBM3e), 8 per node through NVSwitch (NVLink 4, 450 GB/s per direction; a ring "
               "allreduce taken at 360 GB/s bus bandwidth, point-to-point at 300 GB/s); "
               "between nodes one ConnectX-7 NDR InfiniBand port (400 Gb/s = 50 GB/s) per GPU "
               "(DGX H200-like), 8 us latency. Compute: as the V100 profiles' curve (fitted "
               "there), its half point scaled with peak (a GPU 4.3x as fast needs 4.3x the "
               "work per kernel to fill), 6 us per kernel; not validated against a published "
               "H200 fp32 training figure (none found: published H100/H200 figures use "
               "TF32/bf16 tensor cores)."),
        sources=["NVIDIA H200 Tensor Core GPU datasheet (fp32 67 TFLOP/s, 141 GB HBM3e, "
                 "4.8 TB/s, NVLink 900 GB/s)",
                 "NVIDIA DGX H200 datasheet (8 GPUs, NVSwitch, 8x ConnectX-7 400 Gb/s)",
                 "InfiniBand NDR: 400 Gb/s per port"],
    )
    return {v100.name: v100, dgx1.name: dgx1, h200.name: h200}


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
