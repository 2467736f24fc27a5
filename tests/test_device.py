"""Device choice and transport options (``disttensor.device``), on any machine."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.device import resolve_array_module
from disttensor.testing import collective_assert
from disttensor.transport import transport_for

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD


@pytest.mark.parallel(SIZES)
def test_node_local_rank():
    local = dt.node_local_rank()
    ranks = comm.allgather((MPI.Get_processor_name(), local))
    mine = sorted(r for host, r in ranks if host == MPI.Get_processor_name())
    collective_assert(mine == list(range(len(mine))), f"{ranks}")
    collective_assert(dt.node_local_rank() == local)  # cached, no second split


def test_use_device_cpu():
    assert dt.use_device("cpu") is np
    with pytest.raises(ValueError, match="unknown device"):
        dt.use_device("tpu")
    assert resolve_array_module(None, None) == (np, None)
    assert resolve_array_module(None, "cpu") == (np, None)
    with pytest.raises(ValueError, match="needs xp="):
        resolve_array_module(None, object())


def _has_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.parallel(SIZES)
def test_gpu_missing_raises_everywhere():
    if _has_gpu():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="device='gpu'"):
        dt.zeros((4, 3), device="gpu")


def test_transport_options(monkeypatch):
    monkeypatch.delenv("DISTTENSOR_GPU_AWARE_MPI", raising=False)
    monkeypatch.delenv("DISTTENSOR_NCCL", raising=False)
    dt.set_transport()
    assert dt.nccl_enabled() is False
    assert isinstance(dt.gpu_aware_mpi(), bool)
    monkeypatch.setenv("DISTTENSOR_GPU_AWARE_MPI", "1")
    monkeypatch.setenv("DISTTENSOR_NCCL", "1")
    assert dt.gpu_aware_mpi() is True and dt.nccl_enabled() is True
    monkeypatch.setenv("DISTTENSOR_GPU_AWARE_MPI", "0")
    assert dt.gpu_aware_mpi() is False
    try:
        dt.set_transport(gpu_aware_mpi=True, nccl=False)  # wins over the environment
        assert dt.gpu_aware_mpi() is True and dt.nccl_enabled() is False
    finally:
        dt.set_transport()
    monkeypatch.setenv("DISTTENSOR_NCCL", "maybe")
    with pytest.raises(ValueError, match="DISTTENSOR_NCCL"):
        dt.nccl_enabled()
    # NumPy is always direct: the options concern GPU arrays only
    assert transport_for(np).direct and not transport_for(np).nccl
