"""ResNet-18/34/50/101/152 (torchvision's layer stacks, bottleneck v1.5) as distributed layers.

The model is one flat :class:`~disttensor_nn.Sequential`::

    Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
    BatchNorm2d(width), ReLU()
    MaxPool2d(3, stride=2, padding=1)
    stage 1..4 residual blocks (stage i has width * 2**(i-1) "planes";
        stages 2-4 start with a stride-2 block), each a
        Residual(branch, shortcut, post=ReLU())
    GlobalAvgPool()                    # (N, C, H, W) -> (N, C)
    Linear(C, num_classes)

Blocks, as ``torchvision.models.resnet``:

* basic (18, 34): ``conv3x3(stride s) -> BN -> ReLU -> conv3x3 -> BN``;
* bottleneck (50, 101, 152; v1.5, the stride on the 3x3 conv):
  ``conv1x1 -> BN -> ReLU -> conv3x3(stride s) -> BN -> ReLU -> conv1x1 (x4) -> BN``;
* shortcut: identity, or ``conv1x1(stride s, bias=False) -> BN`` when the
  stride or the channel count changes.

Convolutions have no bias (each is followed by batch normalisation); the
parameter counts are torchvision's (ResNet-50: 25,557,032; ResNet-18:
11,689,512). Weights use the layers' own initialisation (PyTorch's default
uniform bounds), each layer seeded by a distinct seed derived from ``seed``,
so the model is identical on every rank. No layer asks for a layout: the
activations keep whatever distribution the input has (sample, spatial or
hybrid split) until :class:`~disttensor_nn.Linear`, which works on the
sample split of the pooled features; set ``layout`` on layers (or call
``Sequential.set_layouts``) to redistribute between them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..container import Residual, Sequential
from ..layers.conv import Conv2d
from ..layers.dense import Linear
from ..layers.elementwise import ReLU
from ..layers.norm import BatchNorm2d
from ..layers.pool import GlobalAvgPool, MaxPool2d
from ..module import Layer
from ._seeds import SeedStream

__all__ = ["resnet", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
           "RESNET_CONFIGS"]

#: depth -> (block kind, blocks per stage)
RESNET_CONFIGS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
_EXPANSION = {"basic": 1, "bottleneck": 4}


class _Builder:
    def __init__(self, dtype: Any, seed: int, bn_stats: str, overlap: bool):
        self.dtype, self.seeds = np.dtype(dtype), SeedStream(seed)
        self.bn_stats, self.overlap = bn_stats, overlap

    def conv(self, cin: int, cout: int, k: int, stride: int = 1) -> Conv2d:
        return Conv2d(cin, cout, k, stride=stride, padding=(k - 1) // 2, bias=False,
                      overlap=self.overlap, dtype=self.dtype, seed=self.seeds())

    def bn(self, c: int) -> BatchNorm2d:
        return BatchNorm2d(c, stats=self.bn_stats, dtype=self.dtype)

    def block(self, kind: str, cin: int, planes: int, stride: int) -> Residual:
        cout = planes * _EXPANSION[kind]
        if kind == "basic":
            branch = Sequential(self.conv(cin, planes, 3, stride), self.bn(planes), ReLU(),
                                self.conv(planes, planes, 3), self.bn(planes))
        else:
            branch = Sequential(self.conv(cin, planes, 1), self.bn(planes), ReLU(),
                                self.conv(planes, planes, 3, stride), self.bn(planes), ReLU(),
                                self.conv(planes, cout, 1), self.bn(cout))
        shortcut = None
        if stride != 1 or cin != cout:
            shortcut = Sequential(self.conv(cin, cout, 1, stride), self.bn(cout))
        return Residual(branch, shortcut, post=ReLU())


def resnet(depth: int, num_classes: int = 1000, in_channels: int = 3, width: int = 64,
           dtype: Any = np.float32, seed: int = 0, *, bn_stats: str = "global",
           overlap: bool = False) -> Sequential:
    """A ResNet of the given depth (18, 34, 50, 101 or 152), ImageNet layout.

    Parameters
    ----------
    depth : int
        18, 34 (basic blocks) or 50, 101, 152 (bottleneck blocks).
    num_classes : int
        Outputs of the final Linear layer.
    in_channels : int
        Input channels (3 for RGB images).
    width : int
        Channels of the stem and of the first stage (64 in torchvision); stage
        ``i`` has ``width * 2**i`` planes. Small widths give small test models.
    dtype : dtype
        Parameter dtype; inputs must match it.
    seed : int
        Model seed; every convolution and the Linear layer get a distinct seed
        derived from it, in construction order.
    bn_stats : {'global', 'group'}
        Batch-norm statistics (see :class:`~disttensor_nn.BatchNorm2d`).
    overlap : bool
        Overlap halo exchanges with interior computation in every convolution.

    Returns
    -------
    Sequential
        Flat: stem layers, then one :class:`~disttensor_nn.Residual` per
        block, then GlobalAvgPool and Linear. Input (N, in_channels, H, W),
        output (N, num_classes) logits.
    """
    if depth not in RESNET_CONFIGS:
        raise ValueError(f"depth must be one of {sorted(RESNET_CONFIGS)}, got {depth}")
    kind, counts = RESNET_CONFIGS[depth]
    b = _Builder(dtype, seed, bn_stats, overlap)
    layers: list[Layer] = [b.conv(in_channels, width, 7, 2), b.bn(width), ReLU(),
                           MaxPool2d(3, stride=2, padding=1)]
    cin = width
    for i, n in enumerate(counts):
        planes = width * 2**i
        for j in range(n):
            layers.append(b.block(kind, cin, planes, 2 if (i > 0 and j == 0) else 1))
            cin = planes * _EXPANSION[kind]
    layers += [GlobalAvgPool(), Linear(cin, num_classes, dtype=b.dtype, seed=b.seeds())]
    return Sequential(*layers)


def resnet18(**kwargs: Any) -> Sequential:
    """ResNet-18 (11,689,512 parameters with the defaults); see :func:`resnet`."""
    return resnet(18, **kwargs)


def resnet34(**kwargs: Any) -> Sequential:
    """ResNet-34 (21,797,672 parameters with the defaults); see :func:`resnet`."""
    return resnet(34, **kwargs)


def resnet50(**kwargs: Any) -> Sequential:
    """ResNet-50 v1.5 (25,557,032 parameters with the defaults); see :func:`resnet`."""
    return resnet(50, **kwargs)


def resnet101(**kwargs: Any) -> Sequential:
    """ResNet-101 v1.5 (44,549,160 parameters with the defaults); see :func:`resnet`."""
    return resnet(101, **kwargs)


def resnet152(**kwargs: Any) -> Sequential:
    """ResNet-152 v1.5 (60,192,808 parameters with the defaults); see :func:`resnet`."""
    return resnet(152, **kwargs)
