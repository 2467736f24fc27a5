"""Per-pixel losses for segmentation: cross-entropy over the channels and the Dice loss.

Both take (N, C, *S) logits split in any way over N and space (the channels
never split) and integer class labels of shape (N, *S) or (N, 1, *S), as a
DistArray (redistributed to the logits' split if needed) or a global array.
Each returns a Python float identical on every rank, and ``backward()`` the
gradient with respect to the logits in their distribution. float64 logits
are computed in float64; others (float32, 16 bits) in float32, with the sums
over the positions in float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import (
    array_namespace,
    as_module,
    astype,
    device_kw,
    device_of,
    namespace_dtype,
    numpy_dtype,
    to_numpy,
)

from ..module import allreduce_, split_axes_comm
from ..precision import to_dtype

__all__ = ["CrossEntropyLoss", "DiceLoss"]


def _check_logits(logits: Any, name: str) -> None:
    if not isinstance(logits, DistArray):
        raise TypeError(f"{name}: the logits must be a DistArray, got {type(logits).__name__}")
    if logits.ndim < 2:
        raise ValueError(f"{name}: the logits must be (N, C, *S), got {logits.shape}")
    if logits.dist.nblocks[1] > 1:
        raise ValueError(f"{name}: the class dimension of the logits must not be split")


def _labels(logits: DistArray, target: Any, name: str) -> Any:
    """This rank's block of integer labels, shaped like the logits' block without channels.

    Out-of-range labels are counted over all ranks, so that every rank raises.
    """
    if not isinstance(target, DistArray) and not hasattr(target, "dtype"):
        target = np.asarray(target)
    if np.dtype(numpy_dtype(target.dtype)).kind not in "iu":
        raise TypeError(f"{name}: the targets must be integer class labels, got dtype "
                        f"{target.dtype}")
    n, c, *space = logits.shape
    d = logits.dist
    if tuple(target.shape) == (n, 1, *space):
        tdist = d.replace(global_shape=(n, 1, *space), splits=d.splits)
    elif tuple(target.shape) == (n, *space):
        keep = [0, *range(2, d.ndim)]
        tdist = Distribution((n, *space), d.grid, [d.axes[i] for i in keep],
                             [d.splits[i] for i in keep])
    else:
        raise ValueError(f"{name}: targets of shape {target.shape} for logits {logits.shape}; "
                         f"expected {(n, *space)} or {(n, 1, *space)}")
    if isinstance(target, DistArray):
        local = (target if target.dist == tdist else target.redistribute(tdist)).local
    else:
        local = target[tdist.local_slices()]
    xp = logits.xp
    local = xp.reshape(astype(as_module(local, xp, device_of(logits.local)), np.int64),
                       (logits.local.shape[0], *logits.local.shape[2:]))
    bad = int(math.prod(local.shape) > 0 and bool(xp.min(local) < 0 or xp.max(local) >= c))
    if allreduce_(np.array([bad], np.float64), split_axes_comm(d))[0]:
        raise ValueError(f"{name}: labels out of range [0, {c})")
    return local


def _work(logits: DistArray) -> Any:
    """This rank's logits in the dtype the loss computes in: float64 logits as they are,
    others (float32, 16 bits) in float32. Sums over the positions are taken in float64
    either way."""
    return to_dtype(logits.local,
                    np.float64 if numpy_dtype(logits.dtype) == np.float64 else np.float32)


def _softmax(z: Any) -> Any:
    xp = array_namespace(z)
    z = z - xp.max(z, axis=1, keepdims=True) if math.prod(z.shape) else z
    e = xp.exp(z)
    return e / xp.sum(e, axis=1, keepdims=True)


def _one_hot(labels: Any, c: int, like: Any) -> Any:
    """(n, C, *s) one-hot of (n, *s) labels, of ``like``'s module and dtype."""
    xp = array_namespace(like)
    classes = xp.reshape(xp.arange(c, **device_kw(like)), (1, c) + (1,) * (labels.ndim - 1))
    return astype(labels[:, None, ...] == classes, like.dtype)


def _saved(loss: Any) -> Any:
    saved = getattr(loss, "_saved", None)
    if saved is None:
        raise RuntimeError(f"{type(loss).__name__}.backward called before a successful forward "
                           "call: there is no loss to take the gradient of")
    return saved


