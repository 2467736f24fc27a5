"""16-bit activations (disttensor_nn.precision, --precision): layers against float64
references on the 16-bit-rounded inputs, at 1-4 ranks on split and uneven layouts.

Each layer runs with bfloat16 and float16 activations and float32 parameters,
in each kernel backend, on every layout of :func:`nn_reference.layouts`
(empty and 1-element blocks included); its output and input gradient are
16-bit, its parameters' gradients float32, and all three match the serial
reference (scipy/NumPy in float64 on the same rounded input) within the
16-bit rounding. The halo bytes a 16-bit convolution moves, and the bytes a
model's redistributions send, are counted (half of float32's); GradScaler
skips a step with an infinite gradient on one rank on every rank; training
in bf16 follows float32's losses; bad names raise on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import KERNELS, Checks, bn_ref, conv_ref, conv_ref_backward, layouts, pool_ref

import disttensor as dt
import disttensor.transport as transport
import disttensor_nn as nn
from disttensor.redistribute import RedistributionPlan, redistribution_plan
from disttensor.testing import collective_assert, collective_outcome
from disttensor_nn.precision import (
    PRECISIONS,
    GradScaler,
    compute_dtype,
    is_half,
    precision_dtype,
    precision_of,
    set_precision,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3, 4]
HALF = ["bf16", "fp16"]
# the relative rounding of one value (half an ulp), and the tolerance of a result made of
# many rounded values (inputs, weights and the output itself rounded to 16 bits)
EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def tol(p: str, scale: float) -> dict[str, float]:
    return {"rtol": 8 * EPS[p], "atol": 8 * EPS[p] * scale}


def rounded(a: np.ndarray, p: str) -> np.ndarray:
    """``a`` rounded to precision ``p``, back in float64 (what the layer sees)."""
    return a.astype(precision_dtype(p)).astype(np.float64)


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# --------------------------------------------------------------------------- names
def test_precision_names_dtypes_and_kernel_dtypes():
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    assert precision_dtype("fp32") == np.float32
    assert precision_dtype("fp16") == np.float16
    assert precision_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert [precision_of(precision_dtype(p)) for p in PRECISIONS] == list(PRECISIONS)
    assert is_half(np.float16) and is_half(ml_dtypes.bfloat16) and not is_half(np.float32)
    bf = np.dtype(ml_dtypes.bfloat16)
    # bfloat16 runs in torch's bf16 kernels; NumPy's, and torch's float16 on a CPU, in float32
    assert compute_dtype(bf, "torch") == bf
    assert compute_dtype(bf, "numpy") == np.float32
    assert compute_dtype(np.float16, "torch", "cpu") == np.float32
    assert compute_dtype(np.float16, "torch", "gpu") == np.float16
    assert compute_dtype(np.float64, "numpy") == np.float64
    for bad in ("float16", "bf32", "", None):
        with pytest.raises(ValueError, match="unknown precision"):
            precision_dtype(bad)


@pytest.mark.parallel(SIZES)
def test_a_refused_precision_changes_nothing_and_is_refused_on_every_rank():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU())
    _, out = collective_outcome(lambda: set_precision(model, "half"))
    collective_assert(isinstance(out, ValueError) and "unknown precision" in str(out), repr(out))
    collective_assert(all(m.activation_dtype is None for m in model.modules()))
    set_precision(model, "bf16")
    x = dt.DistArray.from_global(np.zeros((2, 2, 5, 5), np.float32),
                                 dt.Distribution((2, 2, 5, 5), dt.ProcessGrid((comm.size,)),
                                                 (None, None, 0, None)))
    _, out = collective_outcome(lambda: model(x))
    collective_assert(isinstance(out, TypeError) and "bfloat16" in str(out), repr(out))


# --------------------------------------------------------------------------- layers
def _run(layer, x: np.ndarray, dy_of, dist, p: str):
    """The layer in precision ``p`` on ``dist``: (y, dx, param grads) as DistArrays/arrays."""
    set_precision(layer, p)
    dtype = precision_dtype(p)
    xd = dt.DistArray.from_global(x.astype(dtype), dist)
    y = layer(xd)
    layer.zero_grad()
    dy = dy_of(y.shape)
    dx = layer.backward(dt.DistArray.from_global(dy.astype(dtype), y.dist))
    return y, dx, [q.grad for q in layer.parameters()]


def _dy(shape):
    return np.random.default_rng(5).standard_normal(shape)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("p", HALF)
def test_conv_in_16_bits_matches_the_reference_on_every_layout(p, kernels):
    conv = nn.Conv2d(3, 4, 3, stride=(1, 2), padding=1, seed=2)
    conv.kernel_backend = kernels
    shape = (3, 3, 9, 8)
    x = rounded(np.random.default_rng(1).standard_normal(shape), p)
    w = f64(conv.weight.data.astype(precision_dtype(p)))  # the kernels' weights are rounded
    b = f64(conv.bias.data.astype(precision_dtype(p)))
    args = {"stride": (1, 2), "pads": [(1, 1), (1, 1)], "dilation": (1, 1)}
    want = conv_ref(x, w, b, **args)
    dy = rounded(_dy(want.shape), p)
    dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, **args)
    check = Checks()
    for name, dist in layouts(shape):
        msg = f"{p} {kernels} on {name}"
        y, dx, (dw, db) = _run(conv, x, lambda s: dy, dist, p)
        check.true(y.dtype == precision_dtype(p) and dx.dtype == precision_dtype(p),
                   f"{msg}: dtypes {y.dtype} {dx.dtype}")
        check.true(dw.dtype == np.float32 and db.dtype == np.float32, f"{msg}: grads {dw.dtype}")
        check.close(f64(y.local), want[y.dist.local_slices()], f"{msg}: y",
                    **tol(p, np.abs(want).max()))
        check.close(f64(dx.local), dx_want[dx.dist.local_slices()], f"{msg}: dx",
                    **tol(p, np.abs(dx_want).max()))
        check.close(f64(dw), dw_want, f"{msg}: dw", **tol(p, np.abs(dw_want).max()))
        check.close(f64(db), db_want, f"{msg}: db", **tol(p, np.abs(db_want).max()))
    check.finish()


@pytest.mark.skipif(not nn.kernels.torch_kernels.available(), reason="needs PyTorch")
@pytest.mark.parametrize("nd", [2, 3])
def test_bf16_torch_convolution_with_one_strided_output_column_matches_the_reference(nd):
    """One output element along the last dimension, strided there: the case oneDNN 3.12's
    bfloat16 kernels get wrong on CPUs with AMX (the kernels run it unstrided)."""
    tk = nn.kernels.torch_kernels
    bf = precision_dtype("bf16")
    rng = np.random.default_rng(8)
    checked = 0
    for width in range(1, 7):
        for k, s, pad, dil in [(3, 2, 0, 1), (3, 3, 1, 1), (5, 2, 2, 1), (3, 2, 1, 2),
                               (1, 2, 0, 1), (5, 3, 0, 1)]:
            extent = dil * (k - 1) + 1
            if width + 2 * pad < extent:
                continue
            shape = (2, 3) + (9,) * (nd - 1) + (width,)
            x = rounded(rng.standard_normal(shape), "bf16")
            w = rounded(rng.standard_normal((4, 3) + (3,) * (nd - 1) + (k,)), "bf16")
            b = rounded(rng.standard_normal(4), "bf16")
            stride, dilation = (1,) * (nd - 1) + (s,), (1,) * (nd - 1) + (dil,)
            pads = (0,) * (nd - 1) + (pad,)
            want = conv_ref(x, w, b, stride, [(q, q) for q in pads], dilation)
            got = tk.conv_forward(x.astype(bf), w.astype(bf), b.astype(bf), stride, dilation,
                                  padding=pads)
            assert got.shape == want.shape, (width, k, s, pad, dil)
            np.testing.assert_allclose(f64(got), want, **tol("bf16", np.abs(want).max()),
                                       err_msg=f"width {width}, kernel {k}, stride {s}, "
                                               f"padding {pad}, dilation {dil}")
            checked += 1
    assert checked > 20


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("p", HALF)
def test_batch_norm_relu_and_pooling_in_16_bits_match_the_reference(p, kernels):
    shape = (4, 3, 8, 6)
    rng = np.random.default_rng(3)
    x = rounded(3.0 + 2.0 * rng.standard_normal(shape), p)  # an offset mean, as after a conv
    check = Checks()
    bn = nn.BatchNorm2d(3)
    bn.weight.data[:] = [1.5, -0.5, 2.0]
    bn.bias.data[:] = [0.1, 0.2, -0.3]
    bn.kernel_backend = kernels
    y_want, bn_back, _, _ = bn_ref(x, f64(bn.weight.data), f64(bn.bias.data), bn.eps)
    dy = rounded(_dy(shape), p)
    dx_want, dgamma, dbeta = bn_back(dy)
    pool = nn.MaxPool2d(2, stride=2)
    # torch runs no float16 pooling on a CPU (nor convolutions, which convert): refused
    cpu_fp16 = kernels == "torch" and p == "fp16"
    if cpu_fp16:
        pool.kernel_backend = "torch"
        with pytest.raises(TypeError, match="MaxPool2d: the torch kernels do not run float16"):
            _run(pool, x, _dy, layouts(shape)[0][1], p)
    pool.kernel_backend = "numpy" if cpu_fp16 else kernels
    p_want, p_back = pool_ref(x, (2, 2), (2, 2), [(0, 0), (0, 0)], (1, 1), "max")
    dyp = rounded(_dy(p_want.shape), p)
    relu = nn.ReLU()
    for name, dist in layouts(shape):
        msg = f"{p} {kernels} on {name}"
        y, dx, (gw, gb) = _run(bn, x, lambda s: dy, dist, p)
        check.true(y.dtype == precision_dtype(p) and gw.dtype == np.float32, f"{msg}: dtypes")
        check.close(f64(y.local), y_want[y.dist.local_slices()], f"{msg}: bn y",
                    **tol(p, np.abs(y_want).max()))
        check.close(f64(dx.local), dx_want[dx.dist.local_slices()], f"{msg}: bn dx",
                    **tol(p, np.abs(dx_want).max()))
        check.close(f64(gw), dgamma, f"{msg}: dgamma", **tol(p, np.abs(dgamma).max()))
        check.close(f64(gb), dbeta, f"{msg}: dbeta", **tol(p, np.abs(dbeta).max()))
        # max pooling and ReLU select values: exact in 16 bits
        y, dx, _ = _run(pool, x, lambda s: dyp, dist, p)
        check.equal(f64(y.local), p_want[y.dist.local_slices()], f"{msg}: pool y")
        check.equal(f64(dx.local), p_back(dyp)[dx.dist.local_slices()], f"{msg}: pool dx")
        y, dx, _ = _run(relu, x - 3.0, lambda s: dy, dist, p)
        xr = rounded(x - 3.0, p)
        check.equal(f64(y.local), np.maximum(xr, 0)[y.dist.local_slices()], f"{msg}: relu")
        check.equal(f64(dx.local), (dy * (xr > 0))[dx.dist.local_slices()], f"{msg}: relu dx")
    check.finish()


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("p", HALF)
def test_linear_group_norm_and_transposed_conv_in_16_bits_match_float64(p):
    """Layers that run in float32 on converted blocks: against the same layer in float64."""
    rng = np.random.default_rng(8)
    check = Checks()
    cases = [
        (lambda dtype: nn.Linear(6, 4, dtype=dtype, seed=1), (5, 6), 0),
        (lambda dtype: nn.GroupNorm(2, 4, dtype=dtype), (3, 4, 7, 5), 2),
        (lambda dtype: nn.ConvTranspose2d(3, 2, 3, stride=2, dtype=dtype, seed=4),
         (2, 3, 5, 4), 2),
    ]
    g = dt.ProcessGrid((comm.size,))
    for make, shape, split in cases:
        x = rounded(rng.standard_normal(shape), p)
        axes = [None] * len(shape)
        axes[split] = 0
        dist = dt.Distribution(shape, g, axes)
        ref = make(np.float64)
        for q in ref.parameters():  # the weights the 16-bit kernels see, rounded
            q.data[:] = rounded(q.data, p)
        y64 = ref(dt.DistArray.from_global(x, dist)).to_global()
        dy = rounded(_dy(y64.shape), p)
        ref.zero_grad()
        dx64 = ref.backward(dt.DistArray.from_global(dy, dt.Distribution(
            y64.shape, g, axes))).to_global()
        layer = make(np.float32)
        for q, r in zip(layer.parameters(), ref.parameters()):
            q.data[:] = r.data
        y, dx, grads = _run(layer, x, lambda s, dy=dy: dy, dist, p)
        name = type(layer).__name__
        yg, dxg = y.to_global(), dx.to_global()
        check.true(yg.dtype == precision_dtype(p), f"{name}: {yg.dtype}")
        check.close(f64(yg), y64, f"{p} {name}: y", **tol(p, np.abs(y64).max()))
        check.close(f64(dxg), dx64, f"{p} {name}: dx", **tol(p, np.abs(dx64).max()))
        for q, r in zip(grads, ref.parameters()):
            check.true(q.dtype == np.float32, f"{name}: grad {q.dtype}")
            check.close(f64(q), r.grad, f"{p} {name}: grad", **tol(p, np.abs(r.grad).max()))
    check.finish()


# --------------------------------------------------------------------------- halo bytes
@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("p", HALF)
def test_a_16_bit_convolution_moves_half_the_halo_bytes(p, monkeypatch):
    counted = []
    real = transport.mpi_buffer

    def counting(buf):
        counted.append(buf.nbytes)
        return real(buf)

    monkeypatch.setattr(transport, "mpi_buffer", counting)
    shape = (2, 3, 12, 10)
    x = np.random.default_rng(0).standard_normal(shape)
    dist = dt.Distribution(shape, dt.ProcessGrid((comm.size,)), (None, None, 0, None))
    moved = {}
    for prec in ("fp32", p):
        conv = nn.Conv2d(3, 3, 5, padding=2)
        counted.clear()
        _run(conv, x, _dy, dist, prec)
        moved[prec] = comm.allreduce(sum(counted))
    collective_assert(moved["fp32"] > 0 and 2 * moved[p] == moved["fp32"], str(moved))


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("p", HALF)
@pytest.mark.parametrize("method", ["pack", "datatype"])
def test_16_bit_redistributions_of_a_model_move_half_the_bytes(p, method, monkeypatch):
    """A model whose layers change layout (height-split, then width-split, then whole
    samples for Linear): the bytes every redistribution of its forward and backward sends,
    counted at the two ways a plan sends (packed Alltoallv, datatype Alltoallw), halve."""
    counted = []
    packed, typed = RedistributionPlan._packed, RedistributionPlan._alltoallw

    def counting_packed(self, t, xl, ol, keep):
        counted.append(self._send_layout[2] * xl.dtype.itemsize)
        return packed(self, t, xl, ol, keep)

    def counting_typed(self, sbase, sends, rbase, recvs):
        counted.append(sum(view.nbytes for _, view in sends))
        return typed(self, sbase, sends, rbase, recvs)

    real_init = RedistributionPlan.__init__

    def forced(self, src, dst, method_="auto"):
        real_init(self, src, dst, method)

    monkeypatch.setattr(RedistributionPlan, "_packed", counting_packed)
    monkeypatch.setattr(RedistributionPlan, "_alltoallw", counting_typed)
    monkeypatch.setattr(RedistributionPlan, "__init__", forced)
    redistribution_plan.cache_clear()
    try:
        shape = (3, 2, 9, 10)
        grid = dt.ProcessGrid((comm.size,))
        x = np.random.default_rng(0).standard_normal(shape)
        dist = dt.Distribution(shape, grid, (None, None, 0, None))
        moved = {}
        for prec in ("fp32", p):
            model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(3, 3, 3, padding=1), nn.Flatten(),
                                  nn.Linear(3 * 9 * 10, 4))
            model.set_layouts([None, None, nn.Layout(grid, (None, None, None, 0)), None, None])
            counted.clear()
            y, dx, grads = _run(model, x, _dy, dist, prec)
            check = Checks()
            check.true(dx.dist == dist and y.dtype == precision_dtype(prec), f"{prec}")
            check.finish()
            moved[prec] = comm.allreduce(sum(counted))
    finally:
        redistribution_plan.cache_clear()
    collective_assert(moved["fp32"] > 0 and 2 * moved[p] == moved["fp32"], str(moved))


# --------------------------------------------------------------------------- loss scaling
@pytest.mark.parallel([1, 2, 3])
def test_grad_scaler_unscales_skips_non_finite_steps_on_every_rank_and_adapts_the_scale():
    params = [nn.Parameter(np.ones(3, np.float32))]
    opt = nn.optim.SGD(params, lr=0.5)
    scaler = GradScaler(init_scale=8.0, growth_interval=2)
    # a good step: the gradient, scaled, comes back unscaled
    params[0].grad[:] = scaler.scale(np.array([8.0, 16.0, 0.0], np.float32))
    collective_assert(scaler.step(opt))
    scaler.update()
    collective_assert(np.allclose(params[0].data, [1 - 0.5 * 8, 1 - 0.5 * 16, 1.0]),
                      str(params[0].data))
    before = params[0].data.copy()
    # an infinite gradient on the last rank only: every rank skips and halves the scale
    params[0].grad[:] = np.inf if comm.rank == comm.size - 1 else 1.0
    collective_assert(not scaler.step(opt))
    scaler.update()
    collective_assert(np.array_equal(params[0].data, before) and scaler.skipped_steps == 1
                      and scaler.get_scale() == 4.0, f"{params[0].data} {scaler.get_scale()}")
    for _ in range(2):  # two good steps: the scale doubles
        params[0].grad[:] = 0.0
        scaler.step(opt)
        scaler.update()
    collective_assert(scaler.get_scale() == 8.0, str(scaler.get_scale()))
    state = scaler.state_dict()
    again = GradScaler()
    again.load_state_dict(state)
    collective_assert(again.get_scale() == 8.0 and again.skipped_steps == 1)
    with pytest.raises(RuntimeError, match="already called"):
        params[0].grad[:] = 0.0
        scaler.unscale_(opt)
        scaler.unscale_(opt)
    for bad in ({"init_scale": -1.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.5},
                {"growth_interval": 0}):
        with pytest.raises(ValueError, match="GradScaler"):
            GradScaler(**bad)


# --------------------------------------------------------------------------- training
V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing


def _train(**kw):
    from disttensor_nn.training import TrainConfig, train

    base = dict(model="mesh-demo", size=(32, 32), batch=4, steps=12, samples=16, metrics=None,
                machine=V100, progress=False, lr=0.05)
    base.update(kw)
    return train(TrainConfig(**base))


@pytest.mark.parallel([1, 2, 3])
def test_training_in_16_bits_follows_float32s_losses():
    ref = _train()
    for p in HALF:
        got = _train(precision=p)
        a, b = np.array(got["history"]), np.array(ref["history"])
        rel = np.abs(a - b) / np.abs(b)
        collective_assert(got["precision"] == p and rel.max() < 0.05 and a[-1] < a[0],
                          f"{p}: losses {a} vs float32's {b}")
        collective_assert(got["skipped_steps"] == 0, str(got["skipped_steps"]))
        collective_assert((got["loss_scale"] is not None) == (p == "fp16"), str(got))


@pytest.mark.parallel([1, 3])
def test_train_refuses_an_unknown_precision_on_every_rank_before_any_work():
    from disttensor_nn.training.driver import SetupError

    _, err = collective_outcome(_train, precision="int8")
    collective_assert(isinstance(err, SetupError) and "--precision int8" in str(err)
                      and "unknown precision" in str(err), repr(err))


@pytest.mark.parallel([2])
def test_the_command_line_trains_in_bf16_and_prints_it(capsys, tmp_path_factory):
    from disttensor_nn.training.cli import train_main

    prefix = comm.bcast(str(tmp_path_factory.mktemp("prec") / "m") if comm.rank == 0 else None)
    argv = ["mesh-demo", "--size", "32x32", "--batch", "4", "--steps", "3", "--samples", "8",
            "--machine", V100, "--no-progress", "--metrics", prefix, "--precision", "bf16"]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    collective_assert(comm.rank > 0 or "activations in bf16" in out, out)
    with pytest.raises(SystemExit) as exc:
        train_main(argv[:-1] + ["half"])
    err = capsys.readouterr().err
    collective_assert(exc.value.code == 2 and (comm.rank > 0 or (
        "invalid choice: 'half'" in err and err.count("error:") == 1)), err)


# --------------------------------------------------------------------------- arrays
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("p", HALF)
def test_16_bit_distarrays_redistribute_and_exchange_halos_bit_for_bit(p):
    """bfloat16 (a NumPy dtype of ml_dtypes) and float16 blocks move as their bytes."""
    dtype = precision_dtype(p)
    shape = (5, 7, 6)
    x = np.random.default_rng(2).standard_normal(shape).astype(dtype)
    g = dt.ProcessGrid((comm.size,))
    n = comm.size
    a = dt.Distribution(shape, g, (0, None, None))
    cuts = [] if n == 1 else [0] + [min(7, 3)] * (n - 2)  # an empty first block, uneven ones
    b = dt.Distribution(shape, g, (None, 0, None), [None, cuts, None])
    xd = dt.DistArray.from_global(x, a)
    moved = xd.redistribute(b)
    check = Checks()
    check.true(moved.dtype == dtype, f"dtype {moved.dtype}")
    check.true(np.array_equal(moved.local.view(np.uint16), x[b.local_slices()].view(np.uint16)),
               f"{p}: redistributed blocks differ")
    back = moved.redistribute(a).to_global()
    check.true(np.array_equal(back.view(np.uint16), x.view(np.uint16)), f"{p}: round trip")
    ext = dt.DistArray.from_global(x, b).exchange_halo([(0, 0), (1, 2), (0, 0)], mode="wrap")
    lo, hi = b.local_slices()[1].start, b.local_slices()[1].stop
    if hi > lo:
        rows = [(i - 1) % 7 for i in range(lo, hi + 3)]
        check.true(np.array_equal(ext.view(np.uint16), x[:, rows].view(np.uint16)),
                   f"{p}: halo-extended block differs")
    check.finish()


# --------------------------------------------------------------------------- planning
def test_a_16_bit_plan_counts_2_bytes_and_says_which_kernels_convert():
    from disttensor_nn.plan import make_plan
    from disttensor_nn.training import build_model
    from disttensor_nn.training.driver import plan_mismatch

    plans = {}
    for p in ("fp32", "bf16"):
        model, shape = build_model("mesh-demo", (256, 256), 1)  # one sample: split in space
        set_precision(model, p)
        plans[p] = make_plan(model, shape, 4, V100, kernels="numpy")[0]
    a, b = plans["fp32"], plans["bf16"]
    assert [e.grid for e in a.entries] == [e.grid for e in b.entries]
    # what each layer keeps for backward: half, but ReLU's mask of one byte per element
    for e32, e16 in zip(a.entries, b.entries):
        want = e32.memory if e32.layer == "ReLU" else e32.memory / 2
        assert e16.memory == want and (e32.memory > 0 or e32.layer == "DepthToSpace"), \
            (e32.layer, e32.memory, e16.memory)
    # the halos' bytes halved (the gradient sums stay float32)
    assert any(max(g[1:]) > 1 for g in (e.grid for e in a.entries)), [e.grid for e in a.entries]
    assert sum(e.comm for e in b.entries) < sum(e.comm for e in a.entries)
    assert b.precision == "bf16" and a.precision == "fp32"
    table = b.table()
    assert "activations, halos and messages in bf16" in table, table
    # NumPy convolutions and every batch norm compute in float32; ReLU in bf16
    assert {e.layer for e in b.entries if e.kernel_dtype == "float32"} == \
        {"Conv2d", "BatchNorm2d"}, [(e.layer, e.kernel_dtype) for e in b.entries]
    assert "numpy/f32" in table and not any(e.kernel_dtype for e in a.entries)
    plan = type(b).from_json(b.to_json())
    assert plan.precision == "bf16" and plan.entries == b.entries
    model, shape = build_model("mesh-demo", (256, 256), 1)
    assert "the plan is for bf16 activations, this run's are fp32" in \
        plan_mismatch(plan, model, shape, 4)


def test_bf16_without_ml_dtypes_raises_the_import_error_naming_the_extra(monkeypatch):
    import disttensor_nn.precision as precision
    from disttensor_nn.training.driver import SetupError

    monkeypatch.setattr(precision, "ml_dtypes", None)
    with pytest.raises(ImportError, match=r'ml_dtypes package: pip install "disttensor\[torch\]"'):
        precision_dtype("bf16")
    model = nn.Sequential(nn.Conv2d(1, 1, 3))
    with pytest.raises(ImportError, match="ml_dtypes"):
        set_precision(model, "bf16")
    assert model[0].activation_dtype is None
    with pytest.raises(SetupError, match="--precision bf16: bfloat16 arrays need the ml_dtypes"):
        _train(precision="bf16")


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_16_bit_batch_norm_in_slices_of_channels_gives_the_whole_blocks_result(kernels,
                                                                                  monkeypatch):
    """A 16-bit batch norm converts a slice of channels at a time (PART_BYTES); one channel
    per slice gives the same bits as the whole block at once, training and evaluating."""
    import disttensor_nn.layers.norm as norm

    shape = (3, 5, 6, 7)
    x = rounded(1.5 + np.random.default_rng(4).standard_normal(shape), "bf16")
    dy = rounded(_dy(shape), "bf16")
    dist = dict(layouts(shape))["HxW"]
    got = {}
    for part in (norm.PART_BYTES, 1):
        monkeypatch.setattr(norm, "PART_BYTES", part)
        for training in (True, False):
            bn = nn.BatchNorm2d(5)
            bn.weight.data[:] = np.linspace(0.5, 2.0, 5)
            bn.kernel_backend = kernels
            if not training:
                bn.running_mean[:] = np.linspace(-1, 1, 5)
                bn.running_var[:] = np.linspace(0.5, 3, 5)
                bn.train(False)
            y, dx, grads = _run(bn, x, lambda s: dy, dist, "bf16")
            got[part, training] = [f64(y.local), f64(dx.local)] + [f64(g) for g in grads]
    check = Checks()
    for training in (True, False):
        for a, b in zip(got[norm.PART_BYTES, training], got[1, training]):
            check.equal(a, b, f"training={training}: one channel per slice")
    check.finish()


@pytest.mark.parallel([1])
def test_a_16_bit_batch_norm_sharing_its_statistics_is_timed_on_16_bit_blocks(tmp_path):
    """The twin a batch norm is timed on where other ranks share its statistics (the torch
    kernels' shared backward) takes the layer's 16-bit blocks, as the layer does."""
    pytest.importorskip("torch")
    from disttensor_nn.kernels import with_backend
    from disttensor_nn.plan import KernelTimer
    from disttensor_nn.plan.costmodel import dist_for

    bf16 = np.dtype(ml_dtypes.bfloat16)
    bn = with_backend(nn.BatchNorm2d(4), "torch")
    bn.activation_dtype = bf16
    spec = bn.cost_spec(dist_for((2, 4, 8, 8), (2, 1, 1)), 2)  # the samples split: shared
    assert spec.twin is not None and spec.twin.shared_statistics
    assert spec.twin.activation_dtype == bf16
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=1)
    twin = with_backend(spec.twin, "torch")
    assert timer.measure_chain([(twin, spec.local_shape, bf16, 1.0)], MPI.COMM_SELF,
                               reps=1) == 1
    fwd, bwd, _, _ = timer.times(twin, spec.local_shape, bf16, 1.0)
    assert fwd > 0 and bwd > 0
