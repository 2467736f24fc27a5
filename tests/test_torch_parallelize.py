"""``disttensor_nn.torch.parallelize`` against the same model in one process.

Each model is deep-copied before it is parallelized; the copy runs on the global input in
every rank's process, the parallel model on this rank's block. The loss is the same on every
rank (the gathered output against a fixed tensor), so every parameter gradient of the
parallel model must equal the copy's, and every rank's input gradient the copy's on its
block. Grids split each dimension of the input and two at once, with uneven and empty blocks
at 3 and 4 ranks.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert, collective_outcome

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)
from torch import nn  # noqa: E402

from disttensor_nn.reduction import no_sync  # noqa: E402
from disttensor_nn.torch import ParallelModule, gather, parallelize  # noqa: E402
from disttensor_nn.torch.parallel import _broadcast_state  # noqa: E402

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
torch.set_num_threads(1)


# ------------------------------------------------------------------ models
class _Residual(nn.Module):
    """A residual block: ``relu(residual(x) + shortcut(x))``, the shortcut a strided 1 x 1
    convolution and batch norm where the shape changes (torchvision's blocks)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.residual(x)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class BasicBlock(_Residual):
    def __init__(self, cin, cout, stride=1):
        super().__init__(cin, cout, stride)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def residual(self, x):
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))


class ResNet(nn.Module):
    """torchvision's ResNet-18 layout (stem, stages of BasicBlocks, pooled head), small."""

    def __init__(self, widths=(4, 6), classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(widths[0], widths[0]))
        self.layer2 = nn.Sequential(BasicBlock(widths[0], widths[1], 2),
                                    BasicBlock(widths[1], widths[1]))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1], classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class Bottleneck(_Residual):
    """torchvision's ResNet-50 block (v1.5: the stride on the 3 x 3 convolution)."""

    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__(cin, width * self.expansion, stride)
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)

    def residual(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (stem, stages of Bottlenecks, pooled head), small."""

    def __init__(self, widths=(2, 3), classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c1, c2 = widths[0] * Bottleneck.expansion, widths[1] * Bottleneck.expansion
        self.layer1 = nn.Sequential(Bottleneck(4, widths[0]), Bottleneck(c1, widths[0]))
        self.layer2 = nn.Sequential(Bottleneck(c1, widths[1], 2), Bottleneck(c2, widths[1]))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c2, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class UNet2d(nn.Module):
    """Two levels, max-pooled down, a transposed convolution and interpolation up, cat skips."""

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2 = conv_block(2, 4), conv_block(4, 6)
        self.bottom = nn.Sequential(nn.Conv2d(6, 6, 3, padding=2, dilation=2), nn.GELU())
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(6, 6, 2, stride=2)
        self.dec2 = conv_block(12, 4)
        self.dec1 = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1, padding_mode="reflect",
                                            groups=2), nn.SiLU())
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottom(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        up = F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False)
        d1 = self.dec1(torch.cat([up, e1], 1))
        return torch.sigmoid(self.head(d1)) * 2 - 1


class UNet3d(nn.Module):
    """3-D: group norm, average pooling, nearest upsampling, a cat skip, dropout."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4),
                                 nn.LeakyReLU(0.1))
        self.pool = nn.AvgPool3d(2, ceil_mode=True)
        self.mid = nn.Sequential(nn.Conv3d(4, 4, (3, 1, 3), padding=(1, 0, 1), bias=False),
                                 nn.BatchNorm3d(4), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.drop = nn.Dropout(0.25)
        self.out = nn.Conv3d(8, 2, 3, padding=1, stride=(1, 2, 1))

    def forward(self, x):
        e = self.enc(x)
        m = self.up(self.mid(self.pool(e)))
        return self.out(self.drop(torch.cat([m, e], 1)))


class MeshFCN(nn.Module):
    """A fully convolutional net of dilated, strided and grouped 1-D convolutions."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(2, 4, 5, padding=4, dilation=2, bias=False), nn.BatchNorm1d(4), nn.Tanh(),
            nn.Conv1d(4, 4, 3, stride=2, groups=2, padding=1, padding_mode="circular"),
            nn.AvgPool1d(3, stride=1, padding=1, count_include_pad=False),
            nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1, dilation=1),
            nn.MaxPool1d(3, stride=1, padding=1, dilation=1), nn.ReLU())

    def forward(self, x):
        return self.net(x)


class Heads(nn.Module):
    """Channel LayerNorm (channels last and back), divisible adaptive pooling, and three
    heads: a mean over space, the flattened features, a functional global pool."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.pool = nn.AdaptiveAvgPool2d((4, 3))
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 3), nn.Linear(48, 3), nn.Linear(4, 3)
        self.first = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        x = torch.cat([self.first(x)[:, :1], x[:, 1:]], 1)  # channels sliced
        y = self.norm(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        y = F.softplus(self.pool(y))
        a = self.fc1(y.mean((2, 3)))
        b = self.fc2(y.reshape(y.size(0), -1))
        c = self.fc3(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))
        return torch.cat([a, b, c[:, 1:]], 1).softmax(dim=1)


class Pools(nn.Module):
    """Pooling with ceil_mode, padding, count_include_pad and divisor_override on odd sizes,
    and bicubic and nearest-exact interpolation."""

    def __init__(self):
        super().__init__()
        self.max = nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=True)
        self.avg_excl = nn.AvgPool2d((2, 3), (3, 2), padding=(1, 1), ceil_mode=True,
                                     count_include_pad=False)
        self.avg_div = nn.AvgPool2d(2, 2, divisor_override=3)
        self.scale = nn.Parameter(torch.full((1, 2, 1, 1), 1.5))

    def forward(self, x):
        y = self.max(x) * self.scale
        u = F.interpolate(y, scale_factor=(2, 3), mode="bicubic")
        v = F.interpolate(y, scale_factor=2, mode="nearest-exact")
        return torch.cat([self.avg(x).flatten(1), self.avg_excl(x).flatten(1),
                          self.avg_div(x).flatten(1), u.flatten(1), v.flatten(1)], 1)


class FunctionalPools(nn.Module):
    """The pooling functions as models call them in forward (positional and keyword
    arguments, the stride left out or given as an empty list; see also Pools1d and
    Pools3d)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a = F.max_pool2d(y, 3, 2, 1, 1, True)  # ceil_mode, positionally
        b = F.avg_pool2d(y, kernel_size=(2, 3), stride=[], padding=(1, 1),
                         count_include_pad=False)
        c = F.max_pool2d(y, 2, dilation=2)
        d = F.avg_pool2d(y, 2, divisor_override=3)
        return torch.cat([a.flatten(1), b.flatten(1), c.flatten(1), d.flatten(1)], 1)


class Pools1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return F.max_pool1d(y, 3, 2, 1) + F.avg_pool1d(y, 3, 2, 1)


class Pools3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return F.max_pool3d(y, 2, ceil_mode=True) * F.avg_pool3d(y, 2, ceil_mode=True,
                                                                divisor_override=3)


class SegNet(nn.Module):
    """Max pooling that returns its indices and max unpooling by them (SegNet's decoder),
    as modules and as functions, with padding, and sizes that need ``output_size``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.mid = nn.Conv2d(3, 3, 3, padding=1)
        self.unpool = nn.MaxUnpool2d(2)
        self.dec = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = self.enc(x)
        p, idx = self.pool(y)
        q, idx2 = F.max_pool2d(y, 3, 3, 1, return_indices=True)
        u = self.unpool(self.mid(p), idx, output_size=y.shape[2:])
        v = F.max_unpool2d(torch.tanh(q), idx2, 3, 3, 1, output_size=y.shape[2:])
        return self.dec(u + v)


class SegNetMoved(nn.Module):
    """Unpooling values whose blocks were cut differently from their indices' on the way
    (pixel unshuffling moves odd cuts to even ones): the indices follow the values."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        p, idx = F.max_pool2d(y, 2, return_indices=True)
        q = F.pixel_shuffle(torch.tanh(F.pixel_unshuffle(p, 2)), 2)
        return F.max_unpool2d(q, idx, 2)


class SegNet1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        p, idx = F.max_pool1d(y, 2, return_indices=True)
        return F.max_unpool1d(torch.tanh(p), idx, 2, output_size=y.shape[2:]) * y


class SegNet3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.MaxPool3d(2, return_indices=True)
        self.unpool = nn.MaxUnpool3d(2)

    def forward(self, x):
        y = self.conv(x)
        p, idx = self.pool(y)
        return self.unpool(torch.tanh(p), idx)


class OverlappingUnpool(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.MaxPool2d(3, 2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(3, 2)

    def forward(self, x):
        y, i = self.pool(x)
        return self.unpool(y, i)


class Shuffles(nn.Module):
    """Space into channels and back (module and function forms) on split dimensions: an
    input whose cuts are odd is unshuffled after moving to even cuts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.conv2 = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.PixelUnshuffle(2)

    def forward(self, x):
        y = self.up(self.conv(F.pixel_unshuffle(x, 2)))
        z = self.down(self.conv2(y))
        return F.pixel_unshuffle(torch.pixel_shuffle(z, 2) * 2, 2) + torch.tanh(z)


class Norms(nn.Module):
    """Batch norms of every kind: no affine map, no running statistics, a cumulative
    average (momentum None), between convolutions."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)  # a bias here has no gradient
        self.bn1 = nn.BatchNorm2d(3, affine=False)
        self.bn2 = nn.BatchNorm2d(3, track_running_stats=False)
        self.bn3 = nn.BatchNorm2d(3, momentum=None, eps=1e-3)
        self.conv2 = nn.Conv2d(3, 2, 3, padding=1, bias=False)

    def forward(self, x):
        y = torch.relu(self.bn2(torch.relu(self.bn1(self.conv(x))) * 2))
        return self.conv2(self.bn3(y + 5))


class Dropouts(nn.Module):
    """Channel dropout (module and function forms) beside element-wise dropout: one mask
    draw per sample and channel, as one process draws it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.3)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        y = self.conv2(self.drop2d(self.conv(x)))
        return self.drop(F.dropout2d(y, 0.4, self.training)) * 2


class Dropouts1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.drop = nn.Dropout1d(0.3)

    def forward(self, x):
        return F.dropout1d(self.drop(self.conv(x)), p=0.5, training=self.training)


class Dropouts3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.drop = nn.Dropout3d(0.25)

    def forward(self, x):
        return F.dropout3d(torch.tanh(self.drop(self.conv(x))), 0.5, self.training)


