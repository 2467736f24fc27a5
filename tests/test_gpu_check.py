"""benchmarks/gpu_check.sh on a machine without CuPy: it stops after the import check,
says why, exits 2 and leaves the stages it ran in its JSON summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no CuPy here
        return False
    return True


@pytest.mark.skipif(shutil.which("bash") is None or _has_cupy(), reason="needs bash, no CuPy")
def test_gpu_check_without_cupy_reports_and_exits_2(tmp_path):
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent),
               GPU_CHECK_NO_INSTALL="1", OUT=str(tmp_path))
    if not (Path(env["VENV"]) / "bin" / "python").exists():
        pytest.skip("the interpreter is not in a virtual environment's bin/")
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "CuPy is missing" in proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = [s["stage"] for s in summary["stages"]]
    assert stages[:1] == ["nvidia-smi"] and "imports" in stages
    assert all({"rc", "seconds", "log", "last_line"} <= set(s) for s in summary["stages"])


def test_gpu_train_check_dry_run(tmp_path):
    """The GPU training check's comparison, with array_api_strict standing in for CuPy."""
    import importlib.util

    pytest.importorskip("array_api_strict")
    path = SCRIPT.parent / "gpu_train_check.py"
    spec = importlib.util.spec_from_file_location("gpu_train_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    with pytest.raises(SystemExit):
        check.parse_args(["--steps", "1"])
    out = tmp_path / "train.json"
    assert check.main(["--dry-run", "--steps", "3", "--size", "16x16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["device_module"] == "array_api_strict"
    assert data["losses_agree"] and len(data["loss_gpu"]) == 3
    assert data["max_relative_difference"] <= 1e-3 and data["ms_per_step_gpu"] > 0
