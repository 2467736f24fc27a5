"""The documentation: the Sphinx site builds with warnings as errors, and the tutorials run.

* ``test_sphinx_build`` runs ``sphinx-build -W -b html docs <tmp>`` (which also
  draws the figures with ``docs/gen_figures.py``) and checks that the API
  reference documents every public name of both packages: each name in the
  ``__all__`` of every public module, under its own module or a package that
  re-exports it.
* ``test_tutorial`` runs each tutorial's code (``docs/tutorials/*.py``, which
  the pages include verbatim) under ``mpiexec -n P`` and checks that it exits
  with 0 and prints its check line.

Both are serial tests: they start their own processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from disttensor.testing.launch import mpiexec_path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = DOCS / "tutorials"

# tutorial script -> the line it prints on rank 0 when every check passed
CHECK_LINES = {
    "array_programming.py": "array programming tutorial: OK on {n} ranks",
    "stencil_layer.py": "stencil layer tutorial: OK on {n} ranks",
    "property_testing.py": "property testing tutorial: OK on {n} ranks",
    "train_mesh.py": "training tutorial: OK on {n} ranks",
    "train_bf16.py": "bf16 training tutorial: OK on {n} ranks",
    "torch_custom_layer.py": "torch custom layer tutorial: OK on {n} ranks",
    "torch_parallelize.py": "torch parallelize tutorial: OK on {n} ranks",
}
# tutorials and modules that need PyTorch (an optional extra): skipped without it
NEEDS_TORCH = {"torch_custom_layer.py", "torch_parallelize.py"}
TORCH_MODULES = ("disttensor_nn.torch", "disttensor_nn.training.torch_driver")
HAS_TORCH = importlib.util.find_spec("torch") is not None
TIMEOUT = 240


def _mpiexec() -> str:
    path = mpiexec_path()
    if not os.path.exists(path):
        pytest.skip("no mpiexec found")
    return path


def _env() -> dict[str, str]:
    """This environment without an enclosing MPI job's variables, one BLAS thread per rank."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "_PYTEST_MPI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", MPIEXEC_TIMEOUT=str(TIMEOUT))
    return env


def test_every_tutorial_script_is_included_and_checked():
    scripts = {p.name for p in TUTORIALS.glob("*.py")}
    assert scripts == set(CHECK_LINES), scripts ^ set(CHECK_LINES)
    pages = "".join(p.read_text() for p in TUTORIALS.glob("*.md"))
    for name in scripts:
        assert f"{{literalinclude}} {name}" in pages, f"no page includes {name}"


@pytest.mark.parametrize(("script", "nprocs"), [
    *((script, n) for script in sorted(CHECK_LINES) for n in (4, 3)),
    ("torch_parallelize.py", 2)])  # one sample per step on 2 ranks, as docs/torch.md says
def test_tutorial(script, nprocs):
    if script in NEEDS_TORCH and not HAS_TORCH:
        pytest.skip("needs PyTorch (the torch extra)")
    cmd = [_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "mpi4py",
           str(TUTORIALS / script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT + 30)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out}"
    assert CHECK_LINES[script].format(n=nprocs) in proc.stdout.splitlines(), out


def _public_names() -> dict[str, set[str]]:
    """Every public name -> the dotted paths under which the reference may document it."""
    names: dict[str, set[str]] = {}
    for pkg in ("disttensor", "disttensor_nn"):
        top = importlib.import_module(pkg)
        modules = [pkg] + [m.name for m in pkgutil.walk_packages(top.__path__, pkg + ".")]
        for modname in modules:
            if any(part.startswith("_") for part in modname.split(".")):
                continue
            if not HAS_TORCH and modname.startswith(TORCH_MODULES):
                continue  # documented all the same: the build mocks torch (docs/conf.py)
            mod = importlib.import_module(modname)
            for name in getattr(mod, "__all__", ()):
                obj = getattr(mod, name)
                where = {f"{modname}.{name}"}
                parts = modname.split(".")
                for k in range(1, len(parts)):  # packages that re-export it
                    parent = importlib.import_module(".".join(parts[:k]))
                    if getattr(parent, name, None) is obj:
                        where.add(f"{'.'.join(parts[:k])}.{name}")
                names[f"{modname}.{name}"] = where
    return names


def test_sphinx_build(tmp_path):
    for module in ("sphinx", "myst_parser", "numpydoc", "matplotlib"):
        pytest.importorskip(module)
    from sphinx.util.inventory import InventoryFile

    out = tmp_path / "html"
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html",
           str(DOCS), str(out)]
    env = dict(_env(), MPLBACKEND="Agg")
    env.pop("DISPLAY", None)  # the build must not need a display
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "_images" / "blocks_2x3.png").stat().st_size > 10_000

    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for entries in inventory.data.values() for name in entries} \
        if hasattr(inventory, "data") else {name for entries in inventory.values()
                                            for name in entries}
    missing = sorted(n for n, where in _public_names().items() if not where & documented)
    assert not missing, (f"public names missing from the API reference: {missing}; "
                         "add them to a page under docs/api/")