class Corners(nn.Module):
    """Bilinear and bicubic interpolation with align_corners=True (a U-Net's upsampling)
    on split dimensions: the module form, and scales of 2 and 3 by the function."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv2 = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv2(self.up(self.conv(x)))
        z = F.interpolate(y, scale_factor=(3, 2), mode="bicubic", align_corners=True)
        return F.interpolate(y, scale_factor=(3, 2), mode="bilinear", align_corners=True) + z


class LayerNorms(nn.Module):
    """Layer norms over split dimensions: channels and space, the last dimension alone
    (a weight, no bias), space without an affine map; the function with the model's
    parameters and with none; random weights and biases."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.ln_all = nn.LayerNorm([3, 7, 5])
        self.ln_w = nn.LayerNorm(5, bias=False)
        self.ln_hw = nn.LayerNorm([7, 5], elementwise_affine=False, eps=1e-3)
        for p in (self.ln_all.weight, self.ln_all.bias, self.ln_w.weight):
            nn.init.normal_(p)
        self.w = nn.Parameter(torch.randn(7, 5))
        self.b = nn.Parameter(torch.randn(7, 5))

    def forward(self, x):
        y = self.ln_w(torch.tanh(self.ln_all(self.conv(x))))
        y = F.layer_norm(y, (7, 5), self.w, self.b, eps=1e-4) + F.layer_norm(y, [5])
        return self.ln_hw(y * 2 + 1)


class Gates(nn.Module):
    """Operands that broadcast against a block: a squeeze-and-excitation gate (N, C, 1, 1)
    indexed with ``None``, a channels-first layer norm's mean and variance (N, 1, H, W), a
    spatial attention map (N, 1, H, W) from a 1x1 convolution, a per-channel parameter
    indexed with ``...``, and a row profile (N, C, H, 1) reached by a mean over the width."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4, 2)
        self.fc2 = nn.Linear(2, 4)
        self.att = nn.Conv2d(4, 1, 1)
        self.weight = nn.Parameter(torch.randn(4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        y = self.conv(x)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1).flatten(1)))))
        y = y * s[:, :, None, None]
        u = y.mean(1, keepdim=True)
        v = (y - u).pow(2).mean(1, keepdim=True)
        y = (y - u) / torch.sqrt(v + 1e-6)
        y = self.weight[..., None, None] * y + self.bias[:, None, None]
        y = y * torch.sigmoid(self.att(y))
        return y - y.mean(3, keepdim=True)


class Extremes(nn.Module):
    """Largest and smallest values over split dimensions: global max pooling heads (the
    module and the function), ``amax`` and ``amin`` over some dimensions, ``max()`` and
    ``torch.min`` over all, and ``amin`` of a ReLU's output, whose many zeros tie across
    ranks (its gradient shared among them as in one process)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        y = self.conv(x)
        y = y * self.pool(y) + F.adaptive_max_pool2d(torch.tanh(y), (1, 1))
        y = y - y.amax((2, 3), keepdim=True) + torch.amin(y, dim=3, keepdim=True)
        z = torch.amin(F.relu(y), dim=(2, 3)) + torch.amax(y, 1)[:, None, None, :].mean()
        return y * (y.max() - torch.min(y)) + z[:, :, None, None] + y.amax(1, keepdim=True)


class Transposes3d(nn.Module):
    """3-D convolutions with groups and a dilation ('same' padding), a grouped, dilated,
    strided transposed 3-D convolution with an output padding, and a head of ``nn.Flatten``
    and ``Linear`` whose output is added to every position."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, groups=2, dilation=(1, 2, 1), padding="same")
        self.up = nn.ConvTranspose3d(4, 4, 3, stride=2, groups=2, dilation=2, padding=1,
                                     output_padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.up(torch.tanh(self.conv(x)))
        return y + self.fc(self.flat(self.pool(y)))[:, :, None, None, None]


class Lineage(nn.Module):
    """Parameters that reach split blocks through operations on them: a module called on a
    parameter (``fc(latent)``), a broadcast operand listed first (``lerp(s, y, w)``); and
    their dtype and size used where no gradient flows (``x.to(head.weight.dtype)``,
    ``view(n, w.shape[0], -1)``), which must not count as uses of the parameter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.latent = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 4)
        self.w = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(x.to(self.head.weight.dtype))
        y = y * self.fc(self.latent).view(1, -1, 1, 1)
        s = F.adaptive_avg_pool2d(y, 1)
        y = torch.lerp(s, y, torch.sigmoid(self.w)[:, None, None])
        y = y.view(y.size(0), self.w.shape[0], -1)
        return self.head(y.mean(2)) + y.amax(2)[:, :2]


class Ties(nn.Module):
    """Extremes over inputs of few values, tied across ranks: a global max pooling (the
    module, 2-D; the function, 3-D on the input as one batch-less volume) gives the
    gradient to the first maximum, ``amax``/``amin``/``max()`` share it among the ties,
    as in one process."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        y = self.pool(x) * x + x.amax((0, 2, 3), keepdim=True) * 2
        y = y + torch.amin(x, dim=3, keepdim=True) - x.max() * x.min()
        return y + F.adaptive_max_pool3d(x, 1) * 0.5  # x as a batch-less (C, D, H, W)


def _extremes_against_one_process(make, x, seed, finite_loss):
    """On every grid, ``make()`` parallelized against one process on ``x`` (with NaNs):
    the outputs' NaNs and values, and the input gradient of ``sum(y * target)`` (with
    ``finite_loss``, of the output's NaNs made zero, so that the gradient is too)."""
    bad = []
    for grid in grids(4):
        pm = parallelize(make(), tuple(x.shape), grid)
        xl = dt.DistArray.from_global(x, pm.input_dist, xp=torch).local.clone()
        xl.requires_grad_()
        out = pm(xl)
        whole = gather(out.local, out.dist)
        target = global_tensor(whole.shape, seed, torch.float64)
        xr = x.clone().requires_grad_()
        yr = make()(xr)
        if finite_loss:
            (torch.nan_to_num(whole) * target).sum().backward()
            (torch.nan_to_num(yr) * target).sum().backward()
        else:  # a NaN loss, finite gradients
            (out.local * target[out.dist.local_slices()]).sum().backward()
            (yr * target).sum().backward()
        if not torch.equal(torch.isnan(whole), torch.isnan(yr)) or rel(
                torch.nan_to_num(whole), torch.nan_to_num(yr)) > 1e-12:
            bad.append((grid, "output"))
        want = xr.grad[pm.input_dist.local_slices()]
        if not torch.allclose(torch.nan_to_num(xl.grad), torch.nan_to_num(want), rtol=1e-12,
                              atol=1e-12):
            bad.append((grid, "input gradient"))
    return bad


@pytest.mark.parallel(SIZES)
def test_extremes_of_tied_values_give_one_process_gradients():
    x = torch.tensor(np.random.default_rng(5).integers(0, 3, (2, 2, 9, 7)),
                     dtype=torch.float64)
    x[1, 1] = float("nan")  # NaN wins its maxima and minima, as in one process
    bad = _extremes_against_one_process(Ties, x, 6, finite_loss=True)
    collective_assert(not bad, str(bad))


class NanPools(nn.Module):
    """Global max pooling (2-D module, 3-D function on a batch-less volume) over planes
    with several NaNs: its value NaN and its gradient given to the last NaN, as PyTorch's
    pooling kernels give it."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        return self.pool(x) * 3 + x + F.adaptive_max_pool3d(x, 1) * 0.5


@pytest.mark.parallel(SIZES)
def test_global_max_pooling_gives_the_last_nan_the_gradient():
    x = torch.tensor(np.random.default_rng(6).integers(0, 3, (2, 2, 9, 7)),
                     dtype=torch.float64)
    for where in ((0, 0, 1, 2), (0, 0, 7, 5), (0, 0, 4, 0), (1, 1, 0, 0), (1, 1, 8, 6)):
        x[where] = float("nan")  # NaNs in different blocks of every grid's split
    bad = _extremes_against_one_process(NanPools, x, 7, finite_loss=False)
    collective_assert(not bad, str(bad))


class MadeWeightNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6, 5))

    def forward(self, x):  # a weight computed in forward, not the parameter itself
        return F.layer_norm(x, (6, 5), self.scale * 2)


class AntialiasedDownsample(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=0.6, mode="bilinear", antialias=True)


class AntialiasedBicubic(nn.Module):
    def forward(self, x):  # renormalised at the edges: not split, even by an integer
        return F.interpolate(x, scale_factor=2, mode="bicubic", antialias=True)


class ScaleInForward(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=x.shape[2] / 4, mode="bilinear")


class CornersAntialiased(nn.Module):
    """Interpolation with align_corners=True and antialias=True where no rank splits
    space (samples split): PyTorch's own call on each block."""

    def forward(self, x):
        y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True,
                          antialias=True)
        return y + F.interpolate(x, scale_factor=x.shape[2] / 2, mode="bilinear")


class Fractions(nn.Module):
    """Interpolation by scales that are not integers on split dimensions: up and down,
    every mode, corners aligned or not, to a size and by scales (PyTorch then maps rows
    by the scale given, not by the sizes' ratio), and ``nn.Upsample``'s form."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.up = nn.Upsample(scale_factor=(1.5, 1.3), mode="bilinear")
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        y = torch.tanh(self.conv(x))
        a = F.interpolate(self.conv2(self.up(y)), size=y.shape[2:], mode="bicubic")
        c = F.interpolate(y, scale_factor=0.6, mode="nearest")
        d = F.interpolate(c, size=y.shape[2:], mode="nearest-exact")
        e = F.interpolate(y, scale_factor=(1.7, 0.8), mode="bilinear", align_corners=True)
        f = F.interpolate(e, size=y.shape[2:], mode="bicubic", align_corners=True)
        g = F.interpolate(y, scale_factor=(0.7, 1.45), mode="nearest")
        h = F.interpolate(y, scale_factor=(2, 1.45), mode="bilinear")
        # 2-D nearest: PyTorch copies a kept length and halves a doubled one, whatever
        # the scale given (1.05 on 11 rows keeps 11, 2.05 on 9 columns gives 18)
        k = F.interpolate(y, scale_factor=(1.05, 2.05), mode="nearest")
        return a + d + f + F.interpolate(g, size=y.shape[2:], mode="bilinear") + \
            F.interpolate(h, size=y.shape[2:], mode="nearest") + \
            F.interpolate(k, size=y.shape[2:], mode="nearest-exact")


class Fractions1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(torch.tanh(self.conv(x)), scale_factor=1.6, mode="linear")
        return F.interpolate(y, size=x.shape[-1] - 2, mode="nearest-exact")


class Fractions3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), scale_factor=(1.4, 1, 2.5), mode="trilinear")
        return F.interpolate(torch.tanh(y), size=(4, 5, 7), mode="trilinear",
                             align_corners=True)


class Areas(nn.Module):
    """Adaptive average pooling and interpolation mode 'area' to sizes that do not divide
    the input's, down and up, on split dimensions: windows of uneven lengths that
    overlap, a halo after each block, output blocks that may be empty."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((5, 4))
        self.conv2 = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.conv(x)
        a = F.interpolate(torch.tanh(self.conv2(self.pool(y))), size=(13, 7), mode="area")
        b = F.adaptive_avg_pool2d(F.interpolate(y, size=(13, 9), mode="area"), (None, 7))
        return a + F.interpolate(y, size=(13, 7), mode="area") * b


