"""Losses: softmax cross-entropy on sample-parallel logits, and per-pixel losses that stay spatial.

Each loss returns the mean over all (global) elements as a Python float,
identical on every rank, and :meth:`backward` returns the gradient with
respect to the prediction in the prediction's distribution. Partial sums are
reduced over the grid axes that split the data, never over replica axes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import (
    array_namespace,
    as_module,
    astype,
    device_kw,
    namespace_dtype,
    numpy_dtype,
)
from disttensor.settings import validating

from ..module import allreduce_, split_axes_comm
from ..precision import to_dtype

__all__ = ["SoftmaxCrossEntropy", "MSELoss", "BCEWithLogitsLoss"]


def _check_target(target: Any, shape: tuple[int, ...]) -> Any:
    """``target`` as a DistArray or an array of the prediction's global ``shape`` (local)."""
    if not isinstance(target, DistArray) and not hasattr(target, "shape"):
        target = np.asarray(target)
    if tuple(target.shape) != shape:
        raise ValueError(f"target shape {tuple(target.shape)} != prediction {shape}")
    return target


def _local_target(target: Any, dist, xp: ModuleType) -> Any:
    """This rank's block of ``target`` (a DistArray, redistributed if needed, or a global array),
    as an array of ``xp`` (the prediction's array module)."""
    target = _check_target(target, dist.global_shape)
    if isinstance(target, DistArray):
        local = (target if target.dist == dist else target.redistribute(dist)).local
    else:
        local = target[dist.local_slices()]
    return as_module(local, xp)


def _comm(x: Any) -> Any:
    """The communicator of a loss's first argument, for check mode's agreement (None: world)."""
    return x.grid.comm if isinstance(x, DistArray) else None


def _saved_state(loss: object) -> Any:
    """What the last forward call kept for backward; RuntimeError before any forward call."""
    saved = getattr(loss, "_saved", None)
    if saved is None:
        raise RuntimeError(f"{type(loss).__name__}.backward called before a successful forward "
                           "call: there is no loss to take the gradient of")
    return saved


