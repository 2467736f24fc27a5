"""disttensor_nn.optim: Adam, AdamW, the learning-rate schedulers and gradient clipping.

Adam and AdamW (amsgrad on and off, with and without weight decay), under
each schedule and with clipping, are compared step for step in float64 with
``torch.optim`` (skipped without PyTorch) and with a NumPy reference written
out here from the published formulas (so the comparison still checks
something without PyTorch). ``clip_grad_norm_`` is compared with the norm of
the gathered whole gradient at 1-4 ranks, with replicated parameters,
sharded ones, sharded ones with replicas and ones with empty blocks. State
dictionaries are whole and load under another split; a checkpoint resumes
the schedule exactly; bad input raises the same exception on every rank and
changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import pathlib

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.backend import array_namespace, to_numpy
from disttensor.testing import collective_assert, collective_outcome
from disttensor_nn.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm_, lr_scheduler
from disttensor_nn.training import TrainConfig, train
from disttensor_nn.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from disttensor_nn.training.cli import train_main
from disttensor_nn.training.recipe import (
    make_optimizer,
    make_scheduler,
    recipe_problem,
    resume_problem,
    scheduler_class,
)

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3, 4]
SHAPES = [(5, 3), (7,), (4, 2, 3)]
STEPS = 12
TOL = 1e-12


@functools.cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


def g2(p: int) -> tuple[int, int]:
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


def full_values(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def grads_of(step: int) -> list[np.ndarray]:
    """The whole gradients of step ``step`` (the same on every rank)."""
    return [full_values(s, 1000 * step + k) * (1 + step % 3) for k, s in enumerate(SHAPES)]


def schedule(kind, opt, mod):
    """The scheduler ``kind`` of ``opt`` from ``mod`` (ours or torch's lr_scheduler)."""
    if kind == "none":
        return None
    if kind == "step":
        return mod.StepLR(opt, step_size=4, gamma=0.5)
    if kind == "cosine":
        return mod.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4)
    if kind == "linear":
        return mod.LinearLR(opt, start_factor=0.25, end_factor=1.0, total_iters=5)
    if kind == "lambda":
        return mod.LambdaLR(opt, lambda e: 0.95 ** e)
    if kind == "warmup-cosine":
        return mod.SequentialLR(opt, [mod.LinearLR(opt, 0.1, 1.0, 3),
                                      mod.CosineAnnealingLR(opt, 9, 1e-3)], milestones=[3])
    raise AssertionError(kind)


SCHEDULE_KINDS = ["none", "step", "cosine", "linear", "lambda", "warmup-cosine"]


def closed_form_lr(kind: str, base: float, e: int) -> float:
    """The schedules' learning rate at step ``e``, written out from their definitions."""
    if kind == "none":
        return base
    if kind == "step":
        return base * 0.5 ** (e // 4)
    if kind == "cosine":
        return 1e-4 + (base - 1e-4) * (1 + math.cos(math.pi * e / 7)) / 2
    if kind == "linear":
        return base * (0.25 + 0.75 * min(e, 5) / 5)
    if kind == "lambda":
        return base * 0.95 ** e
    if kind == "warmup-cosine":
        if e < 3:
            return base * (0.1 + 0.9 * e / 3)
        return 1e-3 + (base - 1e-3) * (1 + math.cos(math.pi * (e - 3) / 9)) / 2
    raise AssertionError(kind)


class NumpyAdam:
    """Adam / AdamW from the papers' formulas, on whole NumPy arrays."""

    def __init__(self, ws, lr, betas, eps, wd, amsgrad, decoupled):
        self.ws = [w.copy() for w in ws]
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, wd
        self.amsgrad, self.decoupled = amsgrad, decoupled
        self.m = [np.zeros_like(w) for w in ws]
        self.v = [np.zeros_like(w) for w in ws]
        self.vmax = [np.zeros_like(w) for w in ws]
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, g in enumerate(grads):
            w = self.ws[i]
            if self.wd and self.decoupled:
                w = w * (1 - self.lr * self.wd)
            elif self.wd:
                g = g + self.wd * w
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            v = self.v[i]
            if self.amsgrad:
                self.vmax[i] = np.maximum(self.vmax[i], v)
                v = self.vmax[i]
            m_hat = self.m[i] / (1 - self.b1 ** self.t)
            v_hat = v / (1 - self.b2 ** self.t)
            self.ws[i] = w - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


def reference_clip(grads, max_norm):
    total = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
    coef = max_norm / (total + 1e-6)
    return ([g * coef for g in grads] if coef < 1 else grads), total


def close(a, b, tol=TOL) -> bool:
    return np.allclose(a, b, rtol=tol, atol=tol)


CASES = [(cls, amsgrad, wd) for cls in (Adam, AdamW) for amsgrad in (False, True)
         for wd in (0.0, 0.05)]


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("cls,amsgrad,wd", CASES)
def test_adam_matches_a_numpy_reference_under_each_schedule_with_clipping(cls, amsgrad, wd,
                                                                          kind):
    w0 = [full_values(s, k) for k, s in enumerate(SHAPES)]
    params = [nn.Parameter(w.copy()) for w in w0]
    opt = cls(params, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, amsgrad=amsgrad)
    sched = schedule(kind, opt, lr_scheduler)
    ref = NumpyAdam(w0, 0.01, (0.8, 0.99), 1e-6, wd, amsgrad, cls is AdamW)
    for step in range(STEPS):
        want_lr = closed_form_lr(kind, 0.01, step)
        assert math.isclose(opt.lr, want_lr, rel_tol=TOL), (step, opt.lr, want_lr)
        grads = grads_of(step)
        for p, g in zip(params, grads):
            p.grad = g.copy()
        clipped, total = reference_clip(grads, 4.0)
        assert math.isclose(clip_grad_norm_(params, 4.0), total, rel_tol=TOL)
        ref.lr = opt.lr
        ref.step(clipped)
        opt.step()
        if sched is not None:
            sched.step()
        for p, w in zip(params, ref.ws):
            assert close(p.data, w), (step, np.abs(p.data - w).max())


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("cls,amsgrad,wd", CASES)
def test_adam_matches_torch_step_for_step(cls, amsgrad, wd, kind):
    torch = pytest.importorskip("torch")
    w0 = [full_values(s, k) for k, s in enumerate(SHAPES)]
    params = [nn.Parameter(w.copy()) for w in w0]
    tparams = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in w0]
    tcls = {Adam: torch.optim.Adam, AdamW: torch.optim.AdamW}[cls]
    kw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, amsgrad=amsgrad)
    opt, topt = cls(params, **kw), tcls(tparams, **kw)
    sched, tsched = schedule(kind, opt, lr_scheduler), schedule(kind, topt,
                                                                 torch.optim.lr_scheduler)
    for step in range(STEPS):
        assert opt.lr == topt.param_groups[0]["lr"], step
        for p, tp, g in zip(params, tparams, grads_of(step)):
            p.grad = g.copy()
            tp.grad = torch.tensor(g)
        total = clip_grad_norm_(params, 4.0)
        ttotal = torch.nn.utils.clip_grad_norm_(tparams, 4.0)
        assert math.isclose(total, float(ttotal), rel_tol=TOL)
        opt.step()
        topt.step()
        if sched is not None:
            sched.step()
            tsched.step()
            assert sched.get_last_lr() == [float(v) for v in tsched.get_last_lr()]
        for p, tp in zip(params, tparams):
            assert close(p.data, tp.detach().numpy()), step
    # the same state: moments and step counts
    theirs = topt.state_dict()["state"]
    for i, mine in enumerate(opt.state_dict()["state"]):
        assert mine["step"] == int(theirs[i]["step"])
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert close(mine[key], theirs[i][key].numpy()), key
    if sched is not None:
        mine, theirs = sched.state_dict(), tsched.state_dict()
        assert mine["last_epoch"] == theirs["last_epoch"]
        assert mine["_last_lr"] == [float(v) for v in theirs["_last_lr"]]