class Areas1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        return F.adaptive_avg_pool1d(torch.tanh(self.conv(x)), 4)


class Areas3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d((3, 4, 3))

    def forward(self, x):
        return self.pool(torch.tanh(self.conv(x)))


class Corners1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), scale_factor=3, mode="linear", align_corners=True)
        return F.interpolate(torch.tanh(y), size=y.shape[-1] * 2, mode="linear",
                             align_corners=True)


class Corners3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.up = nn.Upsample(scale_factor=(2, 1, 3), mode="trilinear", align_corners=True)

    def forward(self, x):
        return self.up(self.conv(x))


# ------------------------------------------------------------------ helpers
def grids(ndim):
    """Grid shapes over (N, C, *spatial): N and each spatial dimension alone, and at 4 ranks
    two of them at once."""
    p = comm.Get_size()
    one = [1] * ndim
    out = []
    for d in [0, *range(2, ndim)]:
        g = list(one)
        g[d] = p
        if tuple(g) not in out:
            out.append(tuple(g))
    if p == 4:
        out.append(tuple([2, 1, 2] + [1] * (ndim - 3)))
        if ndim > 3:
            out.append(tuple([1, 1, 2] + [1] * (ndim - 4) + [2]))
    return out


def global_tensor(shape, seed, dtype):
    return torch.tensor(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


def rel(a, b, floor=1e-30):
    """Largest difference relative to the largest reference value (at least ``floor``: a
    gradient that is zero but for rounding, a bias before a batch norm, has no scale of its
    own)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=floor)) if b.numel() else 0.0


def tolerance(dtype):
    return 1e-10 if dtype == torch.float64 else 1e-5


def run_both(model, shape, grid, dtype=torch.float64, seed=1, against_float64=False,
             floor=1e-30, **options):
    """Forward and backward of the parallel model and of the copy; what differs, as text.

    With ``against_float64``, each float32 result is held to the float64 model's instead:
    its error may be the larger of the tolerance and 4x the copy's own float32 error (a
    gradient summed with cancellation, e.g. a batch norm's weight, loses digits in one
    process as well)."""
    ref = copy.deepcopy(model)
    truth = copy.deepcopy(model).double() if against_float64 else None
    pm = parallelize(model, shape, grid, **options)
    x = global_tensor(shape, seed, dtype)
    xl = dt.DistArray.from_global(x, pm.input_dist, xp=torch).local.clone().requires_grad_()
    torch.manual_seed(7)
    out = pm(xl)
    whole = gather(out.local, out.dist)
    target = global_tensor(whole.shape, seed + 1, dtype)
    (whole * target).sum().backward()
    xr = x.clone().requires_grad_()
    torch.manual_seed(7)
    yr = ref(xr)
    (yr * target).sum().backward()
    tol = tolerance(dtype)
    bad = []
    if truth is not None:
        xt = x.double().requires_grad_()
        torch.manual_seed(7)
        yt = truth(xt)
        (yt * target.double()).sum().backward()
        pairs = [("output", out.to_global(), yr, yt),
                 ("input gradient", xl.grad, xr.grad[pm.input_dist.local_slices()],
                  xt.grad[pm.input_dist.local_slices()])]
        pairs += [(f"grad {name}", a.grad, b.grad, t.grad) for (name, a), b, t in
                  zip(pm.named_parameters(), ref.parameters(), truth.parameters())]
        for what, a, b, t in pairs:
            ours, theirs = rel(a.double(), t), rel(b.double(), t)
            if ours > max(tol, 4 * theirs):
                bad.append(f"{what}: {ours} against float64, one process {theirs}")
        return pm, ref, bad
    err = rel(out.to_global(), yr, floor)  # collective: gathered once on every rank
    if err > tol:
        bad.append(f"output {err}")
    if rel(xl.grad, xr.grad[pm.input_dist.local_slices()], floor) > tol:
        bad.append("input gradient")
    for (name, a), b in zip(pm.named_parameters(), ref.parameters()):
        if rel(a.grad, b.grad, floor) > tol:
            bad.append(f"grad {name}: {rel(a.grad, b.grad, floor)}")
    for (name, a), b in zip(pm.state_dict().items(), ref.state_dict().values()):
        if a.dtype.is_floating_point and rel(a, b, floor) > tol:
            bad.append(f"state {name}")
    return pm, ref, bad


MODELS = {
    "resnet": (ResNet, (3, 3, 20, 18)),
    "resnet50": (ResNet50, (3, 3, 23, 18)),
    "unet2d": (UNet2d, (2, 2, 12, 8)),
    "unet3d": (UNet3d, (2, 2, 8, 6, 6)),
    "mesh-fcn": (MeshFCN, (3, 2, 14)),
    "heads": (Heads, (3, 2, 8, 9)),
    "pools": (Pools, (2, 2, 11, 9)),
    "shuffles": (Shuffles, (2, 2, 10, 6)),
    "norms": (Norms, (3, 2, 7, 9)),
    "dropouts": (Dropouts, (3, 3, 9, 7)),
    "dropouts1d": (Dropouts1d, (3, 2, 13)),
    "dropouts3d": (Dropouts3d, (2, 2, 5, 6, 4)),
    "corners": (Corners, (2, 2, 7, 5)),
    "corners1d": (Corners1d, (2, 2, 9)),
    "corners3d": (Corners3d, (1, 2, 5, 3, 4)),
    "fractions": (Fractions, (2, 2, 11, 9)),
    "fractions1d": (Fractions1d, (2, 2, 13)),
    "fractions3d": (Fractions3d, (1, 2, 5, 3, 4)),
    "layernorms": (LayerNorms, (3, 2, 7, 5)),
    "gates": (Gates, (3, 2, 9, 7)),
    "extremes": (Extremes, (3, 2, 9, 7)),
    "transposes3d": (Transposes3d, (2, 2, 5, 6, 4)),
    "lineage": (Lineage, (3, 2, 9, 7)),
    "functional-pools": (FunctionalPools, (2, 2, 11, 9)),
    "pools1d": (Pools1d, (2, 2, 13)),
    "pools3d": (Pools3d, (2, 2, 5, 7, 4)),
    "segnet": (SegNet, (2, 2, 13, 11)),
    "segnet-moved": (SegNetMoved, (2, 2, 12, 12)),
    "segnet1d": (SegNet1d, (2, 2, 15)),
    "segnet3d": (SegNet3d, (2, 2, 6, 8, 4)),
    "areas": (Areas, (2, 2, 11, 9)),
    "areas1d": (Areas1d, (2, 2, 13)),
    "areas3d": (Areas3d, (2, 2, 5, 6, 4)),
}


# ------------------------------------------------------------------ tests
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_gradients_equal_one_process_float64(name):
    cls, shape = MODELS[name]
    for grid in grids(len(shape)):
        torch.manual_seed(0)
        model = cls().double()
        _, _, bad = run_both(model, shape, grid)
        collective_assert(not bad, f"{name} on {grid}: {bad}")


@st.composite
def stacks(draw):
    """A random stack of 2-D convolutions (any padding mode), transposed convolutions,
    max and average pooling (ceil mode, padding counted or not) and batch norms, as
    ``(module class, args, kwargs)`` (built after seeding), and an input shape."""
    c = draw(st.integers(1, 3))
    shape = (2, c, draw(st.integers(5, 19)), draw(st.integers(5, 19)))
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["conv", "conv", "convT", "max", "avg", "bn"]))
        k, s, d = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
        if kind in ("conv", "convT"):
            out = draw(st.integers(1, 3))
            if kind == "conv":
                mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "circular",
                                             "replicate"]))
                layers.append((nn.Conv2d, (c, out, k, s, draw(st.integers(0, k // 2)), d),
                               {"padding_mode": mode}))
            else:
                layers.append((nn.ConvTranspose2d, (c, out, k, s, draw(st.integers(0, 1))),
                               {"dilation": d}))
            c = out
        elif kind == "max":
            layers.append((nn.MaxPool2d, (k, s, draw(st.integers(0, k // 2)), d),
                           {"ceil_mode": draw(st.booleans())}))
        elif kind == "avg":
            layers.append((nn.AvgPool2d, (k, s, draw(st.integers(0, k // 2))),
                           {"ceil_mode": draw(st.booleans()),
                            "count_include_pad": draw(st.booleans())}))
        else:
            layers.append((nn.BatchNorm2d, (c,), {}))
    return layers, shape, draw(st.integers(0, 2**16))


@pytest.mark.parallel(SIZES)
@settings(max_examples=25, deadline=None)
@given(case=stacks())
def test_random_stacks_equal_one_process(case):
    """Random stacks on every grid of ``grids``, float64, against one process. Values are
    relative to the reference's largest, at least 1: a bias before a batch norm has a
    gradient that is zero but for rounding."""
    layers, shape, seed = case
    torch.manual_seed(seed)
    model = nn.Sequential(*(cls(*args, **kw) for cls, args, kw in layers)).double()
    try:
        with torch.no_grad():
            empty = 0 in model(torch.zeros(shape, dtype=torch.float64)).shape
    except RuntimeError:  # the model itself refuses the shape (a window past the input)
        empty = True
    if empty:
        return
    bad = []
    for grid in grids(4):
        _, _, found = run_both(copy.deepcopy(model), shape, grid, floor=1.0)
        bad += [(grid, found)] if found else []
    collective_assert(not bad, f"{model} on {shape}: {bad}")


class ScaledKeepingSize(nn.Module):
    """A scale whose output length rounds to the input's along W (2 * 1.3 -> 2): the rows
    move, but the sizes stay."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x):
        return F.interpolate(x, scale_factor=1.3, mode=self.mode)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_interpolation_that_keeps_a_size_has_the_adjoint_for_gradient(mode):
    """H split, W kept at its length but resampled: the input gradient is the adjoint of
    the forward map (its Jacobian built column by column), where PyTorch's own backward
    of a call that keeps every size copies the gradient as if nothing moved."""
    m = ScaledKeepingSize(mode)
    for shape in [(1, 1, 4, 2), (1, 2, 7, 2)]:
        pm = parallelize(m, shape, (1, 1, comm.Get_size(), 1))
        x = global_tensor(shape, 3, torch.float64)
        xl = dt.DistArray.from_global(x, pm.input_dist, xp=torch).local.clone() \
            .requires_grad_()
        out = pm(xl)
        whole = gather(out.local, out.dist)
        target = global_tensor(tuple(whole.shape), 4, torch.float64)
        (whole * target).sum().backward()
        grad = dt.DistArray(xl.grad.detach(), pm.input_dist).to_global()
        n = x.numel()
        jacobian = torch.stack([m(torch.eye(n, dtype=torch.float64)[i].view(shape)).flatten()
                                for i in range(n)], 1)
        adjoint = (jacobian.T @ target.flatten()).view(shape)
        collective_assert(rel(whole.detach(), m(x)) < 1e-12 and rel(grad, adjoint) < 1e-12,
                          f"{mode} {shape}: output {rel(whole.detach(), m(x))}, input "
                          f"gradient {rel(grad, adjoint)} from the adjoint")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["unet2d", "resnet", "unet3d"])
