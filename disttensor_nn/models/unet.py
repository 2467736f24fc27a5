"""U-Net (2-D, Ronneberger et al. 2015) and 3-D U-Net (Cicek et al. 2016) with same-padding.

Each level has two 3^d convolutions (each followed by a normalisation and
ReLU); the encoder halves the size with a 2^d max pool and doubles the
width; the decoder doubles the size with a 2^d transposed convolution of
stride 2 that halves the width, concatenates the encoder's activation of the
same level (a :class:`~disttensor_nn.Skip`) and runs the level's two
convolutions again; a 1^d convolution maps to the classes. With
``padding=1`` every level keeps its size, so an input whose sides are
divisible by ``2 ** (depth - 1)`` gives an output of the input's size (the
papers' valid convolutions crop instead).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..checks import check_int
from ..container import Sequential, Skip
from ..layers.conv import Conv1d, Conv2d, Conv3d
from ..layers.elementwise import ReLU
from ..layers.groupnorm import GroupNorm, InstanceNorm
from ..layers.norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from ..layers.pool import MaxPool1d, MaxPool2d, MaxPool3d
from ..layers.transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from ..module import Layer
from ._seeds import SeedStream

__all__ = ["unet", "NORMS"]

_CONV = {1: Conv1d, 2: Conv2d, 3: Conv3d}
_UP = {1: ConvTranspose1d, 2: ConvTranspose2d, 3: ConvTranspose3d}
_POOL = {1: MaxPool1d, 2: MaxPool2d, 3: MaxPool3d}
_BN = {1: BatchNorm1d, 2: BatchNorm2d, 3: BatchNorm3d}

#: The normalisations :func:`unet` accepts.
NORMS = ("batch", "group", "instance", "none")


def _norm(kind: str, nd: int, c: int, dtype: Any) -> Layer | None:
    if kind == "batch":
        return _BN[nd](c, dtype=dtype)
    if kind == "group":
        return GroupNorm(math.gcd(8, c), c, dtype=dtype)
    if kind == "instance":
        return InstanceNorm(c, affine=True, dtype=dtype)
    return None


def unet(nd: int = 2, in_channels: int = 1, num_classes: int = 2, *, depth: int = 4,
         width: int = 64, norm: str = "batch", dtype: Any = np.float32,
         seed: int = 0) -> Sequential:
    """A U-Net of ``depth`` levels (``depth - 1`` poolings) on ``nd``-D inputs.

    Parameters
    ----------
    nd : {1, 2, 3}
        Spatial dimensions (2: U-Net, 3: 3-D U-Net).
    in_channels, num_classes : int
        Input channels; output channels (logits per class).
    depth : int
        Levels; the input's sides must be divisible by ``2 ** (depth - 1)``.
        The papers use 5 (2-D) and 4 (3-D).
    width : int
        Channels of the first level (64 in the U-Net paper, 32 in the 3-D
        U-Net's); level ``i`` has ``width * 2 ** i``.
    norm : {'batch', 'group', 'instance', 'none'}
        Normalisation after every 3^d convolution (the 3-D U-Net paper uses
        batch norm; group norm takes ``gcd(8, channels)`` groups).
    dtype : dtype
    seed : int
        Seed of the weights (identical on every rank).

    Returns
    -------
    Sequential
        Encoder levels nest: level ``i`` is its two convolutions followed by
        a ``Skip(Sequential(pool, level i+1, up-convolution), post=decoder)``.
    """
    if nd not in _CONV:
        raise ValueError(f"nd must be 1, 2 or 3, got {nd!r}")
    depth = check_int(depth, "depth")
    width = check_int(width, "width")
    in_channels = check_int(in_channels, "in_channels")
    num_classes = check_int(num_classes, "num_classes")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    seeds = SeedStream(seed)
    bias = norm == "none"

    def double_conv(cin: int, cout: int) -> list[Layer]:
        layers: list[Layer] = []
        for c in (cin, cout):
            layers.append(_CONV[nd](c, cout, 3, padding=1, bias=bias, dtype=dtype, seed=seeds()))
            n = _norm(norm, nd, cout, dtype)
            layers += ([n] if n is not None else []) + [ReLU()]
        return layers

    def level(i: int, cin: int) -> list[Layer]:
        c = width * 2 ** i
        enc = double_conv(cin, c)
        if i == depth - 1:
            return enc
        down = Sequential(_POOL[nd](2), *level(i + 1, c),
                          _UP[nd](2 * c, c, 2, stride=2, dtype=dtype, seed=seeds()))
        return enc + [Skip(down, post=Sequential(*double_conv(2 * c, c)))]

    return Sequential(*level(0, in_channels),
                      _CONV[nd](width, num_classes, 1, dtype=dtype, seed=seeds()))
