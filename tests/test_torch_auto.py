"""``parallelize(model, shape, layout="auto")``: the planner's layouts against one process.

Each model is deep-copied before it is parallelized; the copy runs on the global input in
every rank's process, the parallel model on this rank's block, and the loss is the same on
every rank, so the output and every parameter gradient of the parallel model must equal the
copy's. Plans are made on a published machine profile, which times no kernel, so they are
the same on every rank and in every run. Plans whose layers' layouts differ (given as a Plan
and as its JSON file) check the redistributions between layers.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert, collective_outcome

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)
from torch import nn  # noqa: E402

from disttensor_nn.plan import Plan, builtin_profiles  # noqa: E402
from disttensor_nn.plan import timer as timer_module  # noqa: E402
from disttensor_nn.plan.make import CHANNELS_LAST_GAIN  # noqa: E402
from disttensor_nn.torch import gather, parallelize  # noqa: E402

SIZES = [1, 2, 3]
MACHINE = "v100-nvlink-edr"
comm = MPI.COMM_WORLD
torch.set_num_threads(1)


# ------------------------------------------------------------------ models
class SmallCNN(nn.Module):
    """Convolutions, batch norm, ReLU, pooling, residual '+' (an identity shortcut and a
    strided one), a flattened linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.conv3 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.down = nn.Conv2d(4, 6, 1, stride=2, bias=False)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = x + self.act(self.conv2(x))
        x = torch.relu(self.conv3(x) + self.down(x))
        return self.fc(torch.flatten(self.gap(x), 1))