def test_channels_last_blocks_equal_one_process(name):
    """Input blocks put in channels-last layout (kept so through the halo exchanges, which
    PyTorch's CPU convolutions run faster on): outputs and gradients those of one process
    on (N, C, ...) tensors, in float64 and float32."""
    cls, shape = MODELS[name]
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    bad = []
    for dtype in (torch.float64, torch.float32):
        for grid in grids(len(shape))[:3]:
            torch.manual_seed(0)
            _, _, found = run_both(cls().to(dtype), shape, grid, dtype=dtype,
                                   memory_format=layout)
            bad += [(dtype, grid, found)] if found else []
    collective_assert(not bad, f"{bad}")


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("value, shape", [("channels_last", (2, 3, 4, 4)), (
    torch.channels_last, (2, 3, 4)), (torch.channels_last_3d, (2, 3, 4, 4))])
def test_a_memory_format_that_does_not_suit_is_refused(value, shape):
    model = nn.Sequential(nn.Conv1d(3, 3, 3, padding=1)) if len(shape) == 3 else \
        nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
    exc = outcome(lambda: parallelize(model, shape, (comm.Get_size(),) + (1,) * (len(shape) - 1),
                                      memory_format=value))
    collective_assert(isinstance(exc, ValueError) and "memory_format" in str(exc), repr(exc))


