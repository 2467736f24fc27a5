"""The layer state protocol: registries, state_dict, load_state_dict, to(xp), hooks.

Expected key names are written out by hand for a small nested model; round
trips compare a fresh model (another seed) after ``load_state_dict`` with the
original, on the state arrays and on the forward output for the same input;
``to(xp)`` round trips compare with NumPy copies taken before. The built-in
models (ResNet-18 and -50, the mesh FCN) are built small. ``array_api_strict``
stands in for a non-NumPy array module (on its CPU device and on a device that
behaves like an accelerator's memory).
"""

from __future__ import annotations

import copy
import functools
import time
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.backend import array_namespace, to_numpy
from disttensor.testing import assert_equal, collective_assert
from disttensor_nn.models import mesh_fcn, resnet
from disttensor_nn.module import IncompatibleKeys, RemovableHandle, derived
from disttensor_nn.training.clocks import LayerClocks

xps = pytest.importorskip("array_api_strict")

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3]
F64 = np.float64


@functools.cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


def nested(seed: int = 0) -> nn.Sequential:
    """Sequential with Residual blocks whose branches are Sequentials (two levels deep)."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, dtype=F64, seed=seed),
        nn.BatchNorm2d(3, dtype=F64),
        nn.ReLU(),
        nn.Residual(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, bias=False, dtype=F64,
                                            seed=seed + 1),
                                  nn.BatchNorm2d(3, dtype=F64)),
                    nn.Sequential(nn.Conv2d(3, 3, 1, dtype=F64, seed=seed + 2)),
                    post=nn.ReLU()),
        nn.Residual(nn.Sequential(nn.ReLU(), nn.Sequential(
            nn.Conv2d(3, 3, 3, padding=1, dtype=F64, seed=seed + 3)))),
        nn.GlobalAvgPool(),
        nn.Linear(3, 2, dtype=F64, seed=seed + 4),
    )


NESTED_PARAMS = ["0.weight", "0.bias", "1.weight", "1.bias", "3.branch.0.weight",
                 "3.branch.1.weight", "3.branch.1.bias", "3.shortcut.0.weight",
                 "3.shortcut.0.bias", "4.branch.1.0.weight", "4.branch.1.0.bias",
                 "6.weight", "6.bias"]
NESTED_BUFFERS = ["1.running_mean", "1.running_var", "3.branch.1.running_mean",
                  "3.branch.1.running_var"]
NESTED_STATE = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                "3.branch.0.weight", "3.branch.1.weight", "3.branch.1.bias",
                "3.branch.1.running_mean", "3.branch.1.running_var", "3.shortcut.0.weight",
                "3.shortcut.0.bias", "4.branch.1.0.weight", "4.branch.1.0.bias", "6.weight",
                "6.bias"]
NESTED_MODULES = ["", "0", "1", "2", "3", "3.branch", "3.branch.0", "3.branch.1", "3.shortcut",
                  "3.shortcut.0", "3.post", "4", "4.branch", "4.branch.0", "4.branch.1",
                  "4.branch.1.0", "5", "6"]

# name -> (builder of a seeded model, global input shape)
MODELS = {
    "resnet18": (lambda s: resnet(18, num_classes=5, width=4, dtype=F64, seed=s), (3, 3, 32, 32)),
    "resnet50": (lambda s: resnet(50, num_classes=5, width=2, dtype=F64, seed=s), (3, 3, 32, 32)),
    "mesh_fcn": (lambda s: mesh_fcn(widths=(4, 4), convs_per_stage=2, dtype=F64, seed=s),
                 (3, 18, 16, 16)),
    "nested": (nested, (3, 2, 8, 8)),
}

# (module, device or None)
PLACES = {"strict-cpu": (xps, None), "strict-device1": (xps, xps.Device("device1"))}


def model_input(shape: tuple[int, ...], seed: int = 1) -> dt.DistArray:
    """The same global input on every world size, split over the samples."""
    x = np.random.default_rng(seed).standard_normal(shape)
    dist = dt.Distribution(shape, grid((comm.Get_size(),)), (0,) + (None,) * (len(shape) - 1))
    return dt.DistArray.from_global(x, dist)


def host_state(model: nn.Layer) -> dict[str, np.ndarray]:
    """NumPy copies of the state_dict."""
    return {k: np.array(to_numpy(v), copy=True) for k, v in model.state_dict().items()}


def same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def refused(fn, *args, **kwargs) -> str:
    """Call ``fn``: it must raise ValueError with the same message on every rank; return it."""
    try:
        fn(*args, **kwargs)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    everyone = comm.allgather(msg)
    collective_assert(msg is not None, "no ValueError was raised")
    collective_assert(all(m == everyone[0] for m in everyone), f"messages differ: {everyone}")
    return msg


# --------------------------------------------------------------------------- the Sequential bug
def test_sequential_does_not_hide_layers():
    relu = nn.ReLU()
    inner = nn.Sequential(relu)
    model = nn.Residual(inner)
    assert list(model.layers()) == [model, inner, relu]
    assert list(model.modules()) == [model, inner, relu]
    assert list(inner) == [relu] and len(inner) == 1 and inner[0] is relu
    net = nested()
    assert nn.to_array_module(net, np) is net
    assert nn.to_array_module(net, xps) is net
    assert all(array_namespace(a) is xps for a in net.state_dict().values())
    assert nn.to_array_module(net, np) is net
    assert all(isinstance(a, np.ndarray) for a in net.state_dict().values())


def test_sequential_indexing_and_slices():
    model = nested()
    layers = list(model)
    assert len(model) == 7 and model[-1] is layers[6]
    head = model[:3]
    assert isinstance(head, nn.Sequential) and list(head) == layers[:3]
    assert [name for name, _ in head.named_children()] == ["0", "1", "2"]
    with pytest.raises(TypeError, match="Sequential takes Layers"):
        nn.Sequential(nn.ReLU(), [nn.ReLU()])


# --------------------------------------------------------------------------- names
def test_names_of_a_nested_model():
    model = nested()
    assert [n for n, _ in model.named_parameters()] == NESTED_PARAMS
    assert [n for n, _ in model.named_buffers()] == NESTED_BUFFERS
    assert list(model.state_dict()) == NESTED_STATE
    assert [n for n, _ in model.named_modules()] == NESTED_MODULES
    assert [n for n, _ in model.named_children()] == ["0", "1", "2", "3", "4", "5", "6"]
    assert [n for n, _ in model[3].named_children()] == ["branch", "shortcut", "post"]
    assert [n for n, _ in model[4].named_children()] == ["branch"]  # no shortcut, no post
    assert [n for n, _ in model.named_parameters(prefix="net")] == \
        ["net." + n for n in NESTED_PARAMS]
    assert list(model.state_dict(prefix="m.")) == ["m." + n for n in NESTED_STATE]
    conv = model[0]
    assert conv.own_parameters() == [conv.weight, conv.bias]
    assert list(conv.parameters(recurse=False)) == [conv.weight, conv.bias]
    assert list(model.parameters(recurse=False)) == [] and model.own_parameters() == []
    assert [p.shape for p in model.parameters()][:2] == [(3, 2, 3, 3), (3,)]
    bn = model[1]
    assert list(bn.buffers()) == [bn.running_mean, bn.running_var]
    sd = model.state_dict()
    assert sd["0.weight"] is conv.weight.data and sd["1.running_var"] is bn.running_var
    assert model.state_dict(keep_vars=True)["0.weight"] is conv.weight


def test_shared_parameters_and_layers():
    lin = nn.Linear(2, 2, dtype=F64)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias"]
    assert list(model.parameters()) == [lin.weight, lin.bias]
    assert len(list(model.named_parameters(remove_duplicate=False))) == 4
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [n for n, _ in model.named_modules()] == ["", "0", "1"]
    assert [n for n, _ in model.named_modules(remove_duplicate=False)] == ["", "0", "1", "2"]
    assert len(model) == 3 and list(model)[2] is lin


# --------------------------------------------------------------------------- registration
class Scale(nn.Layer):
    """y = a * x + b with a registered buffer ``count`` (forward calls)."""

    def __init__(self) -> None:
        self.a = nn.Parameter(np.full(1, 2.0))
        self.b = nn.Parameter(np.zeros(1))
        self.register_buffer("count", np.zeros(1))

    def forward(self, x: dt.DistArray) -> dt.DistArray:
        self.count = self.count + 1
        return dt.DistArray(x.local * self.a.data + self.b.data, x.dist)

    def backward(self, dy: dt.DistArray) -> dt.DistArray:
        return dt.DistArray(dy.local * self.a.data, dy.dist)


def test_registration_by_assignment():
    layer = Scale()
    assert [n for n, _ in layer.named_parameters()] == ["a", "b"]
    assert [n for n, _ in layer.named_buffers()] == ["count"]
    layer.count = np.full(1, 5.0)  # reassigning a buffer replaces it
    assert layer.state_dict()["count"][0] == 5.0
    layer.b = None  # a registered parameter may become None: no state then
    assert list(layer.state_dict()) == ["a", "count"]
    with pytest.raises(TypeError, match="a Parameter or None"):
        layer.a = np.ones(1)
    layer.c = nn.Parameter(np.ones(3))
    layer.sub = nn.ReLU()
    assert [n for n, _ in layer.named_parameters()] == ["a", "c"]
    assert [n for n, _ in layer.named_children()] == ["sub"]
    del layer.c, layer.sub
    assert [n for n, _ in layer.named_parameters()] == ["a"]
    assert list(layer.children()) == [] and not hasattr(layer, "sub")
    layer.register_parameter("d", nn.Parameter(np.ones(2)))
    layer.add_module("e", nn.Sigmoid())
    assert [n for n, _ in layer.named_parameters()] == ["a", "d"]
    assert [n for n, _ in layer.named_children()] == ["e"]


@pytest.mark.parametrize("name,error", [("layers", AttributeError), ("to", AttributeError),
                                        ("forward", AttributeError)])
def test_attributes_may_not_hide_layer_methods(name, error):
    layer = nn.ReLU()
    with pytest.raises(error, match="Layer method"):
        setattr(layer, name, [])


@pytest.mark.parametrize("method", ["register_buffer", "register_parameter", "add_module"])
def test_registration_refuses_bad_names(method):
    layer = Scale()
    value = {"register_buffer": np.ones(1), "register_parameter": nn.Parameter(np.ones(1)),
             "add_module": nn.ReLU()}[method]
    register = getattr(layer, method)
    for bad in ("", "x.y", "parameters", "a" if method != "register_parameter" else "count"):
        with pytest.raises(KeyError):
            register(bad, value)
    with pytest.raises(TypeError):
        register(3, value)
    with pytest.raises(TypeError):
        register("fine", "not a state object")


def test_copies_have_their_own_registries_and_hooks():
    layer = Scale()
    twin = copy.copy(layer)
    calls = []
    twin.register_forward_hook(lambda *a: calls.append(a))
    twin.extra = nn.Parameter(np.ones(1))
    one = dt.ProcessGrid((1,), MPI.COMM_SELF)
    layer(dt.DistArray.from_global(np.ones(2), dt.Distribution((2,), one, (None,))))
    assert calls == [] and [n for n, _ in layer.named_parameters()] == ["a", "b"]
    deep = copy.deepcopy(nested())
    assert list(deep.state_dict()) == NESTED_STATE
    assert deep[0].weight is not nested()[0].weight


class Derives(nn.Layer):
    """A layer whose derived method counts how often it really runs."""

    def __init__(self):
        self.width = 1
        self.w = nn.Parameter(np.ones(2))
        self.register_buffer("seen", np.zeros(1))
        self.runs = []

    @derived
    def shifted(self, n):
        self.__dict__["runs"].append(n)  # not a setting: kept results stay
        if n < 0:
            raise ValueError(f"negative {n}")
        return n + self.width


def test_derived_results_kept_until_a_setting_is_assigned():
    layer = Derives()
    assert [layer.shifted(3), layer.shifted(3), layer.shifted(4)] == [4, 4, 5]
    assert layer.runs == [3, 4]
    layer.w = nn.Parameter(np.zeros(2))  # parameters, buffers and private names are state
    layer.seen = np.ones(1)
    layer._scratch = 1
    assert layer.shifted(3) == 4 and layer.runs == [3, 4]
    layer.width = 10  # a setting: recomputed
    assert layer.shifted(3) == 13 and layer.runs == [3, 4, 3]
    layer.train(False)  # train/eval assign the setting training
    assert layer.shifted(3) == 13 and layer.runs == [3, 4, 3, 3]
    del layer.width
    layer.width = 2
    assert layer.shifted(3) == 5
    for _ in range(2):  # an exception is not kept: it raises each time
        with pytest.raises(ValueError, match="negative -1"):
            layer.shifted(-1)
    assert layer.runs.count(-1) == 2
    twin = copy.copy(layer)  # a copy keeps its own (its settings may change apart)
    twin.__dict__["runs"] = []
    twin.width = 100
    assert twin.shifted(3) == 103 and layer.shifted(3) == 5
    for n in range(100, 200):  # bounded: the oldest dropped first
        layer.shifted(n)
    assert len(layer.__dict__["_derived"]) < 100
    layer.runs.clear()
    layer.shifted(199)  # the newest is kept, the oldest recomputed
    layer.shifted(100)
    assert layer.runs == [100]


def test_train_eval_zero_grad():
    model = nested()
    assert model.eval() is model
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    for p in model.parameters():
        p.grad[...] = 1
    model.zero_grad()
    assert all(not p.grad.any() for p in model.parameters())


# --------------------------------------------------------------------------- Parameter, SGD
@pytest.mark.parametrize("place", sorted(PLACES))
def test_parameter_of_another_array_module(place):
    xp, device = PLACES[place]
    p = nn.Parameter(xp.asarray(np.arange(6.0).reshape(2, 3), device=device))
    assert array_namespace(p.grad) is xp and p.grad.device == p.data.device
    assert p.shape == (2, 3) and not np.any(to_numpy(p.grad))
    p.grad = xp.ones((2, 3), dtype=xp.float64, device=device)
    p.zero_grad()
    assert array_namespace(p.grad) is xp and not np.any(to_numpy(p.grad))


@pytest.mark.parametrize("place", sorted(PLACES))
def test_sgd_on_another_array_module_matches_the_formula(place):
    xp, device = PLACES[place]
    w0 = np.linspace(-1, 1, 5)
    grads = [np.cos(np.arange(5.0) + k) for k in range(3)]
    lr, mom, wd = 0.1, 0.9, 0.01
    # torch.optim.SGD with Nesterov momentum, written out in NumPy
    w, buf = w0.copy(), None
    for g in grads:
        g = g + wd * w
        buf = g.copy() if buf is None else mom * buf + g
        w = w - lr * (g + mom * buf)
    p = nn.Parameter(xp.asarray(w0, device=device))
    opt = nn.SGD([p], lr=lr, momentum=mom, weight_decay=wd, nesterov=True)
    for g in grads:
        p.grad = xp.asarray(g, device=device)
        opt.step()
    assert array_namespace(p.data) is xp and p.data.device == xp.asarray(w0, device=device).device
    np.testing.assert_allclose(to_numpy(p.data), w, rtol=1e-14, atol=1e-15)
    state = opt.state_dict()
    assert isinstance(state["state"][0], np.ndarray)
    np.testing.assert_allclose(state["state"][0], buf, rtol=1e-14)
    opt.load_state_dict(state)
    assert array_namespace(opt.state[0]) is xp and opt.state[0].device == p.data.device


def test_sgd_follows_a_model_moved_after_its_first_step():
    lr, mom = 0.1, 0.9
    g0, g1 = np.array([1.0, -2.0]), np.array([0.5, 0.25])
    buf = g0.copy()  # torch.optim.SGD's momentum, written out: buf = g0, then mom * buf + g1
    want = np.zeros(2) - lr * g0 - lr * (mom * buf + g1)
    layer = nn.Linear(2, 1, bias=False, dtype=np.float64)
    layer.weight = nn.Parameter(np.zeros((1, 2)))
    opt = nn.SGD(layer.parameters(), lr=lr, momentum=mom)
    layer.weight.grad[...] = g0
    opt.step()
    layer.to(xps)
    layer.weight.grad = xps.asarray(g1.reshape(1, 2))
    opt.step()
    assert array_namespace(layer.weight.data) is xps and array_namespace(opt.state[0]) is xps
    np.testing.assert_allclose(to_numpy(layer.weight.data)[0], want, rtol=1e-14)


def test_buffers_take_arrays_or_none():
    bn = nn.BatchNorm2d(3)
    with pytest.raises(TypeError, match="buffer 'running_mean' must be an array or None"):
        bn.running_mean = 0.5
    bn.running_mean = None
    assert "running_mean" not in bn.state_dict()
    with pytest.raises(TypeError, match="bool"):
        bn.train(0)


def test_default_twin_owns_its_parameters_buffers_and_sub_layers():
    class Wrapper(nn.Layer):  # a custom leaf for the planner, with state of its own below it
        def __init__(self):
            self.inner = nn.Linear(2, 2, dtype=np.float64)
            self.register_buffer("count", np.zeros(1))

        def forward(self, x):
            return self.inner(x)

    layer = Wrapper()
    twin = layer.local_twin()
    assert twin.inner is not layer.inner and twin.count is not layer.count
    for (name, a), (_, b) in zip(layer.state_dict().items(), twin.state_dict().items()):
        assert a is not b and np.array_equal(a, b), name
    twin.zero_grad()
    twin.inner.weight.data[...] = 7
    assert not np.any(layer.inner.weight.data == 7)


# --------------------------------------------------------------------------- built-in models
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_state_dict_round_trip_gives_the_same_model(name):
    make, shape = MODELS[name]
    x = model_input(shape)
    original = make(0)
    original(x)  # batch statistics move the running averages away from 0 and 1
    fresh = make(1)
    collective_assert(list(fresh.state_dict()) == list(original.state_dict()), "keys differ")
    collective_assert(not same_state(host_state(fresh), host_state(original)),
                      "the two seeds gave the same model")
    result = fresh.load_state_dict(original.state_dict())
    collective_assert(result == IncompatibleKeys([], []), str(result))
    collective_assert(same_state(host_state(fresh), host_state(original)), "state differs")
    for mode in ("eval", "train"):
        getattr(original, mode)()
        getattr(fresh, mode)()
        y_ref = original(x).to_global()
        assert_equal(fresh(x), y_ref)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_load_state_dict_refuses_bad_state_and_changes_nothing(name):
    make, _ = MODELS[name]
    model, other = make(0), make(1)
    before = host_state(model)
    good = other.state_dict()
    keys = list(good)
    first, last = keys[0], keys[-1]
    bad = {k: v for k, v in good.items() if k != last}
    bad["extra.weight"] = np.zeros(3)
    bad[first] = np.zeros((1, 2))
    msg = refused(model.load_state_dict, bad)
    collective_assert(f"missing keys ['{last}']" in msg, msg)
    collective_assert("unexpected keys ['extra.weight']" in msg, msg)
    collective_assert(f"'{first}' has shape (1, 2)" in msg, msg)
    collective_assert(same_state(host_state(model), before), "a refused load changed the model")
    for corrupt in ({k: v for k, v in good.items() if k != last},
                    {**good, "extra": np.zeros(1)},
                    {**good, first: np.zeros(tuple(good[first].shape) + (1,))},
                    {**good, first: "not an array"}):
        refused(model.load_state_dict, corrupt)
        collective_assert(same_state(host_state(model), before), "a refused load changed it")
    # shapes are checked even when not strict
    refused(model.load_state_dict, {first: np.zeros(1)}, strict=False)
    collective_assert(same_state(host_state(model), before), "a refused load changed it")
    # not strict: the matching keys load, the others are reported
    partial = {k: v for k, v in good.items() if k != last}
    partial["extra"] = np.zeros(1)
    result = model.load_state_dict(partial, strict=False)
    collective_assert(result.missing_keys == [last] and result.unexpected_keys == ["extra"],
                      str(result))
    want = host_state(other)
    want[last] = before[last]
    collective_assert(same_state(host_state(model), want), "partial load")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_to_another_array_module_and_back(name, place):
    xp, device = PLACES[place]
    make, shape = MODELS[name]
    x = model_input(shape)
    model = make(0)
    model(x)  # running statistics
    for i, p in enumerate(model.parameters()):
        p.grad[...] = np.cos(np.arange(p.grad.size) + i).reshape(p.grad.shape)
    state, grads = host_state(model), [p.grad.copy() for p in model.parameters()]
    model.eval()
    y_ref = model(x).to_global()
    want_device = xp.asarray(np.zeros(1), device=device).device

    collective_assert(model.to(xp, device) is model)
    arrays = list(model.state_dict().values()) + [p.grad for p in model.parameters()]
    collective_assert(all(array_namespace(a) is xp and a.device == want_device for a in arrays),
                      "an array was not moved")
    collective_assert(same_state(host_state(model), state), "values changed on the way there")
    collective_assert(all(np.array_equal(to_numpy(p.grad), g)
                          for p, g in zip(model.parameters(), grads)), "gradients changed")

    collective_assert(model.to(np) is model)
    arrays = list(model.state_dict().values()) + [p.grad for p in model.parameters()]
    collective_assert(all(isinstance(a, np.ndarray) for a in arrays), "not back in NumPy")
    collective_assert(same_state(host_state(model), state), "values changed on the way back")
    collective_assert(all(np.array_equal(p.grad, g) for p, g in zip(model.parameters(), grads)),
                      "gradients changed")
    assert_equal(model(x), y_ref)


# --------------------------------------------------------------------------- hooks
def hook_model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, dtype=F64),
                         nn.ReLU(),
                         nn.Residual(nn.Sequential(nn.Conv2d(3, 3, 1, dtype=F64, seed=1)),
                                     post=nn.ReLU()))


FORWARD_ORDER = [("", "pre"), ("0", "pre"), ("0", "post"), ("1", "pre"), ("1", "post"),
                 ("2", "pre"), ("2.branch", "pre"), ("2.branch.0", "pre"),
                 ("2.branch.0", "post"), ("2.branch", "post"), ("2.post", "pre"),
                 ("2.post", "post"), ("2", "post"), ("", "post")]
BACKWARD_ORDER = [("", "pre"), ("2", "pre"), ("2.post", "pre"), ("2.post", "post"),
                  ("2.branch", "pre"), ("2.branch.0", "pre"), ("2.branch.0", "post"),
                  ("2.branch", "post"), ("2", "post"), ("1", "pre"), ("1", "post"),
                  ("0", "pre"), ("0", "post"), ("", "post")]


def record(model: nn.Layer) -> tuple[list, list, list[RemovableHandle]]:
    """Hooks on every layer that log (name, pre/post) and what they were given."""
    fwd, bwd, handles = [], [], []
    for name, layer in model.named_modules():
        handles += [
            layer.register_forward_pre_hook(
                lambda m, x, name=name: fwd.append((name, "pre", x))),
            layer.register_forward_hook(
                lambda m, x, y, name=name: fwd.append((name, "post", x, y))),
            layer.register_full_backward_pre_hook(
                lambda m, dy, name=name: bwd.append((name, "pre", dy))),
            layer.register_full_backward_hook(
                lambda m, dx, dy, name=name: bwd.append((name, "post", dx, dy))),
        ]
    return fwd, bwd, handles


@pytest.mark.parallel(SIZES)
def test_hooks_fire_for_every_layer_in_order():
    model = hook_model()
    fwd, bwd, handles = record(model)
    x = model_input((3, 2, 6, 5))
    y = model(x)
    dy = dt.DistArray(np.ones(y.local_shape), y.dist)
    dx = model.call_backward(dy)
    collective_assert([e[:2] for e in fwd] == FORWARD_ORDER, str([e[:2] for e in fwd]))
    collective_assert([e[:2] for e in bwd] == BACKWARD_ORDER, str([e[:2] for e in bwd]))
    seen = {(e[0], e[1]): e[2:] for e in fwd}
    collective_assert(seen[("", "pre")][0] is x and seen[("", "post")][1] is y)
    collective_assert(seen[("0", "post")][1] is seen[("1", "pre")][0], "conv output != relu input")
    back = {(e[0], e[1]): e[2:] for e in bwd}
    collective_assert(back[("", "pre")][0] is dy and back[("", "post")][0] is dx)
    collective_assert(back[("1", "post")][0] is back[("0", "pre")][0], "relu dx != conv dy")
    # containers run their sub-layers' hooks also when called without their own
    fwd.clear()
    bwd.clear()
    model.backward(dt.DistArray(np.ones(model.forward(x).local_shape), y.dist))
    collective_assert([e[:2] for e in fwd] == FORWARD_ORDER[1:-1])
    collective_assert([e[:2] for e in bwd] == BACKWARD_ORDER[1:-1])
    # removal: no more calls; removing twice is harmless
    for h in handles:
        h.remove()
    handles[0].remove()
    fwd.clear()
    bwd.clear()
    model.call_backward(dt.DistArray(np.ones(model(x).local_shape), y.dist))
    collective_assert(fwd == [] and bwd == [], "removed hooks ran")


@pytest.mark.parallel(SIZES)
def test_hooks_that_return_a_value_replace_it():
    model = hook_model()
    x = model_input((3, 2, 6, 5))
    y_ref = model(x).to_global()
    dy = dt.DistArray(np.ones(model(x).local_shape), model(x).dist)
    dx_ref = model.call_backward(dy).to_global()

    def twice(a: dt.DistArray) -> dt.DistArray:
        return dt.DistArray(2 * a.local, a.dist)

    last = model[2].post  # ReLU: 2 * relu(v) = relu(2 * v), so doubling commutes with it
    with last.register_forward_hook(lambda layer, x, y: twice(y)):
        assert_equal(model(x), 2 * y_ref)
    assert_equal(model(x), y_ref)
    with model[0].register_forward_pre_hook(lambda layer, x: twice(x)):
        y2 = model(x).to_global()
    model(x)
    with model[0].register_full_backward_hook(lambda layer, dx, dy: twice(dx)):
        assert_equal(model.call_backward(dy), 2 * dx_ref)
    with model[2].register_full_backward_pre_hook(lambda layer, dy: twice(dy)):
        assert_equal(model.call_backward(dy), 2 * dx_ref)
    assert_equal(model.call_backward(dy), dx_ref)
    collective_assert(not np.array_equal(y2, y_ref), "the pre-hook did not change the input")
    with pytest.raises(TypeError, match="callable"):
        model.register_forward_hook("not callable")


class Sleep(nn.Layer):
    def forward(self, x):
        time.sleep(0.02)
        return x

    def backward(self, dy):
        time.sleep(0.03)
        return dy


def _one_process_array() -> dt.DistArray:
    """A small array on one process, what the clock tests' layers pass along."""
    one = dt.ProcessGrid((1,), MPI.COMM_SELF)
    return dt.DistArray.from_global(np.ones((2, 2)), dt.Distribution((2, 2), one, (None, None)))


