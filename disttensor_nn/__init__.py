"""disttensor_nn: CNN layers that train on samples split over ranks (by sample and spatially).

Every layer takes and returns :class:`disttensor.DistArray` s whose sample and
spatial dimensions may be split in any way over a process grid, and gives
the forward values and gradients a single process would.
"""

from .container import Residual, Sequential, Skip
from .layers.conv import Conv1d, Conv2d, Conv3d, ConvNd
from .layers.dense import Flatten, Linear
from .layers.dropout import Dropout
from .layers.elementwise import Add, LeakyReLU, ReLU, Sigmoid
from .layers.groupnorm import GroupNorm, InstanceNorm
from .layers.loss import BCEWithLogitsLoss, MSELoss, SoftmaxCrossEntropy
from .layers.merge import Concat
from .layers.norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, set_batch_norm_stats
from .layers.pool import (
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    GlobalAvgPool,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from .layers.segloss import CrossEntropyLoss, DiceLoss
from .layers.softmax import Softmax
from .layers.transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, ConvTransposeNd
from .layers.upsample import Upsample
from .layout import Layout
from .module import Layer
from .optim import SGD
from .parameter import Parameter
from .placement import to_array_module
from .precision import GradScaler, set_precision
from .reduction import no_sync

__all__ = [
    "Add", "AvgPool1d", "AvgPool2d", "AvgPool3d", "BCEWithLogitsLoss", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "Concat", "Conv1d", "Conv2d", "Conv3d", "ConvNd",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "ConvTransposeNd",
    "CrossEntropyLoss", "DiceLoss", "Dropout", "Flatten", "GlobalAvgPool", "GroupNorm",
    "InstanceNorm", "Layer", "Layout", "LeakyReLU", "Linear", "MSELoss", "MaxPool1d",
    "MaxPool2d", "MaxPool3d", "Parameter", "ReLU", "Residual", "SGD", "Sequential", "Sigmoid",
    "Skip", "Softmax", "SoftmaxCrossEntropy", "Upsample", "no_sync", "to_array_module",
    "set_precision", "GradScaler", "set_batch_norm_stats",
]