class PointWise(nn.Module):
    """Comparisons, logic and point-wise functions (in place too) between convolutions."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = torch.sigmoid_(self.a(x) * 2) - torch.relu_(self.a(x) - 0.2)
        y = torch.where(y > 0, y, 0.1 * y) + (y >= 0.5).to(y.dtype) * torch.erf(y)
        y = y + torch.logical_and(y < 1, ~(y == 0)).to(y.dtype) + y % 0.7
        return self.b(torch.nan_to_num(torch.hypot(y, y.abs() + 1) - torch.fmax(y, -y)))


@pytest.mark.parallel(SIZES)
def test_comparisons_and_point_wise_functions_run_on_blocks():
    """Point-wise functions beyond the arithmetic (comparisons, logic, where) run on each
    block, split anywhere, as one process runs them on the whole."""
    bad = []
    for grid in grids(4):
        torch.manual_seed(0)
        _, _, found = run_both(PointWise().double(), (2, 2, 9, 7), grid, floor=1.0)
        bad += [(grid, found)] if found else []
    collective_assert(not bad, f"{bad}")


class PerSample(nn.Module):
    """Instance norms and adaptive max pooling (with its indices) before a linear head."""

    def __init__(self, nd=2):
        super().__init__()
        conv, norm = (nn.Conv2d, nn.InstanceNorm2d) if nd == 2 else (nn.Conv3d, nn.InstanceNorm3d)
        pool = nn.AdaptiveMaxPool2d((3, 2), return_indices=True) if nd == 2 else \
            nn.AdaptiveMaxPool3d((2, 1, 2), return_indices=True)
        self.conv, self.norm, self.plain, self.pool = conv(2, 3, 3, padding=1), \
            norm(3, affine=True), norm(3), pool
        self.head = nn.Linear(18 if nd == 2 else 12, 2)

    def forward(self, x):
        y, idx = self.pool(torch.relu(self.plain(self.norm(self.conv(x)))))
        return self.head(torch.flatten(y + 1e-3 * idx.to(y.dtype), 1))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("nd", [2, 3])
def test_per_sample_modules_run_on_blocks_of_whole_space(nd):
    """Instance norms and adaptive max pooling work on each sample's whole space: split
    over the samples they run on each block as one process does; a split of space is
    refused alike, naming the node, and so is a split of the samples under running
    statistics (they average the batch). A rank without samples (a batch of 2 over 3 or 4
    ranks) holds their empty blocks (PyTorch's instance norm refuses an empty batch)."""
    p = comm.Get_size()
    shape = (4, 2, 7, 5) if nd == 2 else (4, 2, 4, 3, 5)
    for n in (4, 2):
        torch.manual_seed(0)
        _, _, found = run_both(PerSample(nd).double(), (n, *shape[1:]), (p,) + (1,) * (nd + 1),
                               floor=1.0)
        collective_assert(not found, f"batch {n}: {found}")
    if p > 1:
        exc = outcome(lambda: parallelize(PerSample(nd), shape, (1, 1, p) + (1,) * (nd - 1)))
        collective_assert(isinstance(exc, ValueError) and "'norm'" in str(exc)
                          and "dimension 2" in str(exc), repr(exc))
        tracked = nn.Sequential(nn.InstanceNorm2d(2, track_running_stats=True))
        exc = outcome(lambda: parallelize(tracked, (4, 2, 3, 3), (p, 1, 1, 1)))
        collective_assert(isinstance(exc, ValueError) and "dimension 0" in str(exc),
                          repr(exc))


WIDE_REACH = [
    # padding wider than the kernel reaches: outputs beyond the input's ends, which a rank
    # whose input block is empty still holds (the bias, the padding, its neighbours' halo)
    (lambda: nn.Conv1d(2, 3, 1, padding=1), (1, 2, 1)),
    (lambda: nn.Conv1d(2, 3, 3, padding=2), (1, 2, 2)),
    (lambda: nn.Conv1d(2, 3, 1, padding=1, padding_mode="replicate"), (2, 2, 2)),
    (lambda: nn.Conv2d(1, 2, (1, 3), padding=(2, 1), padding_mode="circular"), (1, 1, 2, 3)),
    (lambda: nn.Conv1d(2, 2, 2, padding=2, dilation=2, bias=False), (1, 2, 1)),
    # transposed: a block whose outputs all fall in the cropped padding, or none reached
    (lambda: nn.ConvTranspose1d(1, 2, 1, stride=3, padding=2, output_padding=1), (1, 1, 2)),
    (lambda: nn.ConvTranspose1d(1, 1, 1, stride=3, padding=2, output_padding=0), (1, 1, 3)),
    (lambda: nn.ConvTranspose1d(2, 1, 3, stride=2, padding=1), (1, 2, 1)),
    (lambda: nn.ConvTranspose2d(1, 2, (1, 2), stride=(1, 3), padding=(0, 2)), (1, 1, 2, 2)),
]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("case", range(len(WIDE_REACH)))
def test_blocks_without_input_that_hold_outputs(case):
    """A split dimension shorter than the ranks leaves some input blocks empty; their
    output blocks need not be: they hold what one process computes there."""
    build, shape = WIDE_REACH[case]
    torch.manual_seed(case)
    model = nn.Sequential(build()).double()
    bad = []
    for grid in grids(len(shape)):
        _, _, found = run_both(copy.deepcopy(model), shape, grid, floor=1.0)
        bad += [(grid, found)] if found else []
    collective_assert(not bad, f"{model} on {shape}: {bad}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["resnet", "resnet50"])
def test_float32_resnet(name):
    """ResNet-18's layout within 1e-5 of one float32 process; ResNet-50's, whose narrow
    batch norms lose digits in their weights' gradients in one process too (2.7e-4 from
    float64), held to the float64 model as closely as one float32 process is."""
    cls, shape = MODELS[name]
    for grid in grids(4)[:2]:
        torch.manual_seed(0)
        _, _, bad = run_both(cls(), shape, grid, dtype=torch.float32,
                             against_float64=name == "resnet50")
        collective_assert(not bad, f"{grid}: {bad}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["unet2d", "unet3d", "mesh-fcn"])
def test_float32_unets_and_mesh_fcn(name):
    """The U-Nets and the mesh FCN in float32 on (N, C, *S) blocks, within 1e-5 of one
    float32 process on the grids over the samples and the first spatial dimension."""
    cls, shape = MODELS[name]
    for grid in grids(len(shape))[:2]:
        torch.manual_seed(0)
        _, _, bad = run_both(cls(), shape, grid, dtype=torch.float32)
        collective_assert(not bad, f"{grid}: {bad}")


@pytest.mark.parallel([1, 2, 3])
def test_interpolation_where_no_rank_splits_space_is_pytorchs_own_call():
    """align_corners with antialias, and a scale computed in forward: refused on split
    space, run as the model's own call where only the samples are split."""
    _, _, bad = run_both(CornersAntialiased(), (4, 2, 4, 5), (comm.Get_size(), 1, 1, 1))
    collective_assert(not bad, f"{bad}")


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("name", ["fractions", "fractions1d", "fractions3d"])
def test_float32_interpolation_by_any_scale(name):
    """In float32 the nearest modes' rows are found in float32 arithmetic (one of them
    may differ from float64's): the split model within 1e-5 of one float32 process."""
    cls, shape = MODELS[name]
    for grid in grids(len(shape)):
        torch.manual_seed(0)
        _, _, bad = run_both(cls(), shape, grid, dtype=torch.float32)
        collective_assert(not bad, f"{grid}: {bad}")


def autocast_run(model, shape, grid, seed=1):
    """Forward and backward in bf16 under ``torch.autocast`` (float32 weights), parallel and
    one process; the parallel output, input gradient and parameter gradients next to the
    reference's, and the reference's own float32 result for the scale of bf16 rounding."""
    wide = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    pm = parallelize(model, shape, grid)
    x = global_tensor(shape, seed, torch.float32)
    xl = dt.DistArray.from_global(x, pm.input_dist, xp=torch).local.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pm(xl)
        whole = gather(out.local, out.dist)
    target = global_tensor(whole.shape, seed + 1, torch.float32)
    (whole.float() * target).sum().backward()
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ref(xr)
    (yr.float() * target).sum().backward()
    xw = x.clone().requires_grad_()
    yw = wide(xw)
    (yw * target).sum().backward()
    return pm, ref, wide, (out, xl, whole), (yr, xr), (yw, xw)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["resnet", "unet2d", "layernorms", "fractions"])
def test_bf16_autocast_matches_one_process_within_bf16_rounding(name):
    """Activations, halos and redistributed blocks in bf16 (the block tensors' dtype), batch-norm
    statistics in float32: the parallel model differs from the one-process autocast run by no
    more than a few bf16 roundings, and the one-process run from float32 by as much."""
    cls, shape = MODELS[name]
    for grid in grids(len(shape))[:3]:
        torch.manual_seed(0)
        pm, ref, wide, (out, xl, whole), (yr, xr), (yw, xw) = autocast_run(cls(), shape, grid)
        bad = []
        if out.local.dtype != torch.bfloat16 or whole.dtype != yr.dtype:
            bad.append(f"dtypes {out.local.dtype} {whole.dtype} against {yr.dtype}")
        # bf16 keeps 8 significant bits: 2**-8 = 0.0039 per rounding
        scale = max(rel(yr.float(), yw), 2.0 ** -8)
        pairs = [("output", whole.float(), yr.float()),
                 ("input gradient", xl.grad, xr.grad[pm.input_dist.local_slices()])]
        pairs += [(f"grad {n}", a.grad, b.grad)
                  for (n, a), b in zip(pm.named_parameters(), ref.parameters())]
        for what, a, b in pairs:
            if rel(a, b) > 3 * scale + 2e-2:
                bad.append(f"{what}: {rel(a, b)} (bf16 against float32: {scale})")
        for (n, a), b in zip(pm.state_dict().items(), ref.state_dict().values()):
            if a.dtype != b.dtype:
                bad.append(f"state {n} is {a.dtype}, not {b.dtype}")
        collective_assert(not bad, f"{name} on {grid}: {bad[:4]}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_steps_keep_the_weights_equal(opt):
    p = comm.Get_size()
    for name, grid in (("unet2d", (1, 1, p, 1)), ("resnet", (p, 1, 1, 1)),
                       ("resnet50", (1, 1, p, 1)), ("unet3d", (1, 1, 1, 1, p)),
                       ("mesh-fcn", (1, 1, p)), ("gates", (1, 1, 1, p))):
        cls, shape = MODELS[name]
        torch.manual_seed(0)
        model = cls().double()
        ref = copy.deepcopy(model)
        pm = parallelize(model, shape, grid)

        def make(params):
            if opt == "sgd":
                return torch.optim.SGD(params, lr=0.05, momentum=0.9)
            return torch.optim.Adam(params, lr=0.01)

        o_par, o_ref = make(pm.parameters()), make(ref.parameters())
        bad = []
        for step in range(3):
            x = global_tensor(shape, 10 + step, torch.float64)
            o_par.zero_grad()
            o_ref.zero_grad()
            torch.manual_seed(30 + step)  # the same dropout masks (unet3d) in both
            out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
            whole = gather(out.local, out.dist)
            target = global_tensor(whole.shape, 20 + step, torch.float64)
            ((whole - target) ** 2).mean().backward()
            torch.manual_seed(30 + step)
            ((ref(x) - target) ** 2).mean().backward()
            o_par.step()
            o_ref.step()
            for (pname, a), b in zip(pm.named_parameters(), ref.parameters()):
                if rel(a, b) > 1e-10:
                    bad.append(f"{name} step {step} {pname}: {rel(a, b)}")
        collective_assert(not bad, str(bad[:5]))


def _group_oracle(model, x, target, blocks):
    """One process per sample group (a copy of ``model`` on the group's samples): the
    outputs, the parameters' gradients of the whole mean squared error summed over the
    groups, and the groups' running statistics averaged (the groups of no sample left
    out)."""
    copies = [(lo, hi, copy.deepcopy(model)) for lo, hi in blocks if hi > lo]
    outs = []
    for lo, hi, m in copies:
        y = m(x[lo:hi])
        ((y - target[lo:hi]) ** 2).sum().div(target.numel()).backward()
        outs.append(y.detach())
    grads = [sum(p.grad for p in ps) for ps in zip(*(m.parameters() for _, _, m in copies))]
    states = [m.state_dict() for _, _, m in copies]
    running = {k: sum(s[k] for s in states) / len(states) if k.endswith(("mean", "var"))
               else states[0][k] for k in states[0] if "running" in k or "batches" in k}
    return torch.cat(outs), grads, running, copies


@pytest.mark.parallel(SIZES)
def test_group_batch_norm_statistics_are_each_sample_groups_own():
    """``batch_norm_stats='group'``: each group of ranks holding the same samples normalizes
    over them alone, as one process on the group's samples (PyTorch's batch norms under
    DDP); the gradients are the groups' summed, the running statistics the groups'
    averaged, on every rank, also after a forward pass with no backward (uneven and empty
    sample blocks; the samples and the height split at once)."""
    p = comm.Get_size()
    cases = [((5, 3, 20, 18), (p, 1, 1, 1))]
    if p >= 3:
        cases.append(((p - 1, 3, 20, 18), (p, 1, 1, 1)))  # a rank with no sample
    if p == 4:
        cases.append(((5, 3, 20, 18), (2, 1, 2, 1)))
    bad = []
    for shape, grid in cases:
        torch.manual_seed(0)
        model = ResNet().double()
        ref = copy.deepcopy(model)
        pm = parallelize(model, shape, grid, batch_norm_stats="group")
        cuts = pm.input_dist.boundaries[0]
        blocks = list(zip(cuts, cuts[1:]))
        x = global_tensor(shape, 1, torch.float64)
        out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
        whole = gather(out.local, out.dist)
        target = global_tensor(whole.shape, 2, torch.float64)
        ((whole - target) ** 2).mean().backward()
        y, grads, running, copies = _group_oracle(ref, x, target, blocks)
        what = f"{shape} on {grid}"
        if rel(whole, y) > 1e-10:
            bad.append(f"{what}: output {rel(whole, y)}")
        for (name, a), b in zip(pm.named_parameters(), grads):
            if rel(a.grad, b) > 1e-10:
                bad.append(f"{what}: grad {name} {rel(a.grad, b)}")
        # moved by the end of the backward pass: the buffers themselves, no state_dict
        state = dict(pm.named_buffers())
        for k, v in running.items():
            if rel(state[k].double(), v.double()) > 1e-10:
                bad.append(f"{what}: {k} {rel(state[k].double(), v.double())}")
        # a forward pass alone moves them too, completed when the model's state is saved
        x2 = global_tensor(shape, 3, torch.float64)
        with torch.no_grad():
            pm(dt.DistArray.from_global(x2, pm.input_dist, xp=torch))
            for lo, hi, m in copies:
                m(x2[lo:hi])
        state = model.state_dict()  # the unwrapped model's: the modules' hooks complete it
        states = [m.state_dict() for _, _, m in copies]
        for k in running:
            if k.endswith(("mean", "var")):
                want = sum(st[k] for st in states) / len(states)
                if rel(state[k], want) > 1e-10:
                    bad.append(f"{what}: {k} after a forward pass {rel(state[k], want)}")
    collective_assert(not bad, str(bad[:5]))


@pytest.mark.parallel([1, 3])
def test_group_batch_norm_statistics_refuse_a_group_of_one_value_alike():
    p = comm.Get_size()
    pm = parallelize(nn.Sequential(nn.BatchNorm2d(2)).double(), (2 * p - 1, 2, 1, 1),
                     (p, 1, 1, 1), batch_norm_stats="group")
    x = dt.DistArray.from_global(global_tensor((2 * p - 1, 2, 1, 1), 0, torch.float64),
                                 pm.input_dist, xp=torch)
    exc = outcome(lambda: pm(x))  # on one rank, PyTorch's own refusal
    collective_assert(isinstance(exc, ValueError)
                      and "than 1 value per channel" in str(exc).lower(), repr(exc))
    exc = outcome(lambda: parallelize(nn.BatchNorm2d(2), (2, 2, 4, 4), (1, 1, p, 1),
                                      batch_norm_stats="local"))
    collective_assert(isinstance(exc, ValueError) and "batch_norm_stats" in str(exc),
                      repr(exc))


@pytest.mark.parallel([1, 2])
def test_state_dict_round_trip():
    p = comm.Get_size()
    cls, shape = MODELS["unet2d"]
    torch.manual_seed(0)
    model = cls().double()
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    pm = parallelize(model, shape, (1, 1, p, 1))
    ok = {k: tuple(v.shape) for k, v in pm.state_dict().items()} == keys
    # train the parallel model a step (batch statistics move), save, load into one process
    x = global_tensor(shape, 3, torch.float64)
    pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
    single = cls().double()
    single.load_state_dict(pm.state_dict())
    pm.eval()
    single.eval()
    # each collective call on every rank, whatever a check before found on this one
    saved = rel(pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch)).to_global(), single(x))
    ok = ok and saved < 1e-10
    # and back: another single-process state into the parallel model
    torch.manual_seed(5)
    other = cls().double()
    pm.load_state_dict(other.state_dict())
    other.eval()
    loaded = rel(pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch)).to_global(), other(x))
    ok = ok and loaded < 1e-10
    collective_assert(ok and isinstance(pm, ParallelModule), "state dict round trip")
    collective_assert(all(isinstance(q, nn.Parameter) for q in pm.parameters()), "parameters")