def test_schedulers_match_torch_with_sgd_and_restart_from_their_state():
    torch = pytest.importorskip("torch")
    for kind in SCHEDULE_KINDS[1:]:
        p = nn.Parameter(np.zeros(2))
        tp = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt, topt = SGD([p], lr=0.3, momentum=0.9), torch.optim.SGD([tp], lr=0.3, momentum=0.9)
        sched = schedule(kind, opt, lr_scheduler)
        tsched = schedule(kind, topt, torch.optim.lr_scheduler)
        lrs, tlrs = [], []
        for step in range(20):
            if step == 8:  # a fresh scheduler and optimizer continue from the saved states
                saved, saved_opt = sched.state_dict(), opt.state_dict()
                opt = SGD([p], lr=0.3, momentum=0.9)
                sched = schedule(kind, opt, lr_scheduler)
                opt.load_state_dict(saved_opt)
                sched.load_state_dict(saved)
            lrs.append(opt.lr)
            tlrs.append(topt.param_groups[0]["lr"])
            opt.step()
            topt.step()
            sched.step()
            tsched.step()
        assert lrs == tlrs, (kind, lrs, tlrs)


@pytest.mark.parametrize("device", [None, "device1"])
def test_adam_on_another_array_module_matches_numpy_and_follows_a_move(device):
    xps = pytest.importorskip("array_api_strict")
    dev = None if device is None else xps.Device(device)
    w0 = [full_values(s, k) for k, s in enumerate(SHAPES)]
    host = [nn.Parameter(w.copy()) for w in w0]
    moved = [nn.Parameter(w.copy()) for w in w0]
    kw = dict(lr=0.01, weight_decay=0.02, amsgrad=True)
    ref, opt = AdamW(host, **kw), AdamW(moved, **kw)
    for step in range(4):
        if step == 1:  # the model moves to the other module after its first step
            for p in moved:
                p.data = xps.asarray(p.data, device=dev)
        for p, q, g in zip(host, moved, grads_of(step)):
            p.grad = g.copy()
            q.grad = g.copy() if step == 0 else xps.asarray(g, device=dev)
        clip_grad_norm_(host, 2.0)
        clip_grad_norm_(moved, 2.0)
        ref.step()
        opt.step()
    for p, q, st in zip(host, moved, opt.state):
        assert array_namespace(q.data) is xps and array_namespace(st["exp_avg"]) is xps
        assert st["max_exp_avg_sq"].device == q.data.device
        assert close(to_numpy(q.data), p.data)
    state = opt.state_dict()
    assert isinstance(state["state"][0]["exp_avg"], np.ndarray)
    opt.load_state_dict(state)
    assert array_namespace(opt.state[0]["exp_avg_sq"]) is xps
    assert opt.state[0]["exp_avg_sq"].device == moved[0].data.device


