"""The training driver: distributed = serial losses, bitwise resume, and the demo learns."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import mpi_helpers
import numpy as np
import pytest
from mpi4py import MPI

from disttensor.testing import collective_assert
from disttensor_nn.layers.norm import BatchNormNd, set_batch_norm_stats
from disttensor_nn.plan import CostModel, MachineProfile, Planner, builtin_profiles, machine
from disttensor_nn.plan import calibrate as calibration
from disttensor_nn.training import TrainConfig, build_model, driver, loop, train

V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing


def shared_tmpdir(comm: MPI.Comm) -> str:
    return mpi_helpers.shared_tmpdir("dt-train-", comm)


def uniform_plan_file(model_name, size, batch, grid, directory) -> str:
    model, shape = build_model(model_name, size, batch)
    planner = Planner(model, shape, CostModel(builtin_profiles()[V100], int(np.prod(grid))))
    path = os.path.join(directory, f"plan-{'x'.join(map(str, grid))}.json")
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w") as f:
            f.write(planner.uniform_plan(grid).to_json())
    MPI.COMM_WORLD.Barrier()
    return path


def config(**kw) -> TrainConfig:
    base = dict(model="mesh-demo", size=(64, 64), batch=4, steps=10, samples=16,
                metrics=None, machine=V100, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parallel(4)
def test_hybrid_training_matches_one_rank():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    hybrid = uniform_plan_file("mesh-demo", (64, 64), 4, (2, 2, 1), tmp)
    dist = train(config(layout=hybrid))
    ref = None
    if comm.Get_rank() == 0:  # the same training on one rank
        model, shape = build_model("mesh-demo", (64, 64), 4)
        plan = Planner(model, shape, CostModel(builtin_profiles()[V100], 1)).uniform_plan(
            (1, 1, 1))
        path = os.path.join(tmp, "plan-1.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        ref = train(config(layout=path), comm=MPI.COMM_SELF)
    ref = comm.bcast(ref, root=0)
    a, b = np.array(_history(dist)), np.array(_history(ref))
    collective_assert(len(a) == 10 and np.allclose(a, b, rtol=2e-5, atol=0),
                      f"losses differ: {a} vs {b}")
    collective_assert(dist["ranks"] == 4 and ref["ranks"] == 1, "rank counts")


@pytest.mark.parallel([1, 2])
def test_group_batch_norm_statistics_change_the_losses_only_where_samples_are_split():
    """--bn-stats group: every batch norm takes its own samples' statistics where the
    samples are split (losses unlike the whole batch's), and is the same as global where
    they are not (one rank)."""
    comm = MPI.COMM_WORLD
    plan = uniform_plan_file("mesh-demo", (64, 64), 4, (comm.Get_size(), 1, 1),
                             shared_tmpdir(comm))
    a = np.array(_history(train(config(layout=plan, steps=3))))
    b = np.array(_history(train(config(layout=plan, steps=3, bn_stats="group"))))
    if comm.Get_size() == 1:
        collective_assert(np.array_equal(a, b), f"{a} vs {b}")
    else:
        collective_assert(not np.allclose(a[0], b[0], rtol=1e-6, atol=0), f"{a} vs {b}")


def test_set_batch_norm_stats_sets_every_batch_norm_and_refuses_other_values():
    model, _ = build_model("resnet18", (32, 32), 2)
    norms = [m for _, m in model.named_modules() if isinstance(m, BatchNormNd)]
    assert set_batch_norm_stats(model, "group") == len(norms) == 20
    assert all(m.stats == "group" for m in norms)
    with pytest.raises(ValueError, match="'global' or 'group'"):
        set_batch_norm_stats(model, "local")


@pytest.mark.parallel(3)
def test_accumulated_micro_batches_match_one_rank():
    """--accumulate: two micro-batches per step, one gradient reduction, the same losses
    as on one rank (where no reduction happens at all)."""
    comm = MPI.COMM_WORLD
    cfg = config(batch=2, accumulate=2, steps=4)
    dist = train(cfg)
    ref = comm.bcast(train(cfg, comm=MPI.COMM_SELF) if comm.Get_rank() == 0 else None)
    a, b = np.array(_history(dist)), np.array(_history(ref))
    collective_assert(len(a) == 4 and np.allclose(a, b, rtol=2e-5, atol=0),
                      f"losses differ: {a} vs {b}")
    collective_assert(a[-1] < a[0], f"no learning: {a}")
    with pytest.raises(ValueError, match="accumulate"):
        driver._model_and_data(config(accumulate=0))


def _history(summary: dict) -> list[float]:
    return summary["history"]


@pytest.mark.parallel(3)
def test_kept_synthetic_data_trains_the_same_and_is_counted():
    """A synthetic data set keeps its blocks after the first epoch (16 samples in batches
    of 4: epochs 2 and 3 copy them): the same losses bit for bit as making them again, and
    the kept bytes in the predicted peak, at most the whole data set's."""
    kept = train(config(steps=10))
    fresh = train(config(steps=10, keep_data=False))
    collective_assert(_history(kept) == _history(fresh), f"{_history(kept)} vs "
                                                          f"{_history(fresh)}")
    whole = 16 * (18 + 1) * 64 * 64 * 4
    collective_assert(0 < kept["predicted_kept_data_bytes"] <= whole,
                      f"{kept['predicted_kept_data_bytes']} of {whole}")
    collective_assert(fresh["predicted_kept_data_bytes"] == 0)


@pytest.mark.parallel(3)
def test_resume_is_bitwise_identical():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    ckpt = os.path.join(tmp, "ckpt")
    full = train(config(steps=6, metrics=os.path.join(tmp, "full")))
    train(config(steps=3, checkpoint=ckpt, metrics=os.path.join(tmp, "a")))
    resumed = train(config(steps=6, checkpoint=ckpt, resume=True,
                           metrics=os.path.join(tmp, "b")))
    collective_assert(_history(full) == _history(resumed),
                      f"{_history(full)} vs {_history(resumed)}")


@pytest.mark.parallel(4)
def test_default_demo_halves_the_loss():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    d = TrainConfig()
    s = train(TrainConfig(machine=V100, progress=False, metrics=os.path.join(tmp, "demo")))
    h = _history(s)
    collective_assert(s["steps"] == d.steps and h[-1] <= 0.5 * h[0],
                      f"loss {h[0]} -> {h[-1]} in {s['steps']} steps")


def test_plot_writes_png_files(tmp_path):
    from disttensor_nn.training import plot_metrics

    prefix = str(tmp_path / "run")
    train(config(steps=2, metrics=prefix), comm=MPI.COMM_SELF)
    paths = plot_metrics(prefix + ".json")
    assert [p.rsplit("-", 1)[1] for p in paths] == ["loss.png", "layers.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_train_command_line(tmp_path, capsys):
    from disttensor_nn.training.cli import train_main

    prefix = str(tmp_path / "cli")
    assert train_main(["mesh-demo", "--size", "64x64", "--batch", "2", "--steps", "2",
                       "--machine", V100, "--no-progress", "--metrics", prefix]) == 0
    out = capsys.readouterr().out
    assert "predicted time per iteration" in out and "loss" in out
    assert os.path.exists(prefix + ".csv") and os.path.exists(prefix + ".json")


def test_train_command_line_runs_on_channels_last_blocks(tmp_path, capsys):
    """``disttensor-train --memory-format channels_last`` plans and trains in that format
    (the plan table says so; layers that do not take such blocks get C-order copies); a
    bad name stops with one message and exit 2."""
    from disttensor_nn.training.cli import train_main

    argv = ["mesh-demo", "--size", "64x64", "--batch", "2", "--steps", "2", "--machine",
            V100, "--no-progress", "--metrics", ""]
    assert train_main([*argv, "--memory-format", "channels_last"]) == 0
    out = capsys.readouterr().out
    assert "blocks in channels_last memory format" in out and "loss" in out
    with pytest.raises(SystemExit) as exc:
        train_main([*argv, "--memory-format", "nhwc"])
    assert exc.value.code == 2
    assert "--memory-format" in capsys.readouterr().err


# --------------------------------------------------------------------------- the command lines
def _usage_error(capsys, argv, main=None) -> str:
    """Run a command line that must stop with exit status 2 before any work; its stderr."""
    from disttensor_nn.training.cli import train_main

    with pytest.raises(SystemExit) as exc:
        (main or train_main)(argv)
    assert exc.value.code == 2, exc.value.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


TRAIN = ["mesh-demo", "--machine", V100, "--no-progress", "--metrics", ""]


@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], "--steps: must be > 0"),
    (["--steps", "-3"], "--steps: must be > 0"),
    (["--steps", "many"], "expected an integer"),
    (["--batch", "0"], "--batch: must be > 0"),
    (["--lr", "0"], "--lr: must be > 0"),
    (["--samples", "0"], "--samples: must be > 0"),
    (["--accumulate", "0"], "--accumulate: must be > 0"),
    (["--checkpoint-every", "-1"], "must be >= 0"),
    (["--size", "256by256"], "positive ints joined by 'x'"),
    (["--size", "0x0"], "entries must be >= 1"),
    (["--size", "64"], "takes 2-D sizes like 256x256"),
    (["--size", "256x256x256"], "takes 2-D sizes like 256x256"),
    (["--size", "100x100"], "96 or 104"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint"),
    (["--data", "/no/such/dir"], "--data /no/such/dir: no such file or directory"),
    (["--ranks-layout", "/no/such/plan.json"], "/no/such/plan.json: cannot read"),
    (["--memory-per-rank", "1KiB", "--size", "64x64"], "error:"),
    (["--memory-per-rank", "lots"], "cannot read a memory size"),
    (["--bn-stats", "local"], "--bn-stats: invalid choice"),
])
def test_train_command_line_refuses_bad_arguments_with_one_usage_message(capsys, argv, words):
    err = _usage_error(capsys, TRAIN + argv)
    assert words in err, err
    assert err.count("error:") == 1, err