@pytest.mark.parallel([1, 2, 3])
def test_every_rank_trains_rank_0s_weights_and_buffers():
    """Weights drawn differently on each rank, and running statistics that differ, are made
    rank 0's by parallelize (as DistributedDataParallel broadcasts them): the parallel
    model's state, output and gradients then equal rank 0's model in one process."""
    cls, shape = MODELS["resnet"]
    torch.manual_seed(100)
    ref = cls().double()  # rank 0's model, made alike on every rank
    torch.manual_seed(100 + comm.Get_rank())
    model = cls().double()
    with torch.no_grad():
        for m in (model, ref):
            m.bn1.running_var.fill_(2.0)  # a buffer: its own value on each rank but rank 0
        model.bn1.running_mean.fill_(float(comm.Get_rank()))
    pm = parallelize(model, shape, (1, 1, comm.Get_size(), 1))
    bad = [k for (k, a), b in zip(pm.state_dict().items(), ref.state_dict().values())
           if not torch.equal(a, b)]
    x = global_tensor(shape, 1, torch.float64)
    xl = dt.DistArray.from_global(x, pm.input_dist, xp=torch).local.clone().requires_grad_()
    out = pm(xl)
    whole = gather(out.local, out.dist)
    target = global_tensor(whole.shape, 2, torch.float64)
    (whole * target).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * target).sum().backward()
    if rel(out.to_global(), yr) > 1e-10:
        bad.append("output")
    bad += [f"grad {k}" for (k, a), b in zip(pm.named_parameters(), ref.parameters())
            if rel(a.grad, b.grad) > 1e-10]
    pm.eval()
    ref.eval()  # the running statistics, moved alike by the step
    if rel(pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch)).to_global(),
           ref(x)) > 1e-10:
        bad.append("output in eval mode")
    collective_assert(not bad, f"differs from rank 0's model: {bad}")


@pytest.mark.parallel([1, 2, 3])
def test_rank_0s_state_reaches_every_dtype_and_layout():
    """The broadcast carries any tensor: bfloat16, a non-contiguous buffer, a 0-d count, a
    boolean mask."""
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        m = nn.Module()
        m.w = nn.Parameter(torch.randn(3, 4, generator=g).to(torch.bfloat16))
        m.register_buffer("t", torch.randn(4, 5, generator=g).t())  # non-contiguous
        m.register_buffer("n", torch.tensor(seed, dtype=torch.int64))
        m.register_buffer("mask", torch.rand(6, generator=g) > 0.5)
        return m

    mine, ref = state(10 + comm.Get_rank()), state(10)
    _broadcast_state(mine, comm)
    same = all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(),
                                                 ref.state_dict().values()))
    collective_assert(same and not mine.t.is_contiguous(), "state differs from rank 0's")


@pytest.mark.parallel([2, 3])
def test_models_that_differ_in_shape_between_ranks_are_refused_alike():
    """A buffer of another shape (or dtype) on one rank: ValueError on every rank before
    any tensor is changed."""
    rank = comm.Get_rank()
    bad = []
    for extra in (torch.zeros(1 + (rank == 1)),
                  torch.zeros(2, dtype=torch.float64 if rank else torch.float32)):
        torch.manual_seed(3 + rank)  # weights that differ too: none may be overwritten
        model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1))
        model.register_buffer("extra", extra)
        before = [t.clone() for t in model.parameters()]
        _, err = collective_outcome(parallelize, model, (2, 2, 6, 6),
                                    (1, 1, comm.Get_size(), 1))
        if not (isinstance(err, ValueError) and "differ in the shapes or dtypes" in str(err)):
            bad.append(f"{extra.shape} {extra.dtype}: {err!r}")
        if not all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            bad.append("a weight changed")
    collective_assert(not bad, f"{bad}")


class WideHead(nn.Module):
    """A convolution, then a linear head whose weight's gradient (2.5 MB) fills a bucket
    alone, early in backward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4, 80_000)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1))


@pytest.mark.parallel([2, 3])
def test_buckets_fuse_the_gradient_sums_and_overlap_backward(monkeypatch):
    """The gradients' sums go through the buckets: fused (ResNet's 40-odd parameters in one
    allreduce), and started while backward goes on (the linear head's, reduced alone, before
    the first convolution's gradient is made); the sums those of one process."""
    from disttensor_nn import reduction

    events = []
    started = reduction.iallreduce

    def counted(a, group, *args, **kwargs):
        events.append(("allreduce", int(np.prod(a.shape))))
        return started(a, group, *args, **kwargs)

    monkeypatch.setattr(reduction, "iallreduce", counted)
    p = comm.Get_size()
    cls, shape = MODELS["resnet"]
    torch.manual_seed(0)
    pm, _, bad = run_both(cls().double(), shape, (p, 1, 1, 1))
    collective_assert(not bad, str(bad))
    n = sum(1 for _ in pm.parameters())
    collective_assert(len(events) == 1 and events[0][1] == sum(
        q.numel() for q in pm.parameters()), f"{n} parameters: {events}")
    events.clear()
    torch.manual_seed(0)
    model = WideHead().double()
    ref = copy.deepcopy(model)
    pm = parallelize(model, (4, 2, 6, 5), (p, 1, 1, 1))
    pm.conv.weight.register_hook(lambda g: events.append(("conv.weight", 0)))
    x = global_tensor((4, 2, 6, 5), 3, torch.float64)
    out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
    (gather(out.local, out.dist) ** 2).sum().backward()
    (ref(x) ** 2).sum().backward()
    kinds = [k for k, _ in events]
    collective_assert(kinds[0] == "allreduce" and events[0][1] == 320_000
                      and "conv.weight" in kinds and kinds.count("allreduce") == 2, str(events))
    collective_assert(all(rel(a.grad, b.grad) < 1e-10 for a, b in
                          zip(pm.parameters(), ref.parameters())), "sums")


# ------------------------------------------------------------------ bad input
class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.conv(x)
        return x


class CumSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x).cumsum(2)


class Shared(nn.Module):
    """One Linear applied to samples split over the ranks and to their (replicated) sum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(torch.flatten(x, 1))
        return self.fc(y.sum(0, keepdim=True))


def outcome(fn):
    _, exc = collective_outcome(fn)  # the same type and message on every rank
    return exc


@pytest.mark.parallel(SIZES)
def test_bad_input_raises_alike_and_converts_nothing():
    p = comm.Get_size()
    exc = outcome(lambda: parallelize(Untraceable(), (1, 1, 6, 6), (1, 1, p, 1)))
    collective_assert(isinstance(exc, TypeError) and "traced" in str(exc), repr(exc))

    model = ResNet()
    before = list(model.parameters())
    exc = outcome(lambda: parallelize(model, (2, 4, 20, 18), (1, 1, p, 1)))
    collective_assert(isinstance(exc, ValueError) and "does not accept" in str(exc),
                      repr(exc))
    collective_assert(all(a is b for a, b in zip(before, model.parameters())), "converted")

    exc = outcome(lambda: parallelize(model, (2, 3, 20, 18), (1, 1, p, 2)))
    collective_assert(isinstance(exc, ValueError) and "grid shape" in str(exc), repr(exc))

    exc = outcome(lambda: parallelize(model, (2, 3, 20, 18), layout="cubes"))
    collective_assert(isinstance(exc, ValueError), repr(exc))


@pytest.mark.parallel([2, 3])
def test_a_wrong_input_block_raises_on_every_rank_in_check_mode():
    """The whole input passed for a block raises the same error on every rank; one rank's
    block of the wrong shape raises there alone, and in check mode on every rank alike
    (the others would wait for it in the first halo exchange)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    pm = parallelize(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)), (1, 2, 10, 7),
                     (1, 1, p, 1))
    x = global_tensor((1, 2, 10, 7), 0, torch.float32)
    exc = outcome(lambda: pm(x))
    texts = comm.allgather(str(exc))
    collective_assert(isinstance(exc, ValueError) and "whole input's shape" in str(exc)
                      and len(set(texts)) == 1, repr(exc))
    block = x[pm.input_dist.local_slices()]
    wrong = block[:, :, :-1] if rank == 1 else block
    with dt.options(check_collective=True):
        exc = outcome(lambda: pm(wrong))
    texts = comm.allgather(str(exc))
    collective_assert(isinstance(exc, ValueError) and "block has shape" in str(exc)
                      and "rank 1 only" in str(exc) and len(set(texts)) == 1, repr(exc))

@pytest.mark.parallel([1, 2, 3])
def test_an_unbatched_input_to_a_window_module_is_refused_naming_it():
    """PyTorch's window modules also take unbatched samples, ``(C, *S)``; parallelize wants
    the batch dimension: a clear error on every rank, for a grid and for the planner."""
    p = comm.Get_size()
    for model, shape, grid in ((nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)), (2, 10, 7),
                                (1, p, 1)),
                               (nn.Sequential(nn.Conv1d(2, 3, 3), nn.MaxPool1d(2)), (2, 9),
                                (1, p)),
                               (nn.Sequential(nn.InstanceNorm2d(2)), (2, 6, 5), (1, 1, p)),
                               (Along(lambda x: F.adaptive_avg_pool2d(x, 2)), (2, 6, 5),
                                (1, 1, p)),
                               (Along(lambda x: F.max_pool2d(x, 2)), (2, 6, 5), (1, 1, p))):
        for layout in (grid, "auto"):
            exc = outcome(lambda m=model, s=shape, lay=layout: parallelize(
                m, s, lay, machine="v100-nvlink-edr"))
            name = type(model[0]).__name__ if isinstance(model, nn.Sequential) else ""
            collective_assert(isinstance(exc, ValueError) and f"{name} takes a batch" in
                              str(exc) and "batch dimension of 1" in str(exc), repr(exc))