def test_param_groups_and_attributes_are_one_thing():
    p = nn.Parameter(np.ones(3))
    opt = AdamW([p])
    assert opt.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                            "weight_decay": 1e-2, "amsgrad": False}
    assert opt.param_groups[0]["params"] == [p] and isinstance(opt, Optimizer)
    opt.param_groups[0]["lr"] = 0.5
    assert opt.lr == 0.5
    opt.lr = 0.25
    assert opt.param_groups[0]["lr"] == 0.25
    assert Adam([p]).weight_decay == 0.0 and SGD([p], lr=0.1).nesterov is False


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("momentum,dampening,decay", [(0.9, 0.0, 1e-3), (0.9, 0.5, 0.0),
                                                       (0.0, 0.0, 1e-2)])
def test_sgd_in_pieces_over_threads_is_the_formula_element_for_element(threads, momentum,
                                                                      dampening, decay):
    """SGD sweeps large float32 parameters in pieces shared out over the NumPy kernels'
    threads (by_chunks): every element as the whole-array formula gives it, bit for bit,
    with a length that is no multiple of a piece and a parameter smaller than one."""
    from disttensor_nn.kernels import numpy_kernels
    from disttensor_nn.optim.optimizer import CHUNK
    rng = np.random.default_rng(3)
    shapes = [(5 * CHUNK + 123,), (7, 3)]
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    before = numpy_kernels.get_num_threads()
    numpy_kernels.set_num_threads(threads)
    try:
        params = [nn.Parameter(w.copy()) for w in w0]
        opt = SGD(params, lr=0.1, momentum=momentum, dampening=dampening,
                  weight_decay=decay)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad[...] = gi
            opt.step()
    finally:
        numpy_kernels.set_num_threads(before)
    lr, m, dmp, wd = (np.float32(v) for v in (0.1, momentum, dampening, decay))
    for i, w in enumerate(w0):
        w, buf = w.copy(), None
        for g in grads:
            d = (w * wd + g[i]) if decay else g[i]
            if momentum:
                buf = d.copy() if buf is None else buf * m + (d if dampening == 0 else
                                                             (1 - dmp) * d)
                d = buf
            w = w - d * lr
        assert np.array_equal(params[i].data, w), (i, np.abs(params[i].data - w).max())


def test_sgd_state_dict_keeps_its_format():
    p = nn.Parameter(np.ones(3))
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad[...] = 1
    opt.step()
    state = opt.state_dict()
    assert sorted(state) == ["lr", "momentum", "state"]
    assert isinstance(state["state"][0], np.ndarray)
    opt2 = SGD([nn.Parameter(np.ones(3))], lr=0.5, momentum=0.0)
    opt2.load_state_dict(state)
    assert opt2.lr == 0.1 and opt2.momentum == 0.9 and np.array_equal(opt2.state[0], np.ones(3))


