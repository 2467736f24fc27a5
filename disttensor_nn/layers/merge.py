"""Concat: channel concatenation of two activations (U-Net's skip connections)."""

from __future__ import annotations

from disttensor import DistArray
from disttensor.backend import concat, contiguous

from ..module import check_grad

__all__ = ["Concat"]


class Concat:
    """``concatenate([a, b], axis=dim)`` of two (N, C, *S) DistArrays along the channels.

    ``b`` is redistributed to ``a``'s split (same grid, axes and block
    boundaries in every dimension but the channels) when it is laid out
    otherwise, and its gradient redistributed back in :meth:`backward`. The
    channel dimension is never split, so the concatenation itself is local.
    It merges a :class:`~disttensor_nn.Residual` block's two paths as
    :class:`~disttensor_nn.Add` does (see :class:`~disttensor_nn.Skip`).

    Parameters
    ----------
    dim : int
        The dimension to concatenate; only the channel dimension (1) is
        supported.
    """

    def __init__(self, dim: int = 1):
        if isinstance(dim, bool) or dim != 1:
            raise ValueError(f"Concat joins channels (dim=1) only, got dim={dim!r}")
        self.dim = 1

    def output_shape(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
                     ) -> tuple[int, ...]:
        """Shape of the concatenation; ValueError unless only the channels differ."""
        if len(a_shape) != len(b_shape) or len(a_shape) < 2 or \
                tuple(a_shape[:1]) + tuple(a_shape[2:]) != tuple(b_shape[:1]) + tuple(b_shape[2:]):
            raise ValueError(f"Concat needs equal shapes but for the channels, got {a_shape} "
                             f"and {b_shape}")
        return (a_shape[0], a_shape[1] + b_shape[1], *a_shape[2:])

    def forward(self, a: DistArray, b: DistArray) -> DistArray:
        if not isinstance(a, DistArray) or not isinstance(b, DistArray):
            raise TypeError("Concat joins two DistArrays")
        shape = self.output_shape(a.shape, b.shape)
        if a.dtype != b.dtype:
            raise TypeError(f"Concat needs one dtype, got {a.dtype} and {b.dtype}")
        if a.dist.nblocks[1] > 1 or b.dist.nblocks[1] > 1:
            raise ValueError("Concat: the channel dimension must not be split")
        self._b_dist = b.dist
        target = a.dist.replace(global_shape=b.shape, splits=a.dist.splits)
        if b.dist != target:
            b = b.redistribute(target)
        self._ca = a.shape[1]
        out_dist = a.dist.replace(global_shape=shape, splits=a.dist.splits)
        out = DistArray(concat([a.local, b.local], axis=1), out_dist)
        self._out = (out.dist, out.dtype)
        self._a_dist, self._mid = a.dist, target
        return out

    __call__ = forward

    def backward(self, dy: DistArray) -> tuple[DistArray, DistArray]:
        """Gradients with respect to ``a`` and ``b`` (each in its own distribution)."""
        dy = check_grad(dy, getattr(self, "_out", None), "Concat.backward")
        da = DistArray(contiguous(dy.local[:, :self._ca, ...], copy=True), self._a_dist)
        db = DistArray(contiguous(dy.local[:, self._ca:, ...], copy=True), self._mid)
        return da, db if self._mid == self._b_dist else db.redistribute(self._b_dist)