@pytest.mark.parallel([2, 3])
def test_an_operation_on_a_split_dimension_names_the_node_and_the_dimension():
    p = comm.Get_size()
    exc = outcome(lambda: parallelize(CumSum(), (1, 1, 6, 5), (1, 1, p, 1)))
    collective_assert(isinstance(exc, ValueError) and "cumsum" in str(exc)
                      and "dimension 2" in str(exc), repr(exc))
    exc = outcome(lambda: parallelize(Heads(), (3, 2, 8, 9), (1, p, 1, 1)))
    collective_assert(isinstance(exc, ValueError) and "'getitem_1'" in str(exc)
                      and "dimension 1" in str(exc), repr(exc))  # selects split channels
    pm = parallelize(CumSum(), (1, 1, 6, 5), (1, 1, 1, p))  # H whole: runs as it is
    x = global_tensor((1, 1, 6, 5), 0, torch.float32)
    collective_assert(pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch)).to_global()
                      .shape == (1, 2, 6, 5), "local")
    if p > 1:  # a layer norm whose weight is computed in forward is not split
        exc = outcome(lambda: parallelize(MadeWeightNorm(), (1, 1, 6, 5), (1, 1, p, 1)))
        collective_assert(isinstance(exc, ValueError) and "'layer_norm'" in str(exc)
                          and "dimension 2" in str(exc), repr(exc))
    if p > 1:  # max unpooling whose windows overlap is not split (which duplicate wins is
        # the order of PyTorch's loop); the pooling with indices is
        exc = outcome(lambda: parallelize(OverlappingUnpool(), (1, 1, 9, 7), (1, 1, p, 1)))
        collective_assert(isinstance(exc, ValueError) and "'unpool'" in str(exc)
                          and "overlap" in str(exc) and "dimension 2" in str(exc), repr(exc))
    if p > 1:  # antialiased interpolation by a scale that is not an integer is not split
        exc = outcome(lambda: parallelize(AntialiasedDownsample(), (1, 1, 9, 5),
                                          (1, 1, p, 1)))
        collective_assert(isinstance(exc, ValueError) and "'interpolate'" in str(exc)
                          and "antialias" in str(exc) and "dimension 2" in str(exc),
                          repr(exc))
        exc = outcome(lambda: parallelize(AntialiasedBicubic(), (1, 1, 9, 5), (1, 1, p, 1)))
        collective_assert(isinstance(exc, ValueError) and "bicubic" in str(exc)
                          and "antialias" in str(exc) and "dimension 2" in str(exc),
                          repr(exc))
        exc = outcome(lambda: parallelize(ScaleInForward(), (1, 1, 8, 5), (1, 1, p, 1)))
        collective_assert(isinstance(exc, ValueError) and "computed in forward" in str(exc)
                          and "dimension 2" in str(exc), repr(exc))


@pytest.mark.parallel([2, 3])
def test_a_parameter_shared_by_layers_split_differently_raises():
    p = comm.Get_size()
    exc = outcome(lambda: parallelize(Shared(), (p, 1, 2, 2), (p, 1, 1, 1)))
    collective_assert(isinstance(exc, ValueError) and "'fc.weight'" in str(exc)
                      and "shared" in str(exc), repr(exc))


@pytest.mark.parallel([1, 2])
def test_an_optimizer_on_the_old_parameters_is_refused():
    p = comm.Get_size()
    model = MeshFCN().double()
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = parallelize(model, (2, 2, 14), (1, 1, p))
    out = pm(dt.DistArray.from_global(global_tensor((2, 2, 14), 0, torch.float64),
                                      pm.input_dist, xp=torch))
    gather(out.local, out.dist).sum().backward()
    exc = outcome(old.step)
    collective_assert(isinstance(exc, RuntimeError) and "before parallelize" in str(exc),
                      repr(exc))
    torch.optim.SGD(pm.parameters(), lr=0.1).step()  # the new ones work


@pytest.mark.parallel([1, 2, 3])
def test_gradient_accumulation_under_no_sync():
    """Two micro-batches, the first under no_sync (no reduction): the sums of both."""
    p = comm.Get_size()
    cls, shape = MODELS["mesh-fcn"]
    torch.manual_seed(0)
    model = cls().double()
    ref = copy.deepcopy(model)
    pm = parallelize(model, shape, (1, 1, p))
    for i in range(2):
        x = global_tensor(shape, 30 + i, torch.float64)
        out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
        whole = gather(out.local, out.dist)
        with no_sync() if i == 0 else contextlib.nullcontext():
            (whole ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
    bad = [name for (name, a), b in zip(pm.named_parameters(), ref.parameters())
           if rel(a.grad, b.grad) > 1e-10]
    collective_assert(not bad, str(bad))


@pytest.mark.parallel([1, 2, 3])
def test_a_term_every_rank_computes_alike_keeps_its_own_gradient():
    """A regularizer of the parameters, computed whole on every rank, is not summed over
    the ranks: only the gradient of the model's use of a parameter on this rank's data is."""
    p = comm.Get_size()
    cls, shape = MODELS["unet2d"]
    torch.manual_seed(0)
    model = cls().double()
    ref = copy.deepcopy(model)
    pm = parallelize(model, shape, (1, 1, 1, p))
    x = global_tensor(shape, 4, torch.float64)
    out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
    penalty = sum((q ** 2).sum() for q in pm.parameters())
    ((gather(out.local, out.dist) ** 2).mean() + 0.1 * penalty).backward()
    ((ref(x) ** 2).mean() + 0.1 * sum((q ** 2).sum() for q in ref.parameters())).backward()
    bad = [name for (name, a), b in zip(pm.named_parameters(), ref.parameters())
           if rel(a.grad, b.grad) > 1e-10]
    collective_assert(not bad, str(bad))


def test_the_example_trains_an_unchanged_unet_split_over_space():
    """examples/torch_unet.py (plain torch, under 40 lines of user code) on 2 ranks: the
    planner splits the image's height or width, and the loss falls."""
    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "examples" / "torch_unet.py"
    code = [line for line in script.read_text().split('"""', 2)[2].splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) < 40, len(code)
    mpiexec = pathlib.Path(sys.executable).parent / "mpiexec"
    out = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"^down\.0 Conv2d\s+\(1, (2, 1|1, 2)\)", out.stdout, re.M), out.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.7 * first, (first, last)


@pytest.mark.parallel([1, 2, 3])
def test_bf16_autocast_convolution_with_one_strided_output_column_per_rank():
    """A width split whose blocks have one output column each of a strided convolution:
    oneDNN 3.12's bfloat16 kernels get that shape wrong on CPUs with AMX (PyTorch's own
    model too, where its output has one column; see the torch kernels). The parallel
    model runs such a block unstrided and matches float32 within bf16 rounding."""
    p = comm.Get_size()
    for stride, padding in (((1, 2), 1), ((1, 3), 0), ((2, 2), 2)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, (3, 5), stride=stride, padding=padding))
        width = stride[1] * (p - 1) + 5 - 2 * padding  # p output columns: one per rank
        pm, ref, wide, (out, xl, whole), _, (yw, xw) = autocast_run(
            model, (2, 3, 9, width), (1, 1, 1, p))
        tol = 4 * 2.0 ** -8
        bad = [f"{what}: {rel(a, b)}" for what, a, b in (
            ("output", whole.float(), yw),
            ("input gradient", xl.grad, xw.grad[pm.input_dist.local_slices()]),
            ("weight gradient", next(pm.parameters()).grad, next(wide.parameters()).grad))
            if rel(a, b) > tol]
        collective_assert(out.local.shape[-1] == 1 and not bad,
                          f"stride {stride}, padding {padding}: {out.local.shape} {bad}")


# ------------------------------------------------------------------ split channels
CHANNEL_MODELS = ["resnet", "unet3d", "mesh-fcn", "segnet1d", "norms", "areas"]


def channel_grids(ndim):
    """Grid shapes that split the channels: alone, and at 4 ranks with the samples or the
    first spatial dimension (uneven and empty channel blocks at 3 and 4 ranks: the models
    take 2 or 3 channels)."""
    p = comm.Get_size()
    out = [tuple([1, p] + [1] * (ndim - 2))]
    if p == 4:
        out += [tuple([2, 2] + [1] * (ndim - 2)), tuple([1, 2, 2] + [1] * (ndim - 3))]
    return out


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", CHANNEL_MODELS)
def test_split_channels_equal_one_process_float64(name):
    """An input whose channels are split: the first convolution sums its ranks' partial
    outputs (channel parallelism), after which the ranks of the channel axis hold the
    same blocks; outputs and every gradient as one process's."""
    cls, shape = MODELS[name]
    for grid in channel_grids(len(shape)):
        torch.manual_seed(0)
        _, _, bad = run_both(cls().double(), shape, grid)
        collective_assert(not bad, f"{name} on {grid}: {bad}")


class Wide(nn.Module):
    """Convolutions of one group between batch norms and ReLUs, with and without bias."""

    def __init__(self, c=3):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 5, 3, stride=2, padding=1, bias=False)
        self.conv3 = nn.Conv2d(5, 4, 1)

    def forward(self, x):
        x = self.bn1(F.relu(self.conv1(x)))  # a bias before a ReLU has a gradient
        return self.conv3(F.relu(self.conv2(x)))


def channel_plan(model, shape, grid):
    """The model's plan with every convolution channel-parallel on ``grid`` (its input's
    channels split, the partial outputs summed) and every other operation on ``grid`` with
    whole channels: the ranks of the channel axis then hold each value alike and take their
    channels of it before each convolution."""
    import dataclasses

    auto = parallelize(copy.deepcopy(model), shape, machine="v100-nvlink-edr",
                       channel_splits=True).plan
    conv = {e.name for e in auto.entries if e.layer.startswith("Conv")}
    return dataclasses.replace(auto, entries=[
        dataclasses.replace(e, grid=grid, split_channels=e.name in conv,
                            mode="channel" if e.name in conv else "")
        for e in auto.entries])


@pytest.mark.parallel([2, 3, 4])
def test_planned_channel_parallel_convolutions_equal_one_process_float64():
    """A plan whose convolutions are channel-parallel: before each, every rank takes its
    channels of the value it holds whole (in backward the channels' gradients gathered),
    and after it the partial outputs are summed; outputs and gradients as one process's,
    with the samples or space split too at 4 ranks, on channels-last blocks too (3 input
    channels: blocks of one channel, and an empty first block at 4 ranks, where the
    bias comes from a rank with no channel)."""
    p = comm.Get_size()
    shape = (2, 3, 7, 6)
    grids = [(1, p, 1, 1)] + ([(2, 2, 1, 1), (1, 2, 2, 1)] if p == 4 else [])
    for grid, layout in [(g, f) for g in grids for f in (None, torch.channels_last)]:
        torch.manual_seed(0)
        model = Wide().double()
        plan = channel_plan(model, shape, grid)
        _, _, bad = run_both(model, shape, plan, memory_format=layout)
        collective_assert(not bad, f"{grid}, {layout}: {bad}")