def test_clip_grad_norm_of_other_orders_matches_the_formula():
    grads = [full_values(s, k) for k, s in enumerate(SHAPES)]
    flat = np.concatenate([g.ravel() for g in grads])
    for norm_type, want in ((1.0, np.abs(flat).sum()), (3.0, (np.abs(flat) ** 3).sum() ** (1 / 3)),
                            (math.inf, np.abs(flat).max())):
        params = [nn.Parameter(np.zeros(s)) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.copy()
        total = clip_grad_norm_(params, 0.5, norm_type=norm_type)
        assert math.isclose(total, want, rel_tol=TOL)
        for p, g in zip(params, grads):
            assert close(p.grad, g * 0.5 / (want + 1e-6))
    p = nn.Parameter(np.zeros(2))
    p.grad = np.array([np.inf, 1.0])
    with pytest.raises(RuntimeError, match="non-finite|is inf"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert p.grad[1] == 1.0  # nothing scaled
    q = nn.Parameter(np.zeros(2))
    q.grad = np.array([0.3, 0.4])
    assert math.isclose(clip_grad_norm_(q, 1.0), 0.5) and np.array_equal(q.grad, [0.3, 0.4])


# --------------------------------------------------------------------------- distributed
def layouts():
    """(shape, dist) of parameters: replicated, split over all ranks, split with replicas,
    and split with empty blocks (3 rows over 4 ranks)."""
    p = comm.Get_size()
    return [
        ((5, 3), None),
        ((7, 4), dt.Distribution((7, 4), grid((p,)), (0, None))),
        ((6, 5), dt.Distribution((6, 5), grid(g2(p)), (0, None))),  # grid axis 1: replicas
        ((2, 3, 5), dt.Distribution((2, 3, 5), grid(g2(p)), (None, 1, 0))),
        ((3, 2), dt.Distribution((3, 2), grid((p,)), (0, None))),
    ]


def block(full, dist):
    return full.copy() if dist is None else full[dist.local_slices()].copy()


def make_params(dists, seed=0):
    return [nn.Parameter(block(full_values(s, seed + k), d), d)
            for k, (s, d) in enumerate(dists)]


def layer_grads(step, dists):
    return [full_values(s, 500 + 37 * step + k) for k, (s, _) in enumerate(dists)]


@pytest.mark.parallel(SIZES)
def test_clip_grad_norm_is_the_norm_of_the_gathered_gradient_on_every_rank():
    try:
        torch = pytest.importorskip("torch")  # the optional oracle; the test runs without it
    except pytest.skip.Exception:
        torch = None
    dists = layouts()
    for norm_type in (2.0, 1.0, math.inf):
        for max_norm in (1e3, 2.0):
            params = make_params(dists)
            fulls = layer_grads(0, dists)
            for p, g, (_, d) in zip(params, fulls, dists):
                p.grad = block(g, d)
            flat = np.concatenate([g.ravel() for g in fulls])
            want = (np.abs(flat).max() if norm_type == math.inf
                    else (np.abs(flat) ** norm_type).sum() ** (1 / norm_type))
            total, err = collective_outcome(clip_grad_norm_, params, max_norm, norm_type)
            collective_assert(err is None and math.isclose(total, want, rel_tol=TOL),
                              f"norm {total} vs {want} ({err})")
            collective_assert(len(set(comm.allgather(total))) == 1, "ranks differ")
            coef = min(1.0, max_norm / (want + 1e-6))
            ok = all(close(p.grad, block(g * coef, d)) for p, g, (_, d) in
                     zip(params, fulls, dists))
            collective_assert(ok, f"clipped gradients, norm_type {norm_type}")
            if torch is not None:
                tp = [torch.nn.Parameter(torch.tensor(g)) for g in fulls]
                for t, g in zip(tp, fulls):
                    t.grad = torch.tensor(g)
                tt = float(torch.nn.utils.clip_grad_norm_(tp, max_norm, norm_type))
                collective_assert(math.isclose(total, tt, rel_tol=TOL), f"{total} vs torch {tt}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("cls,amsgrad,wd", [(Adam, False, 0.01), (AdamW, True, 0.05)])
def test_sharded_adam_state_is_laid_out_as_its_parameter_and_loads_under_another_split(
        cls, amsgrad, wd):
    dists = layouts()
    params = make_params(dists)
    opt = cls(params, lr=0.02, weight_decay=wd, amsgrad=amsgrad)
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    ref = NumpyAdam([full_values(s, k) for k, (s, _) in enumerate(dists)], 0.02,
                    (0.9, 0.999), 1e-8, wd, amsgrad, cls is AdamW)
    check = []

    def run(opt, params, sched, steps):
        for step in steps:
            fulls = layer_grads(step, dists)
            for p, g in zip(params, fulls):
                p.grad = block(g, p.dist)
            ref.lr = opt.lr
            ref.step(fulls)
            opt.step()
            sched.step()
            check.append(all(close(p.data, block(w, p.dist))
                             for p, w in zip(params, ref.ws)))

    run(opt, params, sched, range(3))
    for i, p in enumerate(params):  # the moments are blocks like their parameters
        check.append(opt.state[i]["exp_avg"].shape == p.local_shape)
    state, sched_state = opt.state_dict(), sched.state_dict()  # collective: whole arrays
    check.append(all(close(s["exp_avg"], m) and close(s["exp_avg_sq"], v)
                     for s, m, v in zip(state["state"], ref.m, ref.v)))
    # another split: everything replicated but the second, split along the other dimension
    p = comm.Get_size()
    others = [(s, None) for s, _ in dists]
    others[1] = ((7, 4), dt.Distribution((7, 4), grid(g2(p)), (None, (0, 1))))
    fresh = [nn.Parameter(block(w, d), d) for w, (_, d) in zip(ref.ws, others)]
    opt2 = cls(fresh, lr=0.5)
    sched2 = lr_scheduler.CosineAnnealingLR(opt2, T_max=6)
    opt2.load_state_dict(state)
    sched2.load_state_dict(sched_state)
    check.append(opt2.lr == opt.lr and opt2.weight_decay == wd and opt2.amsgrad == amsgrad)
    run(opt2, fresh, sched2, range(3, 6))
    # a layer re-splitting a parameter: the state follows it
    fresh[1].shard_(dists[1][1])
    run(opt2, fresh, sched2, range(6, 8))
    collective_assert(all(check), f"checks {check}")


@pytest.mark.parallel(SIZES)
def test_bad_arguments_raise_the_same_error_on_every_rank_and_change_nothing():
    params = make_params(layouts())
    before = [p.data.copy() for p in params]
    opt = Adam(params, lr=0.1)
    cases = [
        (lambda: Adam(params, lr=-1e-3), ValueError, "lr must be >= 0"),
        (lambda: Adam(params, betas=(1.0, 0.9)), ValueError, "betas[0]"),
        (lambda: Adam(params, betas=(0.9, -0.1)), ValueError, "betas[1]"),
        (lambda: Adam(params, eps=-1.0), ValueError, "eps"),
        (lambda: AdamW(params, weight_decay=-0.01), ValueError, "weight_decay"),
        (lambda: SGD(params, lr=0.1, weight_decay=-1.0), ValueError, "weight_decay"),
        (lambda: SGD(params, lr=-0.1), ValueError, "lr must be positive"),
        (lambda: SGD(params, lr=0.1, momentum=-0.5), ValueError, "momentum"),
        (lambda: Adam(params[0]), TypeError, "iterable of Parameters"),
        (lambda: Adam([params[0], params[0]]), ValueError, "twice"),
        (lambda: clip_grad_norm_(params, -1.0), ValueError, "max_norm"),
        (lambda: clip_grad_norm_(params, 1.0, norm_type=0), ValueError, "norm_type"),
        (lambda: lr_scheduler.StepLR(opt, step_size=0), ValueError, "step_size"),
        (lambda: lr_scheduler.CosineAnnealingLR(opt, T_max=0), ValueError, "T_max"),
        (lambda: lr_scheduler.LinearLR(opt, start_factor=0.0), ValueError, "greater than 0"),
        (lambda: lr_scheduler.LinearLR(opt, end_factor=1.5), ValueError, "end_factor"),
        (lambda: lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(opt, 2)], [3]),
         ValueError, "number of milestones"),
        (lambda: lr_scheduler.StepLR(object(), 2), TypeError, "is not an Optimizer"),
        (lambda: opt.load_state_dict(SGD(params, lr=0.1, momentum=0.9).state_dict()),
         ValueError, "another optimizer"),
        (lambda: opt.load_state_dict({**opt.state_dict(), "state": [None]}), ValueError,
         "for 1 parameters"),
        (lambda: opt.load_state_dict({**opt.state_dict(), "lr": -2.0}), ValueError, "lr"),
    ]
    for fn, kind, words in cases:
        _, err = collective_outcome(fn)
        collective_assert(isinstance(err, kind) and words in str(err),
                          f"{words}: got {type(err).__name__}: {err}")
    collective_assert(opt.lr == 0.1 and opt.state == [None] * len(params), "changed")
    # a state of another amsgrad, or a moment of another shape: refused, nothing changed
    for p in params:
        p.grad[...] = 1
    opt.step()
    good = opt.state_dict()
    after = [p.data.copy() for p in params]
    bad = dict(good, state=[dict(s) for s in good["state"]])
    bad["state"][0]["exp_avg"] = np.zeros((2, 2))
    _, err = collective_outcome(opt.load_state_dict, bad)
    collective_assert(isinstance(err, ValueError) and "(2, 2)" in str(err), str(err))
    _, err = collective_outcome(opt.load_state_dict, dict(good, amsgrad=True))
    collective_assert(isinstance(err, ValueError) and "max_exp_avg_sq" in str(err), str(err))
    collective_assert(all(np.array_equal(p.data, a) for p, a in zip(params, after)) and
                      not all(np.array_equal(p.data, b) for p, b in zip(params, before)),
                      "the parameters changed")
    sched = lr_scheduler.StepLR(opt, 2)
    _, err = collective_outcome(sched.load_state_dict,
                                lr_scheduler.CosineAnnealingLR(opt, 3).state_dict())
    collective_assert(isinstance(err, ValueError) and "another scheduler" in str(err), str(err))


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


def conv_model(seed: int = 0) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, seed=seed, dtype=np.float64), nn.ReLU(),
                         nn.Conv2d(3, 1, 1, seed=seed + 1, dtype=np.float64))


