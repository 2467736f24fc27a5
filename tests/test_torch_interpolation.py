"""The input rows and weights of each output row of ``F.interpolate`` along one dimension
(``disttensor_nn.torch.interpolation.source_taps``), against PyTorch's own interpolation
of the unit vectors: row ``j`` of ``F.interpolate(eye(n))`` holds the weight of input
row ``j`` in every output row."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)

from disttensor_nn.torch.interpolation import source_taps, taps_reach  # noqa: E402

SCALES = st.one_of(st.sampled_from([0.5, 0.6, 0.75, 1.0, 1.3, 1.5, 2.0, 2.5, 3.0, 7 / 3]),
                   st.floats(0.2, 4.0))


LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


def pytorch_weights(mode: str, n: int, size: int | None, scale: float | None,
                    align_corners: bool | None, dtype: torch.dtype, ndim: int,
                    axis: int) -> np.ndarray:
    """(n, m): the weight of each input row in each output row, by PyTorch, along
    ``axis`` of a tensor of ``ndim`` spatial dimensions (the others of length 1)."""
    kw = {} if align_corners is None else {"align_corners": align_corners}
    shape = [n if k == axis else 1 for k in range(ndim)]
    eye = torch.eye(n, dtype=dtype).reshape(n, 1, *shape)
    if size is not None:
        kw["size"] = tuple(size if k == axis else 1 for k in range(ndim))
    else:
        kw["scale_factor"] = tuple(scale if k == axis else 1.0 for k in range(ndim))
    y = F.interpolate(eye, mode=mode, **kw)
    return y.reshape(n, -1).double().numpy()


@settings(max_examples=250, deadline=None)
@given(family=st.sampled_from(["nearest", "nearest-exact", "linear", "bicubic"]),
       n=st.integers(1, 40), by_size=st.booleans(), size=st.integers(1, 60), scale=SCALES,
       corners=st.booleans(), double=st.booleans(), ndim=st.integers(1, 3),
       axis=st.integers(0, 2))
# a linear mode copies a dimension whose length the scale keeps; the nearest modes' rows
# where the coordinate is an integer in exact arithmetic, in float64 and float32; 2-D
# nearest images copy or halve a length kept or doubled whatever the scale given
@example(family="linear", n=3, by_size=False, size=1, scale=1.3, corners=False,
         double=True, ndim=1, axis=0)
@example(family="nearest-exact", n=16, by_size=False, size=1, scale=1.3, corners=False,
         double=True, ndim=1, axis=0)
@example(family="nearest-exact", n=14, by_size=True, size=23, scale=1.0, corners=False,
         double=True, ndim=1, axis=0)
@example(family="nearest", n=7, by_size=False, size=1, scale=0.6, corners=False,
         double=True, ndim=1, axis=0)
@example(family="nearest", n=2, by_size=False, size=1, scale=7 / 3, corners=False,
         double=False, ndim=1, axis=0)
@example(family="nearest", n=11, by_size=False, size=1, scale=1.05, corners=False,
         double=False, ndim=2, axis=0)
@example(family="nearest", n=10, by_size=False, size=1, scale=2.05, corners=False,
         double=True, ndim=2, axis=1)
@example(family="nearest", n=26, by_size=True, size=44, scale=1.0, corners=False,
         double=True, ndim=2, axis=0)
def test_taps_are_pytorchs_rows_and_weights(family, n, by_size, size, scale, corners,
                                            double, ndim, axis):
    if family == "bicubic":
        ndim = 2
    axis %= ndim
    mode = LINEAR[ndim] if family == "linear" else family
    if not by_size and int(n * scale) == 0:
        return  # PyTorch refuses an empty output
    dtype = torch.float64 if double else torch.float32
    align = corners if family in ("linear", "bicubic") else None
    given = None if by_size else scale
    want = pytorch_weights(mode, n, size if by_size else None, given, align, dtype, ndim,
                           axis)
    m = want.shape[1]
    rows = np.arange(m)
    taps = source_taps(mode, n, m, rows, bool(align), given, double, ndim, axis)
    got = np.zeros((n, m))
    for idx, w in taps:
        assert idx.min() >= 0 and idx.max() < n
        np.add.at(got, (idx, rows), w)
    tol = 1e-12 if double else 1e-5  # PyTorch weighs float32 rows in float32
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    # the reach of a subset of the rows covers every row PyTorch weighs in them
    part = rows[m // 3: m - m // 4]
    reach = taps_reach(source_taps(mode, n, m, part, bool(align), given, double, ndim, axis))
    read = np.flatnonzero(np.abs(want[:, part]).sum(axis=1) > 0)
    if part.size == 0:
        assert reach is None
    elif read.size:
        assert reach[0] <= read.min() and read.max() <= reach[1], (reach, read)


def test_an_unknown_mode_raises():
    with pytest.raises(ValueError, match="'area'"):
        source_taps("area", 4, 2, range(2))
