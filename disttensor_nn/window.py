"""Sliding-window geometry on distributed arrays: output distribution, halo widths, local boxes.

For one spatial dimension with kernel ``k``, stride ``s``, padding
``(p_lo, p_hi)`` and dilation ``d`` over a global input of length ``n``, the
output has ``m = (n + p_lo + p_hi - d*(k-1) - 1) // s + 1`` positions and
output ``j`` reads inputs ``s*j - p_lo + d*i`` for ``i < k``.

Output ``j`` is placed on the rank that owns the centre of its window
(``s*j - p_lo + (d*(k-1))//2``, clipped to the array), so stride-1 'same'
layers keep their input's distribution and strided layers get derived
boundaries. A rank needs the inputs of its outputs' windows; the halo width
on each side is the largest need over all ranks (every rank can compute it),
and each rank reads its own window out of the extended block. Padding is not
a special case: the halo exchange fills cells beyond the global edges with
the padding mode's values.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from disttensor import Distribution

__all__ = ["WindowSpec", "WindowGeometry", "geometry", "normalize_tuple", "TransposedGeometry",
           "transposed_geometry", "transposed_layout", "transposed_length"]


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def normalize_tuple(value: int | Sequence[int], nd: int, name: str) -> tuple[int, ...]:
    """An int or an ``nd``-sequence of ints, as a tuple of ``nd`` ints.

    Raises
    ------
    TypeError
        For anything else (a float, a bool, a sequence with non-int entries),
        naming the argument ``name``.
    ValueError
        For a sequence of another length than ``nd``.
    """
    if _is_int(value):
        return (int(value),) * nd
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an int or a tuple of {nd} ints, got {value!r}")
    value = tuple(value)
    if not all(_is_int(v) for v in value):
        raise TypeError(f"{name} must be an int or a tuple of {nd} ints, got {value!r}")
    if len(value) != nd:
        raise ValueError(f"{name} must be an int or {nd} ints, got {value}")
    return tuple(int(v) for v in value)


def _padding_pair(p: object, padding: object) -> tuple[int, int]:
    """One dimension's padding entry (an int or a (before, after) pair of ints)."""
    if _is_int(p):
        return int(p), int(p)
    if isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 and \
            all(_is_int(q) for q in p):
        return int(p[0]), int(p[1])
    raise TypeError(f"padding must be an int, a tuple of ints or (before, after) pairs, "
                    f"'same' or 'valid', got {padding!r}")