def recipe(model):
    opt = AdamW(model.parameters(), lr=0.05, amsgrad=True)
    sched = lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, 0.2, 1.0, 2),
              lr_scheduler.CosineAnnealingLR(opt, 6, 1e-3)], milestones=[2])
    return opt, sched


def train_steps(model, opt, sched, steps) -> list[float]:
    loss = nn.MSELoss()
    lrs = []
    shape = (2, 2, 8, 6)
    dist = dt.Distribution(shape, grid((comm.Get_size(),)), (None, None, 0, None))
    for s in steps:
        rng = np.random.default_rng(s)
        x = dt.DistArray.from_global(rng.standard_normal(shape), dist)
        t = rng.standard_normal((2, 1, 8, 6))
        opt.zero_grad()
        loss(model(x), t)
        model.backward(loss.backward())
        clip_grad_norm_(model.parameters(), 0.5)
        lrs.append(opt.lr)
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parallel([1, 3])
def test_checkpoint_resume_continues_optimizer_and_schedule_exactly(shared_dir):
    model = conv_model()
    opt, sched = recipe(model)
    straight = train_steps(model, opt, sched, range(8))
    want = [p.data.copy() for p in model.parameters()]

    model = conv_model()
    opt, sched = recipe(model)
    first = train_steps(model, opt, sched, range(3))
    path = shared_dir / "ck"
    save_checkpoint(path, model, opt, 3, comm=comm, scheduler=sched)
    fresh = conv_model(seed=5)
    opt2, sched2 = recipe(fresh)
    state = load_checkpoint(path, fresh, opt2, comm=comm, scheduler=sched2)
    rest = train_steps(fresh, opt2, sched2, range(3, 8))
    collective_assert(state["step"] == 3 and state["manifest"]["scheduler"]["class"] ==
                      "SequentialLR", str(state["manifest"]["scheduler"]))
    collective_assert(first + rest == straight, f"{first + rest} vs {straight}")
    collective_assert(all(np.array_equal(p.data, w) for p, w in zip(fresh.parameters(), want)),
                      "the resumed run's parameters differ")

    # another optimizer, another schedule, or none saved: refused alike, nothing changed
    other = conv_model(seed=7)
    snap = [p.data.copy() for p in other.parameters()]
    sgd = SGD(other.parameters(), lr=0.1)
    adamw = AdamW(other.parameters(), lr=0.05, amsgrad=True)
    for args, kw, words in (
            ((other, sgd), {}, "holds AdamW state, not SGD"),
            ((other, adamw), {"scheduler": lr_scheduler.StepLR(adamw, 2)},
             "SequentialLR scheduler state, not StepLR")):
        _, err = collective_outcome(load_checkpoint, path, *args, comm=comm, **kw)
        collective_assert(isinstance(err, CheckpointError) and words in str(err), str(err))
    save_checkpoint(shared_dir / "plain", model, opt, 3, comm=comm)
    _, err = collective_outcome(load_checkpoint, shared_dir / "plain", other, adamw, comm=comm,
                                scheduler=lr_scheduler.StepLR(adamw, 2))
    collective_assert(isinstance(err, CheckpointError) and "no learning-rate scheduler" in
                      str(err), str(err))
    collective_assert(all(np.array_equal(p.data, s) for p, s in zip(other.parameters(), snap)),
                      "a refused load changed the model")