@pytest.mark.parallel([2, 3])
def test_channel_moves_are_the_adjoints_they_claim():
    """``take_channels``: each rank's channels of a value the ranks hold alike, whose
    gradient is then the whole one on every rank (the channels' gradients gathered);
    ``sum_partials``: the sum of the ranks' partials, each of whose gradients is the
    sum's. Float64, and a bfloat16 sum added in float32."""
    from disttensor_nn.torch.channels import sum_partials, take_channels

    p, r = comm.Get_size(), comm.Get_rank()
    c = 2 * p - 1  # uneven blocks
    bounds = [c * i // p for i in range(p + 1)]
    x = global_tensor((2, c, 3, 4), 0, torch.float64).requires_grad_()
    g = global_tensor((2, c, 3, 4), 1, torch.float64)
    mine = take_channels(x, comm, bounds)
    (mine * g[:, bounds[r]:bounds[r + 1]]).sum().backward()
    ok_take = torch.equal(mine.detach(), x.detach()[:, bounds[r]:bounds[r + 1]]) and \
        torch.allclose(x.grad, g, rtol=0, atol=0)
    parts = [global_tensor((2, 3, 4, 5), 10 + i, torch.float64) for i in range(p)]
    part = parts[r].clone().requires_grad_()
    total = sum_partials(part * 1.0, comm)
    w = global_tensor((2, 3, 4, 5), 20, torch.float64)
    (total * w).sum().backward()
    ok_sum = torch.allclose(total.detach(), sum(parts), rtol=1e-14, atol=0) and \
        torch.equal(part.grad, w)
    half = sum_partials(parts[r].to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
                        * 1, comm)
    ok_half = half.dtype == torch.bfloat16 and torch.allclose(
        half.double(), sum(q.to(torch.bfloat16).double() for q in parts), rtol=2**-7, atol=0)
    exc = outcome(lambda: take_channels(x, comm, bounds[:-1]))
    collective_assert(ok_take and ok_sum and ok_half and isinstance(exc, ValueError) and
                      "bounds" in str(exc), f"{ok_take} {ok_sum} {ok_half} {exc!r}")


@pytest.mark.parallel([2, 3])
def test_split_channels_that_an_operation_cannot_take_raise_alike():
    """A grouped convolution, or a per-channel operation, on split channels: a clear error
    naming the node and dimension 1 on every rank; a channel_splits that is not a bool, a
    TypeError."""
    p = comm.Get_size()
    grouped = nn.Sequential(nn.Conv2d(2 * p, 2 * p, 3, groups=2))
    exc = outcome(lambda: parallelize(grouped, (1, 2 * p, 6, 6), (1, p, 1, 1)))
    collective_assert(isinstance(exc, ValueError) and "'_0'" in str(exc) and "groups" in str(exc)
                      and "dimension 1" in str(exc), repr(exc))
    normed = nn.Sequential(nn.BatchNorm2d(2 * p), nn.Conv2d(2 * p, 3, 3))
    exc = outcome(lambda: parallelize(normed, (2, 2 * p, 6, 6), (1, p, 1, 1)))
    collective_assert(isinstance(exc, ValueError) and "'_0'" in str(exc)
                      and "dimension 1" in str(exc), repr(exc))
    exc = outcome(lambda: parallelize(Wide(), (2, 3, 7, 6), channel_splits="yes"))
    collective_assert(isinstance(exc, TypeError) and "channel_splits" in str(exc), repr(exc))
    exc = outcome(lambda: parallelize(Wide(), (2, 3, 7, 6), (1, p, 1, 1),
                                      channel_splits=True))
    collective_assert(isinstance(exc, ValueError) and "layout='auto'" in str(exc), repr(exc))


Pair = collections.namedtuple("Pair", ["y", "z"])


class Structured(nn.Module):
    """A model whose output nests its tensors: a tuple in a tuple, a dict, a named tuple
    (``kind``), a size among them."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if self.kind == "nested":
            return y, (y * 2, F.max_pool2d(y, 2)), x.shape[0]
        if self.kind == "dict":
            return {"y": y, "pooled": {"max": F.max_pool2d(y, 2)}, "z": torch.relu(x)}
        if self.kind == "values":  # PyTorch's own named tuple of values and indices
            return y.max(1)
        return Pair(y, (y.sum(dim=1, keepdim=True), [torch.relu(y)]))


def _leaves(got, want):
    """The tensors of two nested outputs, in order, and how their containers differ."""
    got_leaves, want_leaves, found = [], [], []

    def walk(o, w):
        if isinstance(w, torch.Tensor):
            got_leaves.append(o)
            want_leaves.append(w)
        elif isinstance(w, (dict, tuple, list)):
            same = type(o) is type(w) and (not isinstance(w, dict) or o.keys() == w.keys())
            found.extend([] if same else [f"{type(o).__name__} for {type(w).__name__}"])
            for a, b in (((o[k], w[k]) for k in w) if isinstance(w, dict) else zip(o, w)):
                walk(a, b)
        elif o != w:
            found.append(f"{o!r} for {w!r}")

    walk(got, want)
    return got_leaves, want_leaves, found


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kind", ["nested", "dict", "named", "values"])
def test_outputs_nested_in_containers_are_distributed_arrays(kind):
    """Every tensor of an output nested in tuples, dicts or a named tuple comes back a
    DistArray of the whole output's values (and gradients back through all of them); the
    containers keep their types, and what is not a tensor its value."""
    p = comm.Get_size()
    shape = (2, 2, 9, 8)
    bad = []
    for grid in [(1, 1, p, 1), (p, 1, 1, 1), (1, 1, 1, p)]:
        torch.manual_seed(0)
        model = Structured(kind).double()
        ref = copy.deepcopy(model)
        pm = parallelize(model, shape, grid)
        x = global_tensor(shape, 1, torch.float64)
        out = pm(dt.DistArray.from_global(x, pm.input_dist, xp=torch))
        want = ref(x)
        got_leaves, want_leaves, found = _leaves(out, want)
        bad += [f"{grid}: {f}" for f in found]
        if not all(isinstance(o, dt.DistArray) for o in got_leaves):
            bad.append(f"{grid}: {[type(o).__name__ for o in got_leaves]}")
            continue
        for o, w in zip(got_leaves, want_leaves):
            err = rel(o.to_global(), w)
            bad.append("" if err < 1e-12 else f"{grid}: output {err}")
        sum(gather(o.local, o.dist).sum() for o in got_leaves).backward()
        sum(w.sum() for w in want_leaves).backward()
        err = max(rel(a.grad, b.grad) for a, b in zip(pm.parameters(), ref.parameters()))
        bad.append("" if err < 1e-12 else f"{grid}: gradients {err}")
    bad = [b for b in bad if b]
    collective_assert(not bad, f"{bad}")


class AlongChannels(nn.Module):
    """Operations along the channels (or every dimension but the one given), which a split
    of the samples or of space leaves whole on each block; tensors shaped like the input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a, b = torch.split(y, 2, 1)
        c, d = y.chunk(2, dim=1)
        top, idx = y.max(1, keepdim=True)
        vals, _ = torch.sort(y, dim=1, descending=True)
        k = torch.topk(y, 2, dim=1).values
        spread = y.std(dim=1, keepdim=True) + y.var(1, keepdim=True)
        z = (a * torch.sigmoid(b) + c * d + top + 1e-3 * idx + F.glu(y, dim=1)
             + vals[:, :2] + k + spread + y.argmax(1, keepdim=True))
        z = torch.where(z > 0, z, torch.zeros_like(z)) + torch.full_like(z, 0.5)
        z = z.masked_fill(z > 2.0, 2.0) / z.numel() + 0.1 * torch.rand_like(z)
        z = z + torch.flip(z, dims=(1,)) + torch.roll(z, 1, dims=1) + torch.logsumexp(
            y, 1, keepdim=True)
        return z * torch.amax(y, 1, keepdim=True) + torch.unbind(z, 1)[1][:, None]


@pytest.mark.parallel(SIZES)
def test_operations_along_unsplit_dimensions_run_on_blocks():
    """Operations along a dimension no rank splits (split, chunk, max and argmax, sort, topk,
    std, glu, flip, roll, unbind along the channels) run on each block as they are, their
    outputs cut as their input along the others; tensors made like the input (zeros, a
    fill, random values drawn as one process draws them) and masked_fill, numel too.
    Along a split dimension they are refused, naming it."""
    p = comm.Get_size()
    bad = []
    for grid in [(p, 1, 1, 1), (1, 1, p, 1), (1, 1, 1, p)]:
        torch.manual_seed(0)
        _, _, found = run_both(AlongChannels().double(), (3, 2, 9, 7), grid)
        bad += [(grid, found)] if found else []
    collective_assert(not bad, f"{bad}")
    if p > 1:
        for f, grid, dim in ((lambda x: torch.split(x, 3, 2)[0], (1, 1, p, 1), 2),
                             (lambda x: x.flip(2, 3), (1, 1, 1, p), 3),  # dims as arguments
                             (lambda x: x.std(dim=(), keepdim=True), (p, 1, 1, 1), 0)):
            exc = outcome(lambda f=f, g=grid: parallelize(Along(f), (3, 2, 9, 7), g))
            collective_assert(isinstance(exc, ValueError) and f"dimension {dim}" in str(exc),
                              repr(exc))


class Along(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


class Embedded(nn.Module):
    """A position embedding of the output's full shape and a per-row buffer: tensors every
    rank holds whole, of the split dimensions' lengths."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, 3, 9, 7))
        self.rows = nn.Parameter(torch.randn(9, 1))
        self.register_buffer("cols", torch.linspace(0.5, 1.5, 7))

    def forward(self, x):
        return (self.conv(x) + self.pos) * self.rows * self.cols + self.pos.mean()


@pytest.mark.parallel(SIZES)
def test_whole_tensors_of_the_split_lengths_meet_each_block_cut():
    """A parameter or buffer of a split dimension's full length (a position embedding) meets
    each rank's block cut to it, and its gradient is one process's."""
    p = comm.Get_size()
    bad = []
    for grid in grids(4):
        torch.manual_seed(0)
        _, _, found = run_both(Embedded().double(), (2, 2, 9, 7), grid)
        bad += [(grid, found)] if found else []
    collective_assert(not bad, f"{p}: {bad}")

