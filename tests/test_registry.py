"""The model registry, the training application's layout, and the former module paths.

* a model registered by name trains through :func:`disttensor_nn.training.train`
  exactly as a hand-written NumPy loop (a 1x1 convolution, i.e. per-pixel linear
  regression, with SGD and momentum) says it should, on any number of ranks;
* unknown names and malformed registrations are refused with a clear error;
* the command line accepts the registered names;
* ``disttensor_nn.train``, ``.cli``, ``.data``, ``.checkpoint`` and ``.plot``
  re-export the same objects as before, and nothing in the project imports them.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import disttensor_nn as nn
import disttensor_nn.plan as plan
import disttensor_nn.training as training
from disttensor.testing import collective_assert
from disttensor_nn.training import Dataset, ModelSpec, TrainConfig, register_model, train
from disttensor_nn.training.cli import plan_main, train_main

ROOT = Path(__file__).resolve().parents[1]
V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing
C, SIZE, BATCH, LR = 3, (6, 5), 4, 0.05


def _x(n: np.ndarray, c: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.sin(0.7 * (n + 1) + 0.5 * c + 0.3 * h - 0.2 * w)


def _y(n: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    return 0.1 * h - 0.05 * w + 0.01 * n


class Ramps(Dataset):
    """Closed-form inputs and spatial targets (the reference below evaluates the same formulas)."""

    def __init__(self, num_samples: int, sample_shape: tuple[int, ...], seed: int):
        self.num_samples = num_samples
        self.sample_shape = tuple(sample_shape)
        self.target_shape = (1, *sample_shape[1:])
        self.dtype = self.target_dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.num_samples

    def _input_block(self, sample, where):
        c, h, w = np.ogrid[where]
        shape = tuple(s.stop - s.start for s in where)
        return np.broadcast_to(_x(sample, c, h, w), shape).astype(self.dtype)

    def _target_block(self, sample, where):
        _, h, w = np.ogrid[where]
        shape = tuple(s.stop - s.start for s in where)
        return np.broadcast_to(_y(sample, h, w), shape).astype(self.dtype)


def _pixel_regression(dtype, seed):
    return nn.Sequential(nn.Conv2d(C, 1, 1, dtype=dtype, seed=seed))


SPEC = ModelSpec(builder=_pixel_regression, in_channels=C, size=SIZE, dataset=Ramps,
                 loss=nn.MSELoss, lr=LR, batch=BATCH)
register_model("test-pixel-regression", SPEC, replace=True)


def _reference_losses(steps: int, momentum: float = 0.9) -> list[float]:
    """SGD with momentum on the mean squared error, in float64 on the whole batch."""
    conv = nn.Conv2d(C, 1, 1, seed=0)  # the initial weights the builder draws
    w = conv.weight.data.reshape(C).astype(np.float64)
    b = float(conv.bias.data[0])
    n, c, h, wi = np.ogrid[:BATCH, :C, :SIZE[0], :SIZE[1]]
    x = np.broadcast_to(_x(n, c, h, wi), (BATCH, C, *SIZE)).astype(np.float32).astype(float)
    y = np.broadcast_to(_y(n[:, 0], h[:, 0], wi[:, 0]), (BATCH, *SIZE)).astype(np.float32)
    losses, vw, vb = [], None, None
    for _ in range(steps):
        d = np.einsum("c,nchw->nhw", w, x) + b - y
        losses.append(float(np.mean(d * d)))
        gw = 2 * np.einsum("nhw,nchw->c", d, x) / d.size
        gb = 2 * d.sum() / d.size
        vw = gw if vw is None else momentum * vw + gw
        vb = gb if vb is None else momentum * vb + gb
        w, b = w - LR * vw, b - LR * vb
    return losses


@pytest.mark.parallel([1, 2, 3])
def test_registered_model_trains_as_the_numpy_reference():
    cfg = TrainConfig(model="test-pixel-regression", batch=BATCH, steps=2, samples=BATCH,
                      machine=V100, metrics=None, progress=False)
    summary = train(cfg)  # one batch of all samples: the order of the loader cannot matter
    want = _reference_losses(2)
    got = summary["history"]
    collective_assert(summary["batch_shape"] == [BATCH, C, *SIZE], str(summary["batch_shape"]))
    collective_assert(len(got) == 2 and np.allclose(got, want, rtol=1e-5, atol=0),
                      f"losses {got}, NumPy reference {want}")
    collective_assert(summary["ranks"] == MPI.COMM_WORLD.Get_size(), "rank count")


@pytest.mark.parallel([1, 3])
def test_unknown_model_is_refused_on_every_rank_before_training():
    names = ", ".join(training.model_names())
    message = f"unknown model 'no-such-net'; choose from {names}"
    with pytest.raises(ValueError) as info:
        train(TrainConfig(model="no-such-net", machine=V100, metrics=None, progress=False))
    collective_assert(str(info.value) == message, str(info.value))
    with pytest.raises(ValueError, match="unknown model 'resnet7'"):
        training.build_model("resnet7")


def test_builtin_names_and_defaults():
    assert set(training.model_names()) >= {"resnet18", "resnet34", "resnet50", "resnet101",
                                           "mesh", "mesh-small", "mesh-demo"}
    model, shape = training.build_model("mesh-small", batch=2)
    assert shape == (2, 18, 256, 256)
    assert training.build_model("resnet18", (32, 32), 8)[1] == (8, 3, 32, 32)
    assert training.model_spec("resnet50").batch == 32 and training.model_spec("mesh").batch == 4
    assert training.model_spec("resnet50").lr == 0.01 and training.model_spec("mesh-demo").lr == 0.1
    data = training.model_spec("mesh-demo").dataset(5, (18, 16, 12), 0)
    assert isinstance(data, training.MeshSynthetic) and len(data) == 5
    assert data.sample_shape == (18, 16, 12)
    assert isinstance(training.model_spec("resnet18").loss(), nn.SoftmaxCrossEntropy)


def test_malformed_registrations_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_model("mesh", SPEC)
    with pytest.raises(TypeError, match="ModelSpec"):
        register_model("bad", {"builder": _pixel_regression})
    with pytest.raises(ValueError, match="in_channels"):
        register_model("bad", ModelSpec(_pixel_regression, 0, SIZE, Ramps, nn.MSELoss, LR))
    with pytest.raises(ValueError, match="size"):
        register_model("bad", ModelSpec(_pixel_regression, C, [6, 5], Ramps, nn.MSELoss, LR))
    with pytest.raises(ValueError, match="lr"):
        register_model("bad", ModelSpec(_pixel_regression, C, SIZE, Ramps, nn.MSELoss, 0.0))
    with pytest.raises(TypeError, match="name"):
        register_model("", SPEC)
    assert "bad" not in training.model_names()


def test_command_lines_take_their_model_choices_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        train_main(["no-such-net"])
    assert "invalid choice: 'no-such-net'" in capsys.readouterr().err
    assert plan_main(["test-pixel-regression", "--machine", V100, "--ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"test-pixel-regression, batch {(BATCH, C, *SIZE)}, 1 rank\n")


FORMER = {  # the former modules and their __all__
    "disttensor_nn.train": ["TrainConfig", "train"],
    "disttensor_nn.cli": ["build_model", "parse_bytes", "parse_size", "plan_main", "make_plan",
                          "train_main"],
    "disttensor_nn.data": ["Dataset", "ImageNetSynthetic", "MeshSynthetic", "NpyDataset",
                           "Loader", "save_npy_dataset"],
    "disttensor_nn.checkpoint": ["CheckpointError", "save_checkpoint", "load_checkpoint",
                                 "FORMAT", "VERSION"],
    "disttensor_nn.plot": ["plot_metrics", "plot_main"],
}


def test_former_module_paths_are_aliases_of_the_same_objects():
    cli = importlib.import_module("disttensor_nn.training.cli")
    home = {"make_plan": plan, "parse_bytes": cli, "parse_size": cli, "plan_main": cli,
            "train_main": cli}
    for modname, names in FORMER.items():
        alias = importlib.import_module(modname)
        assert sorted(alias.__all__) == sorted(names), modname
        for name in names:
            assert getattr(alias, name) is getattr(home.get(name, training), name), \
                f"{modname}.{name}"
    assert plan.make_plan.__module__ == "disttensor_nn.plan.make"


FORMER_OUTSIDE_ALL = {  # public names of the former modules that their __all__ did not list
    "disttensor_nn.cli": {"wait_for_root": plan},
    "disttensor_nn.data": {"Slices": training.data},
    "disttensor_nn.checkpoint": {"MANIFEST": training.checkpoint, "STATE": training.checkpoint,
                                 "named_parameters": training.checkpoint,
                                 "named_buffers": training.checkpoint},
}


def test_former_public_names_outside_all_still_resolve():
    for modname, names in FORMER_OUTSIDE_ALL.items():
        alias = importlib.import_module(modname)
        for name, home in names.items():
            assert getattr(alias, name) is getattr(home, name), f"{modname}.{name}"
    former_cli = importlib.import_module("disttensor_nn.cli")
    assert set(former_cli.MODELS) == set(training.model_names())


def _imported(path: Path) -> set[str]:
    """Absolute module names a Python file imports (relative imports resolved)."""
    package = list(path.relative_to(ROOT).parts[:-1])  # of a module and of an __init__.py
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_nothing_imports_the_former_paths_and_only_tools_import_the_cli():
    aliases = set(FORMER)
    this = Path(__file__).resolve()
    files = [p for d in ("disttensor", "disttensor_nn", "tests", "benchmarks", "examples",
                         "docs") for p in (ROOT / d).rglob("*.py") if p.resolve() != this]
    cli_users = set()
    for path in files:
        names = _imported(path)
        assert not names & aliases, f"{path} imports {names & aliases}"
        if "disttensor_nn.training.cli" in names:
            cli_users.add(path.relative_to(ROOT).as_posix())
    # the CLI's own tests, the alias of its former path, the `python -m` entry points, and a
    # benchmark script that reads its memory-size arguments the same way
    assert cli_users <= {"tests/test_plan.py", "tests/test_train.py", "tests/test_predict.py",
                         "tests/test_unet_models.py",
                         "tests/test_data_readers.py", "tests/test_optim.py",
                         "tests/test_kernel_backends.py", "tests/test_torch_model_file.py",
                         "tests/test_shard_state.py", "tests/test_precision.py",
                         "disttensor_nn/cli.py",
                         "benchmarks/validate_planner.py", "disttensor_nn/train.py",
                         "disttensor_nn/plan/__main__.py"}, cli_users


def test_scaling_command_line_prints_and_writes_one_plan_per_rank_count(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    assert plan_main(["test-pixel-regression", "--machine", V100, "--scaling", "1,2,3",
                      "--memory-per-rank", "1GiB", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"predicted strong scaling of test-pixel-regression, batch "
                        f"{(BATCH, C, *SIZE)}, machine {V100}")
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "3"]
    rows = json.loads(path.read_text())["rows"]
    model, shape = training.build_model("test-pixel-regression", batch=BATCH)
    for row, p in zip(rows, [1, 2, 3]):
        want, _ = plan.make_plan(model, shape, p, V100, 2.0**30)
        assert row["ranks"] == p and row["time_ms"] == pytest.approx(1e3 * want.time)
        assert row["peak_MiB"] == pytest.approx(want.peak_memory / 2**20)
    assert rows[0]["sample_parallel_ms"] == pytest.approx(rows[0]["time_ms"])  # the one plan
    with pytest.raises(SystemExit):
        plan_main(["test-pixel-regression", "--scaling", "1,x"])
    assert "expected positive rank counts" in capsys.readouterr().err