# --------------------------------------------------------------------------- the recipe
class Cfg:
    """The fields of TrainConfig that the recipe reads."""

    def __init__(self, **kw):
        self.optimizer, self.schedule, self.lr, self.momentum = "sgd", "none", None, 0.9
        self.weight_decay, self.warmup_steps, self.warmup_start_factor = None, 0, 0.1
        self.step_size, self.gamma, self.min_lr, self.clip_grad_norm = None, 0.1, 0.0, None
        self.steps, self.schedule_steps = 10, None
        self.__dict__.update(kw)


@pytest.mark.parametrize("kw,words", [
    ({"optimizer": "lamb"}, "unknown --optimizer 'lamb': choose sgd, adam or adamw"),
    ({"schedule": "cyclic"}, "unknown --schedule 'cyclic'"),
    ({"lr": -0.1, "optimizer": "adam"}, "--lr must be >= 0"),
    ({"lr": 0.0}, "--lr must be > 0"),
    ({"weight_decay": -1e-4}, "--weight-decay must be >= 0"),
    ({"momentum": -0.9}, "--momentum must be >= 0"),
    ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be > 0"),
    ({"clip_grad_norm": 0.0}, "--clip-grad-norm must be > 0"),
    ({"warmup_steps": 10, "schedule": "cosine"}, "does not fit in the schedule's 10 steps"),
    ({"warmup_steps": 10, "schedule_steps": 8, "steps": 20}, "8 steps (--schedule-steps)"),
    ({"schedule_steps": 0}, "--schedule-steps must be"),
    ({"warmup_steps": 12}, "warm-up of 12 steps"),
    ({"warmup_steps": -1}, "--warmup-steps must be"),
    ({"warmup_start_factor": 1.5}, "--warmup-start-factor"),
    ({"schedule": "cosine", "min_lr": 0.5, "lr": 0.1}, "--min-lr 0.5 is above"),
    ({"schedule": "step", "step_size": 0}, "--step-size"),
])
def test_recipe_refuses_bad_choices(kw, words):
    problem = recipe_problem(Cfg(**kw))
    assert problem is not None and words in problem, problem