class CrossEntropyLoss:
    """Mean over samples and positions of ``-log softmax(logits)[label]``, as PyTorch's.

    ``forward(logits, target)``: logits (N, C, *S) (also (N, C)); target
    integer labels (N, *S) or (N, 1, *S). ``backward()`` takes no argument.
    """

    def forward(self, logits: DistArray, target: Any) -> float:
        self._saved = None
        _check_logits(logits, "CrossEntropyLoss")
        labels = _labels(logits, target, "CrossEntropyLoss")
        z = _work(logits)
        xp = array_namespace(z)
        onehot = _one_hot(labels, logits.shape[1], z)
        if math.prod(z.shape):
            # -log softmax(z)[label] = log(sum exp(z - m)) + m - z[label]: one log per position
            m = xp.max(z, axis=1, keepdims=True)
            p = xp.exp(z - m)
            s = xp.sum(p, axis=1, keepdims=True)
            p /= s
            picked = xp.sum(onehot * z, axis=1, keepdims=True)
            local = float(xp.sum(xp.log(s) + m - picked, dtype=namespace_dtype(xp, np.float64)))
        else:
            p, local = onehot, 0.0
        count = logits.shape[0] * math.prod(logits.shape[2:])
        total = allreduce_(np.array([local], np.float64), split_axes_comm(logits.dist))[0]
        self._saved = (logits, p, onehot, count)
        return float(total) / count

    __call__ = forward

    def backward(self, scale: float = 1.0) -> DistArray:
        """Gradient of the mean loss with respect to the logits, times ``scale``.

        ``scale`` multiplies the gradient before it is rounded to the logits'
        dtype (a loss scale for float16 activations: :class:`~disttensor_nn.GradScaler`).
        """
        logits, p, onehot, count = _saved(self)
        g = p - onehot  # a new array each call: the layers' backward passes may write over dy
        g *= scale / count
        return DistArray(to_dtype(g, logits.dtype), logits.dist)


class DiceLoss:
    """Soft Dice loss of softmax(logits) against one-hot labels, per sample and class.

    ``1 - mean_{n,c} (2 I + smooth) / (P + T + smooth)`` with ``I``, ``P``,
    ``T`` the sums over the positions of sample ``n`` of ``p * t``, ``p``
    and ``t`` for class ``c`` (``p`` the softmax over the channels, ``t``
    the one-hot labels). The sums are reduced over every splitting rank (a
    (N, C, 3) array), so any split gives one process's value.

    Parameters
    ----------
    smooth : float
        Added to numerator and denominator (keeps empty classes finite).
    """

    def __init__(self, smooth: float = 1.0):
        if not smooth >= 0:
            raise ValueError(f"smooth must be >= 0, got {smooth!r}")
        self.smooth = float(smooth)

    def forward(self, logits: DistArray, target: Any) -> float:
        self._saved = None
        _check_logits(logits, "DiceLoss")
        labels = _labels(logits, target, "DiceLoss")
        n, c = logits.shape[:2]
        z = _work(logits)
        p = _softmax(z)
        t = _one_hot(labels, c, p)
        axes = tuple(range(2, p.ndim))
        sums = np.zeros((3, n, c))
        rows = logits.dist.local_slices()[0]
        if math.prod(p.shape):
            xp = array_namespace(p)
            f64 = namespace_dtype(xp, np.float64)
            for k, a in enumerate((p * t, p, t)):
                sums[k, rows] = to_numpy(xp.sum(a, axis=axes, dtype=f64))
        sums = allreduce_(sums, split_axes_comm(logits.dist))
        inter, psum, tsum = sums
        union = psum + tsum + self.smooth
        dice = (2 * inter + self.smooth) / union
        self._saved = (logits, p, t, inter[rows], union[rows], n * c)
        return float(1.0 - dice.mean())

    __call__ = forward

    def backward(self, scale: float = 1.0) -> DistArray:
        """Gradient of the loss with respect to the logits (through the softmax), times
        ``scale``.

        ``scale`` multiplies the gradient before it is rounded to the logits'
        dtype (a loss scale for float16 activations: :class:`~disttensor_nn.GradScaler`).
        """
        logits, p, t, inter, union, count = _saved(self)
        if not math.prod(p.shape):
            return DistArray(astype(p, logits.dtype), logits.dist)
        xp = array_namespace(p)
        shape = inter.shape + (1,) * (p.ndim - 2)
        work = numpy_dtype(p.dtype)  # the per-sample sums, taken in float64, in p's dtype
        u = as_module(np.ascontiguousarray(union, dtype=work).reshape(shape), xp, device_of(p))
        i = as_module(np.ascontiguousarray(inter, dtype=work).reshape(shape), xp, device_of(p))
        g = -(2 * t * u - (2 * i + self.smooth)) / (u * u) * (scale / count)  # d loss / d p
        dz = p * (g - xp.sum(g * p, axis=1, keepdims=True))
        return DistArray(to_dtype(dz, logits.dtype), logits.dist)