@dataclass(frozen=True)
class WindowSpec:
    """Kernel, stride, padding (before, after) and dilation per spatial dimension."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]

    @classmethod
    def make(cls, nd: int, kernel, stride, padding, dilation) -> WindowSpec:
        """Validate and normalise PyTorch-style arguments (``padding`` may be 'valid')."""
        kernel = normalize_tuple(kernel, nd, "kernel_size")
        stride = normalize_tuple(stride, nd, "stride")
        dilation = normalize_tuple(dilation, nd, "dilation")
        if padding == "valid":
            pads = ((0, 0),) * nd
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError("padding='same' needs stride 1 (as in PyTorch)")
            pads = tuple(
                ((d * (k - 1)) // 2, d * (k - 1) - (d * (k - 1)) // 2)
                for k, d in zip(kernel, dilation)
            )
        elif isinstance(padding, str):
            raise ValueError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
        else:
            if _is_int(padding):
                padding = (int(padding),) * nd
            if not isinstance(padding, Sequence):
                raise TypeError(f"padding must be an int, a tuple, 'same' or 'valid', got "
                                f"{padding!r}")
            padding = tuple(padding)
            if len(padding) != nd:
                raise ValueError(f"padding must be an int or {nd} entries, got {padding}")
            pads = tuple(_padding_pair(p, padding) for p in padding)
        for name, vals, low in (("kernel_size", kernel, 1), ("stride", stride, 1),
                                ("dilation", dilation, 1)):
            if any(v < low for v in vals):
                raise ValueError(f"{name} entries must be >= {low}, got {vals}")
        if any(p < 0 for pair in pads for p in pair):
            raise ValueError(f"padding must be non-negative, got {pads}")
        return cls(kernel, stride, pads, dilation)

    def out_length(self, i: int, n: int) -> int:
        """Output length along spatial dimension ``i`` for input length ``n``."""
        lo, hi = self.padding[i]
        span = self.dilation[i] * (self.kernel[i] - 1) + 1
        return max(0, (n + lo + hi - span) // self.stride[i] + 1) if n + lo + hi >= span else 0

    def out_shape(self, in_shape: Sequence[int]) -> tuple[int, ...]:
        """Global output shape (N, C, *S) -> (N, C, *O); channels are left to the caller."""
        return tuple(in_shape[:2]) + tuple(
            self.out_length(i, n) for i, n in enumerate(in_shape[2:])
        )


@dataclass(frozen=True)
class WindowGeometry:
    """Everything a rank needs to run a window layer on one input distribution."""

    spec: WindowSpec
    in_dist: Distribution
    out_dist: Distribution  # channels as the input's; layers substitute their own
    widths: tuple[tuple[int, int], ...]  # halo per dimension (0 for N and C)
    out_box: tuple[tuple[int, int], ...]  # this rank's global output range per spatial dim
    origin: tuple[int, ...]  # global input index of the extended block's first cell

    def input_slices(self, box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
        """Slices of the extended block that an output ``box`` (global ranges) reads."""
        out = [slice(None), slice(None)]
        for i, (a, b) in enumerate(box):
            s, d, k = self.spec.stride[i], self.spec.dilation[i], self.spec.kernel[i]
            if b <= a:
                out.append(slice(0, 0))
                continue
            start = s * a - self.spec.padding[i][0] - self.origin[i]
            out.append(slice(start, start + s * (b - a - 1) + d * (k - 1) + 1))
        return tuple(out)

    def interior_box(self) -> tuple[tuple[int, int], ...]:
        """Outputs whose window lies inside this rank's own block (no halo needed)."""
        box = []
        for i, (j0, j1) in enumerate(self.out_box):
            sl = self.in_dist.local_slices()[2 + i]
            s, d, k = self.spec.stride[i], self.spec.dilation[i], self.spec.kernel[i]
            p = self.spec.padding[i][0]
            a = min(j1, max(j0, -(-(sl.start + p) // s)))
            b = max(a, min(j1, (sl.stop - 1 + p - d * (k - 1)) // s + 1))
            box.append((a, b))
        return tuple(box)

    def boundary_boxes(self) -> list[tuple[tuple[int, int], ...]]:
        """The output box minus the interior box, as disjoint boxes (slabs per dimension)."""
        inner = self.interior_box()
        boxes = []
        current = list(self.out_box)
        for i, ((a, b), (ia, ib)) in enumerate(zip(self.out_box, inner)):
            for lo, hi in ((a, ia), (ib, b)):
                if hi > lo:
                    boxes.append(tuple(current[:i]) + ((lo, hi),) + tuple(current[i + 1:]))
            current[i] = (ia, ib)
            if ib <= ia:
                break
        return [bx for bx in boxes if all(h > l for l, h in bx)]


def _out_boundaries(spec: WindowSpec, i: int, bounds: tuple[int, ...], n: int) -> list[int]:
    """Output block boundaries along spatial dim ``i``: outputs go where their centre lives."""
    m = spec.out_length(i, n)
    s, d, k = spec.stride[i], spec.dilation[i], spec.kernel[i]
    c0 = -spec.padding[i][0] + (d * (k - 1)) // 2  # centre of output 0
    cuts = [min(m, max(0, -(-(b - c0) // s))) for b in bounds[1:-1]]
    return [0, *cuts, m]


def output_layout(spec: WindowSpec, in_dist: Distribution) -> tuple[Distribution, tuple]:
    """Output distribution and halo widths of ``spec`` on ``in_dist`` (pure: any rank's view).

    ``in_dist`` may be built on a grid shape alone; the output distribution
    then is too (and is remembered: the cost model asks for the same ones
    many times). Widths are per dimension (0 for N and C).
    """
    if in_dist.grid is None:
        return _pure_output_layout(spec, in_dist)
    return _output_layout(spec, in_dist)


def _output_layout(spec: WindowSpec, in_dist: Distribution) -> tuple[Distribution, tuple]:
    """:func:`output_layout`, computed."""
    nd = len(spec.kernel)
    shape = in_dist.global_shape
    splits: list = [in_dist.splits[0], in_dist.splits[1]]
    out_bounds = []
    for i in range(nd):
        ob = _out_boundaries(spec, i, in_dist.boundaries[2 + i], shape[2 + i])
        out_bounds.append(ob)
        splits.append(ob[1:-1] if len(ob) > 2 else None)
    out_dist = in_dist.replace(global_shape=spec.out_shape(shape), splits=splits)
    widths = [(0, 0), (0, 0)]
    for i in range(nd):
        s, d, k = spec.stride[i], spec.dilation[i], spec.kernel[i]
        ib, ob = in_dist.boundaries[2 + i], out_bounds[i]
        lo = hi = 0
        for blk in range(len(ib) - 1):
            j0, j1 = ob[blk], ob[blk + 1]
            if j1 <= j0:
                continue
            first = s * j0 - spec.padding[i][0]
            last = s * (j1 - 1) - spec.padding[i][0] + d * (k - 1)
            lo = max(lo, ib[blk] - first)
            hi = max(hi, last + 1 - ib[blk + 1])
        widths.append((lo, hi))
    return out_dist, tuple(widths)


@lru_cache(maxsize=512)
def geometry(spec: WindowSpec, in_dist: Distribution) -> WindowGeometry:
    """The :class:`WindowGeometry` of ``spec`` on ``in_dist`` for this rank (cached)."""
    nd = len(spec.kernel)
    out_dist, widths = output_layout(spec, in_dist)
    block = in_dist.block_index()
    out_box = tuple((out_dist.boundaries[2 + i][block[2 + i]],
                     out_dist.boundaries[2 + i][block[2 + i] + 1]) for i in range(nd))
    start = in_dist.local_start()
    origin = tuple(start[2 + i] - widths[2 + i][0] for i in range(nd))
    return WindowGeometry(spec, in_dist, out_dist, widths, out_box, origin)


# --------------------------------------------------------------------------- transposed windows
# A transposed window layer (ConvTranspose) is the adjoint of the window layer
# ``spec`` that maps its output y back to its input x: input j spreads into the
# outputs ``s*j - p_lo + d*i`` (``i < k``). Output o is placed on the rank that
# owns input ``(o + p_lo - (d*(k-1))//2) / s`` (rounded down), so a 'same'
# transposed layer keeps its input's distribution and a stride-s one cuts its
# output at ``s`` times the input's cuts; applying the forward window rule to
# that output gives back the input's cuts.


def transposed_length(spec: WindowSpec, i: int, n: int, output_padding: int = 0) -> int:
    """Output length along spatial dim ``i`` of the transposed window for input length ``n``."""
    lo, hi = spec.padding[i]
    s, d, k = spec.stride[i], spec.dilation[i], spec.kernel[i]
    return max(0, (n - 1) * s - lo - hi + d * (k - 1) + output_padding + 1) if n else 0


@dataclass(frozen=True)
class TransposedGeometry:
    """Everything a rank needs to run a transposed window layer on one input distribution.

    ``in_widths`` is the halo of the input that the forward pass reads (the
    inputs that spread into this rank's outputs); ``out_widths`` the halo of
    the output gradient that the backward pass reads (the outputs that this
    rank's inputs spread into). ``in_origin`` and ``out_origin`` are the global
    indices of the first cell of the two extended blocks.
    """

    spec: WindowSpec
    output_padding: tuple[int, ...]
    in_dist: Distribution
    out_dist: Distribution  # channels as the input's; layers substitute their own
    in_widths: tuple[tuple[int, int], ...]
    out_widths: tuple[tuple[int, int], ...]
    in_origin: tuple[int, ...]
    out_origin: tuple[int, ...]

    def spread_start(self, i: int, j: int) -> int:
        """First output position (global) that input ``j`` spreads into along spatial dim ``i``."""
        return self.spec.stride[i] * j - self.spec.padding[i][0]

    def spread_length(self, i: int, count: int) -> int:
        """Length of the output window that ``count`` consecutive inputs spread into."""
        s, d, k = self.spec.stride[i], self.spec.dilation[i], self.spec.kernel[i]
        return s * (count - 1) + d * (k - 1) + 1 if count else 0


def transposed_layout(spec: WindowSpec, output_padding: tuple[int, ...], in_dist: Distribution
                      ) -> tuple[Distribution, tuple, tuple]:
    """Output distribution, input halo widths (forward) and output halo widths (backward).

    Pure: ``in_dist`` may be built on a grid shape alone. Widths are per
    dimension (0 for N and C).
    """
    nd = len(spec.kernel)
    shape = in_dist.global_shape
    splits: list = [in_dist.splits[0], None]
    out_shape = list(shape[:2])
    in_w: list = [(0, 0), (0, 0)]
    out_w: list = [(0, 0), (0, 0)]
    for i in range(nd):
        s, d, k = spec.stride[i], spec.dilation[i], spec.kernel[i]
        p = spec.padding[i][0]
        m = transposed_length(spec, i, shape[2 + i], output_padding[i])
        out_shape.append(m)
        ib = in_dist.boundaries[2 + i]
        c = (d * (k - 1)) // 2
        ob = [0, *(min(m, max(0, s * b - p + c)) for b in ib[1:-1]), m]
        splits.append(ob[1:-1] if len(ob) > 2 else None)
        ilo = ihi = olo = ohi = 0
        for blk in range(len(ib) - 1):
            o0, o1 = ob[blk], ob[blk + 1]
            if o1 > o0:  # inputs that spread into [o0, o1)
                j_min = -((-(o0 + p - d * (k - 1))) // s)
                j_max = (o1 - 1 + p) // s
                ilo = max(ilo, ib[blk] - j_min)
                ihi = max(ihi, j_max + 1 - ib[blk + 1])
            b0, b1 = ib[blk], ib[blk + 1]
            if b1 > b0:  # outputs that inputs [b0, b1) spread into
                first = s * b0 - p
                last = s * (b1 - 1) - p + d * (k - 1)
                olo = max(olo, o0 - first)
                ohi = max(ohi, last + 1 - o1)
        in_w.append((ilo, ihi))
        out_w.append((olo, ohi))
    out_dist = in_dist.replace(global_shape=tuple(out_shape), splits=splits)
    return out_dist, tuple(in_w), tuple(out_w)


@lru_cache(maxsize=512)
def transposed_geometry(spec: WindowSpec, output_padding: tuple[int, ...],
                        in_dist: Distribution) -> TransposedGeometry:
    """The :class:`TransposedGeometry` of ``spec`` on ``in_dist`` for this rank (cached)."""
    nd = len(spec.kernel)
    out_dist, in_w, out_w = transposed_layout(spec, output_padding, in_dist)
    in_start = in_dist.local_start()
    block = in_dist.block_index()
    out_start = [out_dist.boundaries[2 + i][block[2 + i]] for i in range(nd)]
    in_origin = tuple(in_start[2 + i] - in_w[2 + i][0] for i in range(nd))
    out_origin = tuple(out_start[i] - out_w[2 + i][0] for i in range(nd))
    return TransposedGeometry(spec, tuple(output_padding), in_dist, out_dist, in_w, out_w,
                              in_origin, out_origin)


_pure_output_layout = lru_cache(maxsize=16384)(_output_layout)