def test_training_driver_clocks_use_hooks():
    slow, fast = Sleep(), nn.ReLU()
    model = nn.Sequential(slow, fast)
    clocks = LayerClocks([SimpleNamespace(layer=slow), SimpleNamespace(layer=fast)])
    x = _one_process_array()
    for _ in range(2):
        clocks.start_step()
        model.backward(model(x))
    own, spans = clocks.durations(), clocks.spans(MPI.COMM_SELF)
    assert 0.1 <= own[0] < 1.0 and own[1] < own[0] / 10, own
    # one rank: a layer's span in a step is its own time (the mean over the two steps)
    assert np.allclose(spans, own / 2, rtol=1e-9), (spans, own)
    clocks.remove()
    clocks.start_step()
    model.backward(model(x))
    assert clocks.durations()[0] == own[0]


class _WaitsForAll(nn.Layer):
    """Forward: a barrier (a layer's collective), nothing else."""

    def forward(self, x):
        comm.Barrier()
        return x

    def backward(self, dy):
        comm.Barrier()
        return dy


class _SlowOnRankZero(nn.Layer):
    def forward(self, x):
        time.sleep(0.2 if comm.Get_rank() == 0 else 0.0)
        return x

    def backward(self, dy):
        return dy


@pytest.mark.parallel([1, 2, 3])
def test_training_driver_clocks_count_a_wait_in_the_layer_that_caused_it():
    """A layer slow on one rank, then one that synchronises: the other ranks' own clocks
    put the delay in the second layer too; its span, from the last rank's start to the
    last rank's end, does not (it is counted once, in the slow layer)."""
    slow, sync = _SlowOnRankZero(), _WaitsForAll()
    model = nn.Sequential(slow, sync)
    clocks = LayerClocks([SimpleNamespace(layer=slow), SimpleNamespace(layer=sync)])
    x = _one_process_array()
    for _ in range(3):
        comm.Barrier()
        clocks.start_step()
        model.backward(model(x))
    spans, own = clocks.spans(comm), clocks.durations() / 3
    waited = comm.Get_rank() > 0
    collective_assert(0.19 <= spans[0] < 1.0 and spans[1] < 0.1 and
                      (own[1] >= 0.19) == waited, f"spans {spans}, own {own}")
    clocks.remove()