def _global_sum(value: float, dist) -> float:
    return float(allreduce_(np.array([value], np.float64), split_axes_comm(dist))[0])


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits) for integer class labels.

    ``forward(logits, labels)``: logits an (N, K) DistArray split over N;
    labels an (N,) DistArray or global integer array (floating-point labels
    are refused with TypeError, as in PyTorch, rather than truncated).
    ``backward()`` takes no argument: it is the gradient of the mean loss.
    """

    def forward(self, logits: DistArray, labels: Any) -> float:
        self._saved = None
        # check mode: arguments valid on some ranks only raise on every rank alike
        with validating("SoftmaxCrossEntropy.forward", {"logits": logits, "labels": labels},
                        _comm(logits)):
            if not isinstance(logits, DistArray):
                raise TypeError(f"logits must be a DistArray, got {type(logits).__name__}")
            if not isinstance(labels, DistArray) and not hasattr(labels, "dtype"):
                labels = np.asarray(labels)
            if np.dtype(numpy_dtype(labels.dtype)).kind not in "iu":
                raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
            if logits.ndim != 2:
                raise ValueError(f"logits must be (N, K), got {logits.shape}")
            if logits.dist.nblocks[1] > 1:
                raise ValueError("the class dimension of the logits must not be split")
            _check_target(labels, logits.shape[:1])
        ldist = Distribution((logits.shape[0],), logits.grid, (logits.dist.axes[0],),
                             [logits.dist.splits[0]])
        xp = logits.xp
        y = astype(_local_target(labels, ldist, xp), np.int64)
        # out-of-range labels may sit on some ranks only: count them in the loss's
        # reduction so that every rank raises, instead of the others waiting in it
        bad = int(y.shape[0] > 0 and bool(xp.min(y) < 0 or xp.max(y) >= logits.shape[1]))
        z = astype(logits.local, np.float64)
        z = z - xp.max(z, axis=1, keepdims=True) if z.shape[0] else z
        logp = z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
        # each sample's label as a one-hot row (labels picked without fancy indexing)
        hot = y[:, None] == xp.arange(logits.shape[1], **device_kw(y))[None, :]
        local = -float(xp.sum(xp.where(hot, logp, 0.0))) if y.shape[0] and not bad else 0.0
        sums = allreduce_(np.array([local, bad], np.float64), split_axes_comm(ldist))
        if sums[1]:
            raise ValueError(f"labels out of range [0, {logits.shape[1]})")
        n = logits.shape[0]
        self._saved = (logits, xp.exp(logp), hot, n)
        return float(sums[0]) / n

    __call__ = forward

    def backward(self, scale: float = 1.0) -> DistArray:
        """Gradient of the mean loss with respect to the logits, times ``scale``.

        ``scale`` multiplies the gradient before it is rounded to the logits'
        dtype (a loss scale for float16 activations: :class:`~disttensor_nn.GradScaler`).
        """
        logits, p, hot, n = _saved_state(self)
        g = p - astype(hot, p.dtype)
        return DistArray(astype(g * (scale / n), logits.dtype), logits.dist)


class _Pointwise:
    work_dtype: Any = np.float64
    """The dtype the block's loss terms and gradient are computed in (float64 blocks always
    in float64); the loss is summed in float64 either way."""

    def forward(self, pred: DistArray, target: Any) -> float:
        self._saved = None
        # check mode: a target valid on some ranks only raises on every rank alike
        with validating(f"{type(self).__name__}.forward", {"prediction": pred, "target": target},
                        _comm(pred)):
            if not isinstance(pred, DistArray):
                raise TypeError("the prediction must be a DistArray")
            _check_target(target, pred.shape)
        work = np.dtype(np.float64 if numpy_dtype(pred.dtype) == np.float64
                        else self.work_dtype)
        t = to_dtype(_local_target(target, pred.dist, pred.xp), work)
        p = to_dtype(pred.local, work)
        count = pred.size
        loss, grad = self._block_loss(p, t)  # grad: a new array of this call's own
        grad *= 1.0 / count
        self._saved = (pred, grad)
        return _global_sum(loss, pred.dist) / count

    __call__ = forward

    def backward(self, scale: float = 1.0) -> DistArray:
        """Gradient of the mean loss with respect to the prediction, times ``scale``.

        ``scale`` multiplies the gradient before it is rounded to the logits'
        dtype (a loss scale for float16 activations: :class:`~disttensor_nn.GradScaler`).
        """
        pred, grad = _saved_state(self)
        # a new array each call: the layers' backward passes may write over their dy
        return DistArray(to_dtype(grad * scale, pred.dtype), pred.dist)


class MSELoss(_Pointwise):
    """Mean squared error over every element; stays in the prediction's distribution.

    A float32 or 16-bit prediction's differences and gradient are computed in
    float32, their squares summed in float64 (two passes over the block, where
    float64 copies of the prediction and the target took seven).
    """

    work_dtype = np.float32

    @staticmethod
    def _block_loss(p: Any, t: Any) -> tuple[float, Any]:
        xp = array_namespace(p)
        d = p - t
        loss = float(xp.sum(d * d, dtype=namespace_dtype(xp, np.float64)))
        d *= 2
        return loss, d


class BCEWithLogitsLoss(_Pointwise):
    """Mean binary cross-entropy of sigmoid(logits) against targets in [0, 1]."""

    @staticmethod
    def _block_loss(p: Any, t: Any) -> tuple[float, Any]:
        xp = array_namespace(p)
        loss = xp.maximum(p, 0) - p * t + xp.log1p(xp.exp(-xp.abs(p)))
        sig = xp.where(p >= 0, 1 / (1 + xp.exp(-p)), xp.exp(p) / (1 + xp.exp(p)))
        return float(xp.sum(loss)), sig - t