CNN_LAYERS = ["conv1", "bn1", "relu", "pool", "conv2", "act", "conv3", "down", "relu_1",
              "gap", "flatten", "fc"]


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class SmallUNet(nn.Module):
    """Two levels: max pooling down, a transposed convolution and interpolation up, cat skips."""

    align_corners = False

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2 = block(2, 4), block(4, 6)
        self.pool = nn.MaxPool2d(2)
        self.bottom = nn.Conv2d(6, 6, 3, padding=1)
        self.up2 = nn.ConvTranspose2d(6, 6, 2, stride=2)
        self.dec2 = block(12, 4)
        self.dec1 = block(8, 4)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottom(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        up = F.interpolate(d2, scale_factor=2, mode="bilinear",
                           align_corners=self.align_corners)
        return self.head(self.dec1(torch.cat([up, e1], 1)))


class CornersUNet(SmallUNet):
    """The U-Net upsampling with align_corners=True (split as align_corners=False is)."""

    align_corners = True


UNET_LAYERS = ["enc1.0", "enc1.1", "enc1.2", "pool", "enc2.0", "enc2.1", "enc2.2", "pool_1",
               "bottom", "up2", "dec2.0", "dec2.1", "dec2.2", "interpolate", "dec1.0",
               "dec1.1", "dec1.2", "head"]

class Branches(nn.Module):
    """Three paths from one input joined by one torch.cat (an Inception module)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.head = nn.Conv2d(7, 2, 1)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x), self.pool(x)], 1))


class Dropouts(nn.Module):
    """Channel dropout, module and function, planned as element-wise layers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.drop = nn.Dropout2d(0.3)
        self.head = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return F.dropout2d(self.head(self.drop(self.conv(x))), 0.5, self.training)


class Normed(nn.Module):
    """A layer norm over channels and space, whose sums the runtime all-reduces."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.LayerNorm([3, 12, 10])
        nn.init.normal_(self.norm.weight)
        self.head = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)))


class Pooled(nn.Module):
    """Adaptive average pooling and interpolation mode 'area' to sizes that do not divide
    the input's (windows of uneven lengths, over a halo where split), and the pooling
    functions (planned as the modules)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((5, 4))
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        y = F.interpolate(self.head(self.pool(self.conv(x))), size=(7, 6), mode="area")
        return F.max_pool2d(y, 3, 1, 1) + F.avg_pool2d(y, 3, stride=1, padding=1)


class Fractional(nn.Module):
    """Interpolation by scales that are not integers (a U-Net's upsampling to a skip's
    odd size, a scale of 1.5), which the planner may split."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), size=(19, 13), mode="bilinear")
        z = F.interpolate(self.head(y), scale_factor=1.5, mode="nearest")
        # not split (the planner keeps space whole for it): antialiased bicubic
        return F.interpolate(z, scale_factor=2, mode="bicubic", antialias=True)


class SegNet(nn.Module):
    """Two levels of max pooling that returns its indices (module and function) and max
    unpooling by them (function and module, sizes by ``output_size``): each unpooling
    joins a path's values and a pooling's indices, as a skip connection."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Conv2d(2, 4, 3, padding=1)
        self.pool1 = nn.MaxPool2d(2, return_indices=True)
        self.enc2 = nn.Conv2d(4, 4, 3, padding=1)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.dec2 = nn.Conv2d(4, 4, 3, padding=1)
        self.unpool1 = nn.MaxUnpool2d(2)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = torch.relu(self.enc1(x))
        p, i1 = self.pool1(y)
        z = torch.relu(self.enc2(p))
        q, i2 = F.max_pool2d(z, 2, return_indices=True)
        u = F.max_unpool2d(self.mid(q), i2, 2, output_size=z.shape[2:])
        v = self.unpool1(self.dec2(u), i1, output_size=y.shape[2:])
        return self.head(v)


class Gated(nn.Module):
    """Operands that broadcast against a block: a squeeze-and-excitation gate on a side
    path (pooled, flattened, two linear layers), a spatial attention map, and a global max
    pooling added to every position."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4, 2)
        self.fc2 = nn.Linear(2, 4)
        self.att = nn.Conv2d(4, 1, 1)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1).flatten(1)))))
        y = y * s[:, :, None, None]
        y = torch.sigmoid(self.att(y)) * y
        return self.head(y) + y.amax((2, 3), keepdim=True)[:, :3]


MODELS = {"cnn": (SmallCNN, (4, 2, 16, 12), CNN_LAYERS),
          "segnet": (SegNet, (2, 2, 17, 12), ["enc1", "relu", "pool1", "enc2", "relu_1",
                                              "max_pool2d_with_indices", "mid", "dec2",
                                              "head"]),
          "fractional": (Fractional, (2, 2, 12, 10), ["conv", "interpolate", "head",
                                                      "interpolate_1", "interpolate_2"]),
          "pooled": (Pooled, (2, 2, 12, 10), ["conv", "pool", "head", "interpolate",
                                               "max_pool2d", "avg_pool2d"]),
          "layernorm": (Normed, (2, 2, 12, 10), ["conv", "norm", "head"]),
          "dropouts": (Dropouts, (3, 2, 12, 10), ["conv", "drop", "head", "dropout2d"]),
          "unet": (SmallUNet, (1, 2, 16, 12), UNET_LAYERS),
          "unet-corners": (CornersUNet, (1, 2, 16, 12), UNET_LAYERS),
          "branches": (Branches, (2, 2, 9, 7), ["a", "b", "pool", "head"]),
          "gated": (Gated, (4, 2, 12, 10), ["conv", "adaptive_avg_pool2d", "flatten", "fc1",
                                             "relu", "fc2", "sigmoid", "getitem", "att",
                                             "sigmoid_1", "head", "amax", "getitem_1"])}


# ------------------------------------------------------------------ helpers
def global_tensor(shape, seed, dtype):
    return torch.tensor(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def make(name, dtype):
    cls, shape, layers = MODELS[name]
    torch.manual_seed(3)
    return cls().to(dtype), shape, layers


def compare(model, shape, dtype, **kwargs):
    """The parallel model against the copy in one process; what differs, as text."""
    ref = copy.deepcopy(model)
    pm = parallelize(model, shape, machine=MACHINE, **kwargs)
    x = global_tensor(shape, 1, dtype)
    torch.manual_seed(7)  # the same dropout masks in both
    out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
    whole = gather(out.local, out.dist)
    target = global_tensor(tuple(whole.shape), 2, dtype)
    (whole * target).sum().backward()
    torch.manual_seed(7)
    yr = ref(x)
    (yr * target).sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    bad = []
    if rel(out.to_global(), yr) > tol:
        bad.append(f"output {rel(out.to_global(), yr)}")
    for (name, a), b in zip(pm.named_parameters(), ref.parameters()):
        if a.grad is None or rel(a.grad, b.grad) > tol:
            bad.append(f"grad {name}")
    return pm, bad


def mixed(plan):
    """``plan`` with its layers' grids cycling through every split of one dimension."""
    p = plan.nprocs
    ndim = len(plan.entries[0].grid)
    grids = [tuple(p if i == d else 1 for i in range(ndim)) for d in range(ndim)]
    entries = [dataclasses.replace(e, grid=grids[(i + 1) % len(grids)])
               for i, e in enumerate(plan.entries)]
    return dataclasses.replace(plan, entries=entries)


def outcome(fn):
    _, exc = collective_outcome(fn)  # the same type and message on every rank
    return exc


# ------------------------------------------------------------------ tests
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_equals_one_process_float64(name):
    model, shape, layers = make(name, torch.float64)
    pm, bad = compare(model, shape, torch.float64, layout="auto")
    collective_assert(not bad, f"{name}: {bad}")
    collective_assert([e.name for e in pm.plan.entries] == layers,
                      [e.name for e in pm.plan.entries])
    collective_assert(pm.plan.nprocs == comm.Get_size() and
                      tuple(pm.plan.batch_shape) == shape, "plan")
    table = pm.plan.table()
    collective_assert("predicted time per iteration" in table and
                      all(n in table for n in layers), table)
    collective_assert(pm.input_dist.global_shape == shape, "input")


@pytest.mark.parallel(SIZES)
def test_auto_float32_cnn():
    model, shape, _ = make("cnn", torch.float32)
    _, bad = compare(model, shape, torch.float32)  # 'auto' is the default layout
    collective_assert(not bad, bad)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_plan_whose_layouts_differ_between_layers(name, tmp_path):
    model, shape, _ = make(name, torch.float64)
    plan = mixed(parallelize(copy.deepcopy(model), shape, machine=MACHINE).plan)
    pm, bad = compare(copy.deepcopy(model), shape, torch.float64, layout=plan)
    collective_assert(not bad, f"{name}: {bad}")
    collective_assert(pm.plan is plan, "the plan given")
    path = tmp_path / f"plan{comm.Get_rank()}.json"
    path.write_text(plan.to_json())
    pm, bad = compare(model, shape, torch.float64, layout=str(path))
    collective_assert(not bad, f"{name} from JSON: {bad}")
    collective_assert(pm.plan == Plan.from_json(plan.to_json()), "the plan read")


@pytest.mark.parallel([2, 3])
def test_a_memory_budget_is_honoured():
    model, shape, _ = make("unet", torch.float64)
    free = parallelize(copy.deepcopy(model), shape, machine=MACHINE).plan
    budget = 0.8 * free.peak_memory  # the fastest plan does not fit
    pm, bad = compare(model, shape, torch.float64, memory_per_rank=budget)
    collective_assert(not bad, bad)
    collective_assert(pm.plan.peak_memory <= budget < free.peak_memory and
                      pm.plan.memory_budget == budget, pm.plan.table())
    collective_assert(any(e.grid != f.grid for e, f in zip(pm.plan.entries, free.entries)),
                      pm.plan.table())


@pytest.mark.parallel([1, 3])
def test_a_baseline_counts_in_the_peak_and_the_budget():
    """``baseline`` bytes come on top of the model's data: the same plan's peak grows by them,
    and a budget the model's data fit alone is refused once they do not (alike on every
    rank, the model unconverted); a negative baseline is refused before any message."""
    model, shape, _ = make("cnn", torch.float64)
    free = parallelize(copy.deepcopy(model), shape, machine=MACHINE).plan
    extra = 64 * 2**20
    held = parallelize(copy.deepcopy(model), shape, machine=MACHINE, baseline=extra).plan
    collective_assert(held.baseline_memory == extra and [e.grid for e in held.entries] ==
                      [e.grid for e in free.entries] and
                      abs(held.peak_memory - free.peak_memory - extra) <= 1e-6 * extra,
                      f"{held.peak_memory} against {free.peak_memory} + {extra}")
    budget = free.peak_memory * 1.5  # the data alone fit; with the baseline they do not
    before = list(model.parameters())
    exc = outcome(lambda: parallelize(model, shape, "auto", memory_per_rank=budget,
                                      machine=MACHINE, baseline=extra))
    collective_assert(isinstance(exc, ValueError) and "fits" in str(exc), repr(exc))
    for bad in (-1.0, float("nan"), "1 GiB"):
        exc = outcome(lambda bad=bad: parallelize(model, shape, "auto", machine=MACHINE,
                                                  baseline=bad))
        collective_assert(isinstance(exc, ValueError) and "baseline" in str(exc), repr(exc))
    collective_assert(all(a is b for a, b in zip(before, model.parameters())), "converted")


@pytest.mark.parallel(SIZES)
def test_a_budget_no_plan_fits_is_refused_alike():
    model, shape, _ = make("cnn", torch.float64)
    before = list(model.parameters())
    exc = outcome(lambda: parallelize(model, shape, "auto", memory_per_rank=4096,
                                      machine=MACHINE))
    # the budget as given (not "0 MiB"), and what the smallest plan needs (not "nan MiB")
    found = re.search(r"needs ([\d.]+) (MiB|KiB)\)", str(exc))
    need = float(found.group(1)) * {"KiB": 2**10, "MiB": 2**20}[found.group(2)] if found else 0
    collective_assert(isinstance(exc, ValueError) and "fits 4.0 KiB per rank" in str(exc)
                      and need > 4096, repr(exc))
    collective_assert(all(a is b for a, b in zip(before, model.parameters())), "converted")


@pytest.mark.parallel(SIZES)
def test_a_plan_of_another_model_is_refused_alike():
    cnn, shape, _ = make("cnn", torch.float64)
    plan = parallelize(copy.deepcopy(cnn), shape, machine=MACHINE).plan
    unet, ushape, _ = make("unet", torch.float64)
    before = list(unet.parameters())
    exc = outcome(lambda: parallelize(unet, ushape, plan))
    collective_assert(isinstance(exc, ValueError) and "another model" in str(exc), repr(exc))
    collective_assert(all(a is b for a, b in zip(before, unet.parameters())), "converted")
    other = (8,) + shape[1:]
    exc = outcome(lambda: parallelize(copy.deepcopy(cnn), other, plan))
    collective_assert(isinstance(exc, ValueError) and "input shape" in str(exc), repr(exc))
    wrong = dataclasses.replace(plan, entries=[dataclasses.replace(
        plan.entries[0], grid=(comm.Get_size() + 1, 1, 1))] + plan.entries[1:])
    exc = outcome(lambda: parallelize(copy.deepcopy(cnn), shape, wrong))
    collective_assert(isinstance(exc, ValueError) and "does not hold" in str(exc), repr(exc))
    exc = outcome(lambda: parallelize(copy.deepcopy(cnn), shape, "no-such-plan.json"))
    collective_assert(isinstance(exc, ValueError) and "no file" in str(exc), repr(exc))
    # the same layers, names and shapes, but a wider kernel: priced for another model
    wider = copy.deepcopy(cnn)
    wider.conv2 = nn.Conv2d(4, 4, 5, padding=2).double()
    exc = outcome(lambda: parallelize(wider, shape, plan))
    collective_assert(isinstance(exc, ValueError) and "another model" in str(exc)
                      and "'conv2'" in str(exc) and "kernel_size=(5, 5)" in str(exc), repr(exc))
    # a plan written before layers were described holds for any model of its shapes
    older = dataclasses.replace(plan, entries=[dataclasses.replace(e, signature="")
                                               for e in plan.entries])
    collective_assert(parallelize(copy.deepcopy(cnn), shape, older).plan is older, "refused")


class SharedPath(nn.Module):
    """Two of three joined paths share a layer: not residual or skip blocks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        return torch.cat([self.b(x), y + 1, y * 2], 1)


class AlongWidth(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        return torch.cat([self.a(x), x], 3)


class ThreeDims(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        y = self.a(x)
        return y.view(y.size(0), y.size(1), -1).sum(2)


class Several(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        y, idx = torch.max(self.a(x), dim=1, keepdim=True)
        return y * idx


@pytest.mark.parallel([1, 2])
def test_a_graph_the_planner_cannot_describe_is_refused_alike():
    for model, node in ((SharedPath(), "'a'"), (AlongWidth(), "'cat'"), (ThreeDims(), "'view'"),
                        (Several(), "'max")):  # an operation of several outputs
        before = list(model.parameters())
        exc = outcome(lambda m=model: parallelize(m, (2, 2, 8, 8), "auto", machine=MACHINE))
        collective_assert(isinstance(exc, NotImplementedError) and node in str(exc) and
                          "grid shape" in str(exc), repr(exc))
        collective_assert(all(a is b for a, b in zip(before, model.parameters())),
                          "converted")


# ------------------------------------------------------------------ memory format
@pytest.mark.parallel([2, 3])
def test_a_graph_the_planner_cannot_describe_is_refused_before_any_calibration(
        monkeypatch, tmp_path):
    """On 'this' with no calibration for the job, a graph the planner cannot describe is
    refused before the machine is measured (which takes a while): nothing calibrated."""
    from disttensor_nn.plan import calibrate as calibrate_module
    from disttensor_nn.plan import machine as machine_module

    where = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    monkeypatch.setattr(machine_module, "default_cache_dir", lambda: where)
    monkeypatch.setattr(timer_module, "default_cache_dir", lambda: where)

    def measured(*args, **kwargs):
        raise AssertionError("calibrated before the graph was checked")

    monkeypatch.setattr(calibrate_module, "calibrate", measured)
    exc = outcome(lambda: parallelize(AlongWidth(), (2, 2, 8, 8)))
    collective_assert(isinstance(exc, NotImplementedError) and "'cat'" in str(exc), repr(exc))


def _measured_machine(monkeypatch, tmp_path):
    """A measured machine profile (the V100's figures; kernels timed on this machine) in a
    scratch directory shared by the ranks, with the kernel timer's cache there too."""
    where = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    path = f"{where}/machine.json"
    if comm.Get_rank() == 0:
        dataclasses.replace(builtin_profiles()[MACHINE], name="memory-format-test",
                            measured=True, device="cpu").save(path)
    comm.Barrier()
    monkeypatch.setattr(timer_module, "default_cache_dir", lambda: where)
    return path


@pytest.mark.parallel([2, 3])
def test_default_machine_is_a_calibration_for_the_jobs_ranks_per_node(monkeypatch, tmp_path):
    """On ``'this'`` (the default machine) a job never plans on a calibration taken with
    another number of ranks per node: the one kept for its own is put back first, and the
    plan is made on it."""
    from disttensor_nn.plan import machine as machine_module
    from disttensor_nn.plan.calibrate import METHOD
    from disttensor_nn.plan.machine import MachineProfile, this_machine_path

    where = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    monkeypatch.setattr(machine_module, "default_cache_dir", lambda: where)
    monkeypatch.setattr(timer_module, "default_cache_dir", lambda: where)
    size = comm.Get_size()  # every rank of this job shares one node
    base = dataclasses.replace(builtin_profiles()[MACHINE], measured=True, device="cpu",
                               calibration_method=METHOD)
    other = dataclasses.replace(base, name="other", calibrated_ranks_per_node=size + 2,
                                p2p_alpha=1e-3)
    mine = dataclasses.replace(base, name="mine", calibrated_ranks_per_node=size)
    if comm.Get_rank() == 0:
        other.save(this_machine_path())
        mine.save(this_machine_path(per_node=size))
    comm.Barrier()
    model, _, _ = make("cnn", torch.float64)
    plan = parallelize(model, (4, 2, 16, 16)).plan
    collective_assert(plan.machine == "mine", plan.machine)
    collective_assert(MachineProfile.load(this_machine_path()) == mine, "not put back")


@pytest.mark.parallel(SIZES)
def test_auto_memory_format_keeps_the_plan_predicted_faster(monkeypatch, tmp_path):
    """On a measured profile the model is planned on (N, C, H, W) and on channels-last
    blocks (the input blocks' conversion timed into the latter); the plan predicted faster
    is kept (channels-last by more than the margin), says so, and the blocks are laid out
    as it was timed; outputs and gradients equal one process's either way."""
    machine = _measured_machine(monkeypatch, tmp_path)
    shape = (4, 2, 16, 16)
    model, _, _ = make("cnn", torch.float64)
    times = {}
    for fmt, name in ((torch.contiguous_format, "contiguous"),
                      (torch.channels_last, "channels_last")):
        plan = parallelize(copy.deepcopy(model), shape, machine=machine,
                           memory_format=fmt).plan
        collective_assert(plan.memory_format == name, plan.memory_format)
        # the input blocks' conversion, timed on every rank, is part of channels-last's time
        converted = [n for n in plan.notes if n.startswith("input blocks put in channels-last")]
        collective_assert(len(converted) == (name == "channels_last"), plan.notes)
        times[name] = plan.time
    ref = copy.deepcopy(model)
    pm = parallelize(model, shape, machine=machine)  # memory_format='auto', the default
    # channels-last only where it is faster by more than the margin
    best = "channels_last" if times["channels_last"] < \
        (1 - CHANNELS_LAST_GAIN) * times["contiguous"] else "contiguous"
    collective_assert(pm.plan.memory_format == best and pm.plan.time == times[best],
                      (pm.plan.memory_format, pm.plan.time, times))
    collective_assert(any("memory format chosen" in n and best + " kept" in n
                          for n in pm.plan.notes), pm.plan.notes)
    want = torch.channels_last if best == "channels_last" else None
    collective_assert(pm.memory_format == want, (pm.memory_format, want))
    x = global_tensor(shape, 1, torch.float64)
    out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
    whole = gather(out.local, out.dist)
    target = global_tensor(tuple(whole.shape), 2, torch.float64)
    (whole * target).sum().backward()
    yr = ref(x)
    (yr * target).sum().backward()
    collective_assert(rel(out.to_global(), yr) < 1e-10, "output")
    for (name, a), b in zip(pm.named_parameters(), ref.parameters()):
        collective_assert(rel(a.grad, b.grad) < 1e-10, f"grad {name}")


@pytest.mark.parallel(SIZES)
def test_auto_memory_format_times_nothing_on_a_published_profile():
    """A published profile times no kernel: nothing tells the layouts apart, the blocks
    stay as they come; a grid layout ignores 'auto' alike; other values are refused on
    every rank."""
    model, shape, _ = make("cnn", torch.float64)
    pm = parallelize(copy.deepcopy(model), shape, machine=MACHINE)
    collective_assert(pm.plan.memory_format == "contiguous" and pm.memory_format is None and
                      not any("memory format" in n for n in pm.plan.notes), pm.plan.notes)
    grid = (comm.Get_size(), 1, 1, 1)
    collective_assert(parallelize(copy.deepcopy(model), shape, grid).memory_format is None,
                      "a grid layout keeps blocks as they come")
    for bad in ("sideways", 3):
        exc = outcome(lambda bad=bad: parallelize(copy.deepcopy(model), shape,
                                                  machine=MACHINE, memory_format=bad))
        collective_assert(isinstance(exc, ValueError) and "memory_format" in str(exc),
                          repr(exc))