class _Delay(nn.Layer):
    delay = 0.0

    def forward(self, x):
        time.sleep(self.delay)
        return x

    def backward(self, dy):
        return dy


def test_training_driver_clocks_keep_every_pass_and_the_last_steps():
    """With two micro-batches a step (two forwards, two backwards) every pass is counted
    (the first two alone with ``passes=2``); the spans average the last ``kept_steps``
    steps, the ranks' own clocks sum all of them."""
    x = _one_process_array()
    slow = Sleep()  # 20 ms forward, 30 ms backward
    every, first = (LayerClocks([SimpleNamespace(layer=slow)], passes=p) for p in (4, 2))
    for clocks in (every, first):
        clocks.start_step()
    for _ in range(2):
        slow.call_backward(slow(x))
    spans = [c.spans(MPI.COMM_SELF)[0] for c in (every, first)]
    own = [c.durations()[0] for c in (every, first)]
    assert 0.1 <= spans[0] < 0.2 and 0.05 <= spans[1] < 0.1, spans
    assert 0.1 <= own[0] < 0.2 and 0.1 <= own[1] < 0.2, own
    for clocks in (every, first):
        clocks.remove()
    layer = _Delay()
    clocks = LayerClocks([SimpleNamespace(layer=layer)], kept_steps=2)
    for delay in (0.15, 0.01, 0.01):  # the first step falls out of the spans
        layer.delay = delay
        clocks.start_step()
        layer.call_backward(layer(x))
    got, own = clocks.spans(MPI.COMM_SELF)[0], clocks.durations()[0]
    assert clocks.steps == 3 and 0.01 <= got < 0.04 and own >= 0.17, (got, own)
    clocks.remove()
