"""disttensor_nn: CNN layers that train on samples split over ranks (by sample and spatially).

Every layer takes and returns :class:`disttensor.DistArray` s whose sample and
spatial dimensions may be split in any way over a process grid, and gives
the forward values and gradients a single process would.
"""

from .container import Residual, Sequential
from .layers.conv import Conv1d, Conv2d, Conv3d, ConvNd
from .layers.dense import Flatten, Linear
from .layers.elementwise import Add, LeakyReLU, ReLU, Sigmoid
from .layers.loss import BCEWithLogitsLoss, MSELoss, SoftmaxCrossEntropy
from .layers.norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .layers.pool import (
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    GlobalAvgPool,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from .module import Layer, Layout, Parameter
from .optim import SGD
from .placement import to_array_module

__all__ = [
    "Add", "AvgPool1d", "AvgPool2d", "AvgPool3d", "BCEWithLogitsLoss", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "Conv1d", "Conv2d", "Conv3d", "ConvNd", "Flatten",
    "GlobalAvgPool", "Layer", "Layout", "LeakyReLU", "Linear", "MSELoss", "MaxPool1d",
    "MaxPool2d", "MaxPool3d", "Parameter", "ReLU", "Residual", "SGD", "Sequential", "Sigmoid",
    "SoftmaxCrossEntropy", "to_array_module",
]
