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


def pytorch_weights(mode: str, n: int, size: int | None, scale: float | None,
                    align_corners: bool | None, dtype: torch.dtype) -> np.ndarray:
    """(n, m): the weight of each input row in each output row, by PyTorch."""
    kw = {} if align_corners is None else {"align_corners": align_corners}
    eye = torch.eye(n, dtype=dtype)
    if mode == "bicubic":  # 2-D only: the rows along H, one column
        y = F.interpolate(eye.reshape(n, 1, n, 1), size=None if size is None else (size, 1),
                          scale_factor=None if scale is None else (scale, 1.0), mode=mode,
                          **kw)[:, 0, :, 0]
    else:
        y = F.interpolate(eye.reshape(n, 1, n), size=size, scale_factor=scale, mode=mode,
                          **kw)[:, 0, :]
    return y.double().numpy()


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(["nearest", "nearest-exact", "linear", "bicubic"]),
       n=st.integers(1, 40), by_size=st.booleans(), size=st.integers(1, 60), scale=SCALES,
       corners=st.booleans(), double=st.booleans())
# a linear mode copies a dimension whose length the scale keeps; the nearest modes' rows
# where the coordinate is an integer in exact arithmetic, in float64 and float32
@example(mode="linear", n=3, by_size=False, size=1, scale=1.3, corners=False, double=True)
@example(mode="nearest-exact", n=16, by_size=False, size=1, scale=1.3, corners=False,
         double=True)
@example(mode="nearest-exact", n=14, by_size=True, size=23, scale=1.0, corners=False,
         double=True)
@example(mode="nearest", n=7, by_size=False, size=1, scale=0.6, corners=False, double=True)
@example(mode="nearest", n=2, by_size=False, size=1, scale=7 / 3, corners=False,
         double=False)
def test_taps_are_pytorchs_rows_and_weights(mode, n, by_size, size, scale, corners, double):
    if not by_size and int(n * scale) == 0:
        return  # PyTorch refuses an empty output
    dtype = torch.float64 if double else torch.float32
    align = corners if mode in ("linear", "bicubic") else None
    want = pytorch_weights(mode, n, size if by_size else None, None if by_size else scale,
                           align, dtype)
    m = want.shape[1]
    rows = np.arange(m)
    taps = source_taps(mode, n, m, rows, bool(align), None if by_size else scale,
                       double=double)
    got = np.zeros((n, m))
    for idx, w in taps:
        assert idx.min() >= 0 and idx.max() < n
        np.add.at(got, (idx, rows), w)
    tol = 1e-12 if double else 1e-5  # PyTorch weighs float32 rows in float32
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    # a subset of the rows gets the same taps, and its reach covers them
    part = rows[m // 3: m - m // 4]
    sub = source_taps(mode, n, m, part, bool(align), None if by_size else scale,
                      double=double)
    for (i_all, w_all), (i_sub, w_sub) in zip(taps, sub):
        np.testing.assert_array_equal(i_sub, i_all[part])
        np.testing.assert_array_equal(w_sub, w_all[part])
    reach = taps_reach(sub)
    if part.size:
        assert reach == (min(int(i.min()) for i, _ in sub), max(int(i.max()) for i, _ in sub))
    else:
        assert reach is None


def test_an_unknown_mode_raises():
    with pytest.raises(ValueError, match="'area'"):
        source_taps("area", 4, 2, range(2))