def test_train_command_line_names_what_is_wrong_with_a_plan_file(tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert "bad.json: not JSON" in _usage_error(capsys, TRAIN + ["--ranks-layout",
                                                                 str(bad_json)])
    schema = tmp_path / "schema.json"
    schema.write_text('{"nprocs": 1}')
    err = _usage_error(capsys, TRAIN + ["--ranks-layout", str(schema)])
    assert "schema.json: not a plan written by disttensor-plan" in err, err
    plan = uniform_plan_file("mesh-demo", (64, 64), 4, (1, 1, 1), str(tmp_path))
    err = _usage_error(capsys, TRAIN + ["--ranks-layout", plan, "--size", "64x64",
                                        "--batch", "2"])
    assert "batches of shape (4, 18, 64, 64)" in err and "(2, 18, 64, 64)" in err, err
    (tmp_path / "other").mkdir()
    other = uniform_plan_file("mesh-small", (64, 64), 4, (1, 1, 1), str(tmp_path / "other"))
    err = _usage_error(capsys, TRAIN + ["--ranks-layout", other, "--size", "64x64"])
    assert "made for another model" in err, err


def test_help_gives_every_option_a_text_and_a_default(capsys):
    from disttensor_nn.training.cli import plan_main, train_main

    for main, least in ((train_main, 18), (plan_main, 10)):
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        options = text.split("options:")[1]
        entries = [e for e in options.split("\n  -")[1:] if not e.startswith("h, --help")]
        assert len(entries) >= least, text
        for entry in entries:
            flag, _, rest = entry.partition("  ")
            assert rest.strip(), f"no help text for -{flag}"
            assert "(default:" in entry or "store_true" in entry or \
                flag.split()[0] in ("-resume", "-no-progress", "-recalibrate", "-no-measure",
                                    "-calibrate"), f"no default shown for -{flag}"
        if main is plan_main:
            assert "v100-nvlink-edr" in text and "h200-nvlink-ndr" in text, text


def test_resume_reports_its_step_and_refuses_steps_not_above_it(tmp_path, capsys):
    from disttensor_nn.training.cli import train_main

    ck = str(tmp_path / "ck")
    common = TRAIN + ["--size", "64x64", "--batch", "2", "--samples", "4", "--checkpoint", ck]
    assert train_main(common + ["--steps", "2"]) == 0
    capsys.readouterr()
    err = _usage_error(capsys, common + ["--steps", "2", "--resume"])
    assert "is at step 2" in err and "--steps 2 is not above it" in err, err
    assert train_main(common + ["--steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from step 2" in out, out
    err = _usage_error(capsys, TRAIN + ["--size", "64x64", "--resume", "--checkpoint",
                                        str(tmp_path / "none")])
    assert "no checkpoint at" in err, err


def test_train_reports_plan_first_compute_and_data_apart_and_where_metrics_go(tmp_path,
                                                                               capsys):
    from disttensor_nn.training.cli import train_main

    prefix = str(tmp_path / "run")
    assert train_main(["mesh-demo", "--machine", V100, "--no-progress", "--size", "64x64",
                       "--batch", "2", "--steps", "1", "--samples", "2",
                       "--metrics", prefix]) == 0
    out = capsys.readouterr().out
    assert out.index("predicted time per iteration") < out.index("loss ")
    assert "on 1 rank: 1 step" in out and "1 ranks" not in out, out
    assert "compute" in out and "data loading" in out, out
    assert f"metrics written to {prefix}.csv and .json" in out, out
    header = open(prefix + ".csv").readline().strip().split(",")
    assert header == ["step", "loss", "time_s", "compute_s", "data_s", "samples_per_s"]


def test_a_metrics_prefix_that_cannot_be_written_is_refused_before_training(tmp_path,
                                                                             capsys):
    """--metrics in a folder that cannot be made: one message, exit 2, before any step (it
    failed after the whole run); a missing folder is made."""
    from disttensor_nn.training.cli import train_main

    (tmp_path / "file").write_text("")
    argv = ["mesh-demo", "--machine", V100, "--no-progress", "--size", "64x64", "--batch",
            "2", "--steps", "1", "--samples", "2"]
    err = _usage_error(capsys, argv + ["--metrics", str(tmp_path / "file" / "sub" / "run")])
    assert "--metrics" in err and "cannot make the folder" in err, err
    prefix = tmp_path / "new" / "deeper" / "run"
    assert train_main(argv + ["--metrics", str(prefix)]) == 0
    assert os.path.exists(f"{prefix}.csv") and os.path.exists(f"{prefix}.json")


def test_train_on_a_directory_of_npy_samples(tmp_path, capsys):
    from disttensor_nn.training import MeshSynthetic, save_npy_dataset
    from disttensor_nn.training.cli import train_main

    save_npy_dataset(tmp_path / "data", MeshSynthetic(4, (64, 64), channels=18, seed=1))
    assert train_main(TRAIN + ["--data", str(tmp_path / "data"), "--batch", "2",
                               "--steps", "1"]) == 0
    assert "(2, 18, 64, 64)" in capsys.readouterr().out
    err = _usage_error(capsys, TRAIN + ["--data", str(tmp_path / "data"), "--size", "32x32",
                                        "--steps", "1"])
    assert "(18, 64, 64)" in err, err


def _python_m(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env.update(kw.pop("env", {}))
    drop = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "_PYTEST_MPI")
    env = {k: v for k, v in env.items() if not k.startswith(drop)}
    cmd = kw.pop("prefix", []) + [sys.executable, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_python_m_entry_points_do_what_their_names_say():
    r = _python_m(["-m", "disttensor_nn.train", "--help"])
    assert r.returncode == 0 and "usage: disttensor-train" in r.stdout, r.stderr
    r = _python_m(["-m", "disttensor_nn.plan", "--help"])
    assert r.returncode == 0 and "usage: disttensor-plan" in r.stdout, r.stderr
    for module in ("disttensor_nn.cli", "disttensor_nn.training.cli"):
        r = _python_m(["-m", module])
        assert r.returncode == 2 and "python -m disttensor_nn.train" in r.stderr, r.stderr


def test_import_without_an_mpi_library_raises_one_clear_import_error(tmp_path):
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "MPI.py").write_text("raise RuntimeError('cannot load MPI library\\n"
                                 + "dlopen details\\n" * 30 + "')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = _python_m(["-c", "import disttensor"], env={"PYTHONPATH": f"{tmp_path}:{root}"})
    assert r.returncode == 1
    assert 'pip install "disttensor[mpich]"' in r.stderr and "ImportError" in r.stderr
    assert "cannot load MPI library" in r.stderr and "dlopen details" not in r.stderr
    assert len(r.stderr.splitlines()) < 12, r.stderr


def test_under_mpiexec_a_bad_argument_gives_one_message_and_exit_2():
    from disttensor.testing.launch import mpiexec_path

    for argv, words in ((["--steps", "0"], "--steps: must be > 0"),
                        (["--size", "100x100"], "96 or 104")):
        r = _python_m(["-m", "disttensor_nn.train", *TRAIN, *argv],
                      prefix=[mpiexec_path(), "-n", "2"])
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert words in r.stderr and r.stderr.count("error:") == 1, r.stderr
        assert r.stderr.count("usage:") == 1, r.stderr


def test_plot_help_shows_no_markup(capsys):
    from disttensor_nn.training.plot import plot_main

    with pytest.raises(SystemExit):
        plot_main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and "PREFIX-loss.png" in text, text


def _train_on_cached(monkeypatch, capsys, **profile) -> tuple[str, str]:
    """Train a step on ``machine="this"`` whose cached calibration is the V100 profile with
    ``profile``'s fields replaced (taken by this version's method unless given);
    (the calibration's path, what the run printed)."""
    profile.setdefault("calibration_method", calibration.METHOD)
    comm = MPI.COMM_WORLD
    path = os.path.join(shared_tmpdir(comm), "machine.json")
    if comm.Get_rank() == 0:
        dataclasses.replace(builtin_profiles()[V100], name="this:test", **profile).save(path)
    comm.Barrier()
    for module in (machine, loop, calibration):
        monkeypatch.setattr(module, "this_machine_path", lambda *a, **k: path)
    train(config(machine="this", steps=1, samples=4, batch=2))
    return path, capsys.readouterr().out


@pytest.mark.parallel(2)
def test_a_cached_calibration_says_when_and_under_what_load_it_was_taken(monkeypatch, capsys):
    comm = MPI.COMM_WORLD
    path, out = _train_on_cached(
        monkeypatch, capsys, load_per_core=9.0, calibrated_ranks_per_node=comm.Get_size(),
        notes="calibrated with 2 ranks on 2026-01-01 10:00 under a load average of 18.0 on "
              "2 cores")
    if comm.Get_rank() == 0:
        assert f"using the cached calibration {path}" in out, out
        assert "2026-01-01 10:00 under a load average of 18.0" in out, out
        assert "warning: that calibration was taken under a load of 9.0 per core" in out, out
        assert "--recalibrate" in out
    else:
        assert out == "", out


@pytest.mark.parallel([2, 3])
def test_a_calibration_by_another_number_of_ranks_per_node_is_taken_again(monkeypatch, capsys):
    """Ranks sharing a node share its cores: a job does not plan on a calibration taken
    with another number of ranks per node, it calibrates again and says why."""
    comm = MPI.COMM_WORLD
    other = comm.Get_size() + 2
    path, out = _train_on_cached(monkeypatch, capsys, measured=True,
                                 calibrated_ranks_per_node=other)
    if comm.Get_rank() == 0:
        assert (f"was taken with {other} ranks per node and this job has {comm.Get_size()}: "
                "calibrating again") in out, out
        assert "using the cached calibration" not in out, out
    comm.Barrier()
    collective_assert(MachineProfile.load(path).calibrated_ranks_per_node == comm.Get_size(),
                      "the new calibration is not the one saved")


@pytest.mark.parallel(1)
def test_one_rank_without_a_calibration_measures_its_compute_and_times_its_kernels(
        monkeypatch, capsys, tmp_path):
    """A first run on one rank plans on this machine's own measured compute rates (kept
    apart from the several-rank calibration, which it does not make) with every kernel
    timed, not on a published profile; the next run reads the rates it kept."""
    several, alone = str(tmp_path / "machine.json"), str(tmp_path / "machine-1rank.json")
    for module in (machine, loop, calibration):
        monkeypatch.setattr(module, "this_machine_path",
                            lambda *a, one_rank=False, **k: alone if one_rank else several)
    summary = train(config(machine="this", steps=2, samples=4, batch=2))
    out = capsys.readouterr().out
    assert f"1 rank: measuring this rank's compute rates (one rank sends no message; kept in " \
           f"{alone}" in out, out
    assert not os.path.exists(several)
    profile = MachineProfile.load(alone)
    assert profile.measured and profile.calibrated_ranks_per_node == 1, profile
    assert profile.name.startswith("this:"), profile.name
    assert f"(this:{profile.name.split(':', 1)[1]})" in out and "estimated" not in out, out
    assert summary["predicted_time_per_iteration_s"] > 0
    train(config(machine="this", steps=1, samples=4, batch=2))
    out = capsys.readouterr().out
    assert f"1 rank: kernels timed here, on this rank's cached compute rates {alone}" in out, out
