"""CosmoFlow: the 3-D CNN of the MLPerf HPC CosmoFlow benchmark (regression of 4 parameters).

As in the MLPerf HPC reference: ``conv_layers`` blocks of a 3-D convolution
(kernel 2, 'same' padding, ``width * 2**i`` filters), LeakyReLU and a 2^3
max pool, then three dense layers (128, 64, 4 outputs) with LeakyReLU and
optional dropout between them. The reference's input is 4 x 128^3 and its
output a scaled tanh; here the output is linear (trained with a mean
squared error), and any cubic size divisible by ``2 ** conv_layers`` works.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import check_int
from ..container import Sequential
from ..layers.conv import Conv3d
from ..layers.dense import Flatten, Linear
from ..layers.dropout import Dropout
from ..layers.elementwise import LeakyReLU
from ..layers.pool import MaxPool3d
from ..module import Layer
from ._seeds import SeedStream

__all__ = ["cosmoflow"]


def cosmoflow(in_channels: int = 4, size: int | tuple[int, int, int] = 128, *,
              conv_layers: int = 5, width: int = 32, fc: tuple[int, int] = (128, 64),
              outputs: int = 4, dropout: float = 0.0, dtype: Any = np.float32,
              seed: int = 0) -> Sequential:
    """The CosmoFlow network for ``in_channels x size^3`` samples.

    Parameters
    ----------
    in_channels : int
        4 in the benchmark (counts at four redshifts).
    size : int or (int, int, int)
        Spatial size (128 in the benchmark); each side divisible by
        ``2 ** conv_layers``.
    conv_layers : int
        Convolution blocks (5 in the benchmark).
    width : int
        Filters of the first convolution (32 in the benchmark).
    fc : (int, int)
        Widths of the two hidden dense layers.
    outputs : int
        Regressed parameters (4).
    dropout : float
        Dropout probability after each hidden dense layer (0: none).
    dtype : dtype
    seed : int
    """
    sides = (size,) * 3 if isinstance(size, int) else tuple(size)
    conv_layers = check_int(conv_layers, "conv_layers")
    if len(sides) != 3 or any(s % 2 ** conv_layers for s in sides):
        raise ValueError(f"cosmoflow needs 3 sides divisible by 2**{conv_layers}, got {size}")
    seeds = SeedStream(seed)
    layers: list[Layer] = []
    c = check_int(in_channels, "in_channels")
    for i in range(conv_layers):
        out = width * 2 ** i
        layers += [Conv3d(c, out, 2, padding="same", dtype=dtype, seed=seeds()),
                   LeakyReLU(0.3), MaxPool3d(2)]
        c = out
    features = c * int(np.prod([s // 2 ** conv_layers for s in sides]))
    layers.append(Flatten())
    for f in fc:
        layers += [Linear(features, f, dtype=dtype, seed=seeds()), LeakyReLU(0.3)]
        if dropout:
            layers.append(Dropout(dropout, seed=seeds()))
        features = f
    layers.append(Linear(features, outputs, dtype=dtype, seed=seeds()))
    return Sequential(*layers)