@pytest.mark.parametrize("name,cls", [("sgd", SGD), ("adam", Adam), ("adamw", AdamW)])
@pytest.mark.parametrize("kind", ["none", "step", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_recipe_builds_the_schedule_it_names(name, cls, kind, warmup):
    cfg = Cfg(optimizer=name, schedule=kind, warmup_steps=warmup, steps=12, min_lr=0.01,
              step_size=4, gamma=0.5)
    assert recipe_problem(cfg, 0.1) is None
    opt = make_optimizer(cfg, [nn.Parameter(np.zeros(2))], 0.1)
    assert type(opt) is cls
    sched = make_scheduler(cfg, opt)
    assert (None if sched is None else type(sched).__name__) == scheduler_class(cfg)
    lrs = []
    for _ in range(12):
        lrs.append(opt.lr)
        if sched is not None:
            sched.step()
    rest = 12 - warmup
    for e, lr in enumerate(lrs):
        if e < warmup:
            want = 0.1 * (0.1 + 0.9 * e / warmup)
        else:
            k = e - warmup
            want = {"none": 0.1, "step": 0.1 * 0.5 ** (k // 4),
                    "cosine": 0.01 + 0.09 * (1 + math.cos(math.pi * k / rest)) / 2,
                    "linear": 0.1 * (1 + (0.1 - 1) * min(k, rest) / rest)}[kind]
        assert math.isclose(lr, want, rel_tol=1e-12, abs_tol=1e-15), (e, lr, want)


def test_resume_problem_names_the_saved_optimizer_and_schedule():
    saved = Cfg(optimizer="adam", schedule="cosine", warmup_steps=2)
    state = make_scheduler(saved, Adam([nn.Parameter(np.zeros(1))], lr=0.1)).state_dict()
    manifest = {"optimizer": {"class": "Adam"},
                "scheduler": {"class": "SequentialLR", "state": state}}
    assert resume_problem(saved, manifest, 0.1) is None
    msg = resume_problem(Cfg(optimizer="sgd", schedule="cosine", warmup_steps=2), manifest, 0.1)
    assert "saved with --optimizer adam (Adam)" in msg and "--optimizer sgd" in msg, msg
    msg = resume_problem(Cfg(optimizer="adam"), manifest, 0.1)
    assert "the schedule SequentialLR" in msg and "makes no schedule" in msg, msg
    msg = resume_problem(Cfg(optimizer="adam", schedule="step"),
                         {"optimizer": {"class": "Adam"}, "scheduler": None}, 0.1)
    assert "saved with no schedule" in msg, msg
    # the same schedule over another length, or from another rate: its settings differ
    msg = resume_problem(Cfg(optimizer="adam", schedule="cosine", warmup_steps=2, steps=20),
                         manifest, 0.1)
    assert "other settings (part 1: T_max 8, this run's 18" in msg, msg
    msg = resume_problem(saved, manifest, 0.2)
    assert "base_lrs [0.1], this run's [0.2]" in msg, msg
    assert resume_problem(Cfg(optimizer="adam", schedule="cosine", warmup_steps=2, steps=20,
                              schedule_steps=10), manifest, 0.1) is None


# --------------------------------------------------------------------------- the driver
V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing
TRAIN = ["mesh-demo", "--machine", V100, "--no-progress", "--metrics", "", "--size", "64x64",
         "--batch", "2", "--samples", "4"]


def quiet_train(**kw) -> dict:
    base = dict(model="mesh-demo", size=(64, 64), batch=2, samples=4, metrics=None,
                machine=V100, progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        return train(TrainConfig(**{**base, **kw}))


def test_training_resumed_in_parts_follows_the_whole_schedule_bitwise(tmp_path):
    recipe_kw = dict(optimizer="adamw", schedule="cosine", warmup_steps=2, clip_grad_norm=0.5,
                     lr=0.01, min_lr=1e-4)
    whole = quiet_train(steps=6, **recipe_kw)
    ck = str(tmp_path / "ck")
    quiet_train(steps=3, schedule_steps=6, checkpoint=ck, **recipe_kw)
    resumed = quiet_train(steps=6, checkpoint=ck, resume=True, **recipe_kw)
    assert resumed["history"] == whole["history"], (resumed["history"], whole["history"])


def usage_error(capsys, argv) -> str:
    """A command line that must stop with exit status 2 before any work; its stderr."""
    with pytest.raises(SystemExit) as exc:
        train_main(argv)
    assert exc.value.code == 2, exc.value.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,words", [
    (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["--schedule", "cyclic"], "invalid choice: 'cyclic'"),
    (["--lr", "-0.1"], "--lr: must be > 0"),
    (["--weight-decay", "-0.5"], "--weight-decay: must be >= 0"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm: must be > 0"),
    (["--warmup-steps", "5", "--steps", "3"], "a warm-up of 5 steps (--warmup-steps) does not "
                                              "fit in the schedule's 3 steps (--steps)"),
    (["--schedule", "cosine", "--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above"),
    (["--warmup-steps", "2", "--warmup-start-factor", "2"], "--warmup-start-factor"),
])
def test_the_command_line_refuses_bad_choices_before_any_work(capsys, argv, words):
    err = usage_error(capsys, TRAIN + argv)
    assert words in err and "usage: disttensor-train" in err, err


def test_resuming_with_another_optimizer_or_schedule_is_one_clear_error(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    argv = TRAIN + ["--checkpoint", ck, "--optimizer", "adamw", "--schedule", "step",
                    "--step-size", "1"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main(argv + ["--steps", "1"]) == 0
    capsys.readouterr()
    err = usage_error(capsys, argv[:-6] + ["--steps", "2", "--resume"])
    assert "saved with --optimizer adamw (AdamW), this run asks for --optimizer sgd" in err, err
    err = usage_error(capsys, argv + ["--steps", "2", "--resume", "--schedule", "cosine"])
    assert "saved with the schedule StepLR" in err and "CosineAnnealingLR" in err, err
    err = usage_error(capsys, argv + ["--steps", "2", "--resume", "--gamma", "0.5"])
    assert "other settings (gamma 0.1, this run's 0.5" in err, err
    assert err.count("error:") == 1, err


@pytest.mark.parallel([1])
def test_zero_grad_reads_as_zeros_and_the_next_gradient_is_copied_in():
    """zero_grad writes nothing: the gradient reads as zeros, the first add_grad_ after it
    copies (any shape of the same size, cast to the gradient's dtype), later ones add, and
    the array stays the same object (optimizer state and views keep it)."""
    import disttensor_nn as nn

    p = nn.Parameter(np.arange(6.0).reshape(2, 3))
    buf = p.grad
    buf[...] = 5.0
    p.zero_grad()
    np.testing.assert_array_equal(p.grad, np.zeros((2, 3)))  # read before any gradient
    p.grad[...] = 7.0
    p.zero_grad()
    g = np.arange(6, dtype=np.float32) - 2.5
    p.add_grad_(g)
    assert p.grad is buf and p.grad.dtype == np.float64
    np.testing.assert_array_equal(p.grad, g.reshape(2, 3).astype(np.float64))
    p.add_grad_(g.reshape(3, 2))
    np.testing.assert_array_equal(p.grad, 2 * g.reshape(2, 3).astype(np.float64))
    p.grad = np.ones((2, 3))  # assigned: no longer zeroed
    p.add_grad_(g)
    np.testing.assert_array_equal(p.grad, 1 + g.reshape(2, 3))


@pytest.mark.parallel([1])
def test_an_owned_first_gradient_becomes_the_gradient_and_later_ones_add():
    """add_grad_(g, owned=True) after zero_grad keeps g itself as the gradient (no copy)
    where its dtype and layout are the gradient's; later gradients add into it; a cast
    or a strided one is copied in as without owned."""
    import disttensor_nn as nn

    p = nn.Parameter(np.zeros((2, 3)))
    p.zero_grad()
    g = np.arange(6.0)
    p.add_grad_(g, owned=True)
    assert np.shares_memory(p.grad, g) and p.grad.shape == (2, 3)
    p.add_grad_(np.ones(6), owned=True)  # not the first: added
    np.testing.assert_array_equal(p.grad, (np.arange(6.0) + 1).reshape(2, 3))
    p.zero_grad()
    g32 = np.arange(6, dtype=np.float32)
    p.add_grad_(g32, owned=True)  # cast: a new array, copied in
    assert not np.shares_memory(p.grad, g32) and p.grad.dtype == np.float64
    np.testing.assert_array_equal(p.grad, np.arange(6.0).reshape(2, 3))
    p.zero_grad()
    strided = np.arange(12.0)[::2]
    p.add_grad_(strided, owned=True)
    assert not np.shares_memory(p.grad, strided)
    np.testing.assert_array_equal(p.grad, np.arange(0.0, 12.0, 2).reshape(2, 3))


@pytest.mark.parallel([1])
def test_zero_grad_drops_a_gradient_a_kernel_gave_away():
    """A gradient kept without a copy (owned) is let go at zero_grad, as PyTorch's
    set_to_none: nothing of the parameter refers to it any more; the gradient reads as
    zeros of its shape and dtype until the next one, which becomes it where given away
    and is copied into a new array otherwise; one copied in is kept and reused."""
    import weakref

    import disttensor_nn as nn

    p = nn.Parameter(np.zeros((2, 3), np.float32))
    p.zero_grad()
    g = np.arange(6, dtype=np.float32)
    p.add_grad_(g, owned=True)
    p.add_grad_(np.ones(6, np.float32))  # a second micro-batch's: added into it
    np.testing.assert_array_equal(p.grad, (np.arange(6.0) + 1).reshape(2, 3))
    gone = weakref.ref(g)
    del g
    p.zero_grad()
    assert gone() is None  # dropped: its memory is free for the next forward pass
    read = p.grad
    assert read.shape == (2, 3) and read.dtype == np.float32
    np.testing.assert_array_equal(read, np.zeros((2, 3)))
    p.zero_grad()  # read as zeros, written by no kernel: kept
    assert p.grad is read
    p.zero_grad()
    h = np.full(6, 2.0, np.float32)
    p.add_grad_(h, owned=True)
    assert np.shares_memory(p.grad, h)
    p.zero_grad()  # dropped, and nothing read before the next one: taken as it is
    gone = weakref.ref(h)
    del h
    assert gone() is None
    k = np.full(6, 3.0, np.float32)
    p.add_grad_(k, owned=True)
    assert np.shares_memory(p.grad, k) and p.grad.shape == (2, 3)
    p.grad *= 2  # the same array back through the setter: still the kernel's
    np.testing.assert_array_equal(p.grad, np.full((2, 3), 6.0))
    gone = weakref.ref(k)
    del k
    p.zero_grad()
    assert gone() is None
    p.add_grad_(np.full(6, 4.0), owned=True)  # float64 after a drop: cast to float32
    assert p.grad.dtype == np.float32
    np.testing.assert_array_equal(p.grad, np.full((2, 3), 4.0))
    p.zero_grad()
    p.add_grad_(np.arange(6.0))  # after a drop, not given: copied into a new float32 array
    first = p.grad
    assert first.dtype == np.float32 and first.flags.c_contiguous
    np.testing.assert_array_equal(first, np.arange(6.0).reshape(2, 3))
    p.zero_grad()
    p.add_grad_(np.ones(12, np.float32)[::2], owned=True)  # strided: copied into it
    assert p.grad is first
    np.testing.assert_array_equal(p.grad, np.ones((2, 3)))


@pytest.mark.parallel([1])
def test_sgd_steps_on_a_dropped_gradient_as_on_zeros():
    """An optimizer step after zero_grad dropped a gradient, with no backward between,
    updates as from zero gradients (momentum alone moves the weights); clipping the
    gradients in place (through the setter) leaves them the kernel's, dropped after."""
    import weakref

    import disttensor_nn as nn

    p = nn.Parameter(np.ones(4))
    opt = SGD([p], lr=0.5, momentum=0.5)
    opt.zero_grad()
    g = np.full(4, 2.0)
    p.add_grad_(g, owned=True)
    c = 2.0 / (4.0 + 1e-6)  # clipped from norm 4 to 2, in place
    assert clip_grad_norm_([p], 2.0) == pytest.approx(4.0)
    opt.step()  # buf = 2c, w = 1 - 0.5 * 2c
    gone = weakref.ref(g)
    del g
    opt.zero_grad()
    assert gone() is None  # the step runs on a dropped gradient
    opt.step()  # buf = 0.5 * 2c + 0, w = 1 - 1.5c
    np.testing.assert_allclose(p.data, np.full(4, 1 - 1.5 * c), rtol=1e-12)
    np.testing.assert_array_equal(p.grad, np.zeros(4))


@pytest.mark.parallel([1])
@pytest.mark.parametrize("n", [5, 2**17 + 3])
def test_sgd_updates_parameters_held_as_torch_tensors(n):
    # blocks of any array module are parameters, PyTorch's tensors too (whose .size is a
    # method): SGD with momentum and weight decay against the formula on NumPy arrays
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(n)
    grads = [rng.standard_normal(n) for _ in range(3)]
    p = nn.Parameter(torch.tensor(w0))
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    w, buf = w0.copy(), None
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        d = g + 0.01 * w
        buf = d if buf is None else 0.9 * buf + d
        w = w - 0.1 * buf
    assert isinstance(p.data, torch.Tensor)
    np.testing.assert_allclose(p.data.numpy(), w, rtol=1e-12, atol=1e-12)
