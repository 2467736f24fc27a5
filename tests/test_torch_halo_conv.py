"""Convolution of a block split along one dimension without copying it
(``disttensor_nn.torch.halo_conv``): against PyTorch's convolution of the whole
zero-padded tensor, forward and backward, for any kernel, stride, dilation,
padding (uneven along the split dimension) and groups, on uneven cuts with
empty blocks, where the block's rows line up with the kernel's padding and
where they do not (a strided convolution cut off its stride).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)

from disttensor_nn.torch.halo_conv import halo_conv_plan  # noqa: E402
from disttensor_nn.window import WindowSpec, geometry  # noqa: E402

comm = MPI.COMM_WORLD
torch.set_num_threads(1)


@st.composite
def cases(draw):
    nd = draw(st.sampled_from([1, 2, 2, 3]))
    split = draw(st.integers(0, nd - 1))
    n = draw(st.integers(1, 13))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=comm.Get_size() - 1,
                                max_size=comm.Get_size() - 1)))
    spatial = [n if i == split else draw(st.integers(1, 5)) for i in range(nd)]
    groups = draw(st.sampled_from([1, 2]))
    kernel = [draw(st.integers(1, 4)) for _ in range(nd)]
    stride = [draw(st.integers(1, 3)) for _ in range(nd)]
    dilation = [draw(st.integers(1, 2)) for _ in range(nd)]
    pads = [draw(st.integers(0, 3)) for _ in range(nd)]
    split_pad = (pads[split], draw(st.integers(0, 3)))  # (before, after) along the split
    seed = draw(st.integers(0, 2**16))
    return nd, split, cuts, spatial, groups, kernel, stride, dilation, pads, split_pad, seed


@pytest.mark.parallel([2, 3, 4])  # one rank splits nothing: no plan
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case=cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_halo_conv_is_the_convolution_of_the_whole_tensor(case, dtype):
    nd, split, cuts, spatial, groups, kernel, stride, dilation, pads, split_pad, seed = case
    d = 2 + split
    shape = (2, 2 * groups, *spatial)
    padding = [(p, p) for p in pads]
    padding[split] = split_pad
    spec = WindowSpec.make(nd, kernel, stride, padding, dilation)
    assume(all(spec.out_length(i, n) > 0 for i, n in enumerate(spatial)))
    grid = dt.ProcessGrid((comm.Get_size(),))
    axes = tuple(0 if e == d else None for e in range(len(shape)))
    splits = [cuts if e == d else None for e in range(len(shape))]
    dist = dt.Distribution(shape, grid, axes, splits)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    w_shape = (3 * groups, 2, *kernel)
    hc = halo_conv_plan(spec, dist, fn, w_shape, groups)
    assume(hc is not None)

    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.standard_normal(shape), dtype=dtype)
    w = torch.tensor(rng.standard_normal(w_shape), dtype=dtype)
    b = torch.tensor(rng.standard_normal(w_shape[0]), dtype=dtype)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    flat = [v for i in reversed(range(nd)) for v in padding[i]]
    y = fn(F.pad(xg, flat), wg, bg, stride, 0, dilation, groups)
    target = torch.tensor(rng.standard_normal(tuple(y.shape)), dtype=dtype)
    (y * target).sum().backward()

    geo = geometry(spec, dist)
    mine = tuple(slice(None) for _ in range(2)) + tuple(slice(a, b) for a, b in geo.out_box)
    xl = x[dist.local_slices()].clone().requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    out = hc(xl, wl, bl)
    (out * target[mine]).sum().backward()
    gw = torch.from_numpy(comm.allreduce(wl.grad.numpy()))
    gb = torch.from_numpy(comm.allreduce(bl.grad.numpy()))
    tol = 1e-12 if dtype == torch.float64 else 2e-5

    def close(a, b):
        return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol))

    bad = [what for what, ok in (
        ("output", close(out.detach(), y.detach()[mine])),
        ("input gradient", close(xl.grad, xg.grad[dist.local_slices()])),
        ("weight gradient", close(gw, wg.grad)),
        ("bias gradient", close(gb, bg.grad))) if not ok]
    collective_assert(not bad, f"{bad} native={hc.native} cuts={cuts}")
