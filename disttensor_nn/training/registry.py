"""The model registry: each named model with the data, loss and settings it trains with.

``disttensor-train``, ``disttensor-plan`` and :func:`~disttensor_nn.training.train`
know a model only by its name here. A :class:`ModelSpec` says how to build the
network and what it trains on by default; :func:`register_model` adds one,
after which the driver and the command-line tools (``--model``) accept it::

    register_model("tiny", ModelSpec(
        builder=lambda dtype, seed: Sequential(Conv2d(4, 1, 3, padding=1, dtype=dtype,
                                                      seed=seed)),
        in_channels=4, size=(16, 16),
        dataset=lambda n, shape, seed: MeshSynthetic(n, shape[1:], channels=shape[0],
                                                     seed=seed),
        loss=MSELoss, lr=0.05))

The built-in entries are the ResNets (``resnet18`` ... ``resnet152``, on
ImageNet-shaped synthetic images with a softmax cross-entropy), three
sizes of the mesh-tangling network (``mesh``, ``mesh-small``, ``mesh-demo``,
on synthetic mesh fields with a mean squared error), the U-Nets ``unet2d``
and ``unet3d`` (small widths, on thresholded smooth fields with a per-pixel
cross-entropy), and ``cosmoflow`` (a narrow version on 4 x 32^3 volumes
that encode 4 parameters, with a mean squared error) and
``cosmoflow-mlperf`` (the benchmark's network on 4 x 128^3 volumes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..layers.loss import MSELoss, SoftmaxCrossEntropy
from ..layers.segloss import CrossEntropyLoss
from ..models import cosmoflow, mesh_fcn, resnet, unet
from ..module import Layer
from .data import Dataset, ImageNetSynthetic, MeshSynthetic
from .volumes import CosmoSynthetic, SegmentationSynthetic

__all__ = ["ModelSpec", "build_model", "check_size", "model_names", "model_spec",
           "register_model"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build a named model, and what it trains on unless told otherwise.

    Attributes
    ----------
    builder : callable
        ``builder(dtype=..., seed=...)`` returns the network, a
        :class:`~disttensor_nn.Layer` that is the same on every rank for the
        same seed.
    in_channels : int
        Channels C of an input sample (N, C, *S).
    size : tuple of int
        Default spatial size S of an input sample.
    dataset : callable
        ``dataset(num_samples, sample_shape, seed)`` returns the default
        :class:`~disttensor_nn.training.Dataset` of ``num_samples`` samples of
        shape ``sample_shape`` = (C, *S).
    loss : callable
        ``loss()`` returns a new loss layer for the network's output and the
        data set's targets.
    lr : float
        Default learning rate of the training driver.
    batch : int
        Default global batch size of ``disttensor-plan``.
    sized : bool
        The network depends on the sample's spatial size (dense layers after
        the convolutions): the builder is called as ``builder(size=S,
        dtype=..., seed=...)`` and raises ValueError for a size it cannot
        take. Otherwise one network takes every size its layers accept.
    """

    builder: Callable[..., Layer]
    in_channels: int
    size: tuple[int, ...]
    dataset: Callable[[int, tuple[int, ...], int], Dataset]
    loss: Callable[[], Layer]
    lr: float
    batch: int = 4
    sized: bool = False


_REGISTRY: dict[str, ModelSpec] = {}


def _check_spec(name: Any, spec: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model name must be a non-empty string, got {name!r}")
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"model {name!r}: expected a ModelSpec, got {type(spec).__name__}")
    for field in ("builder", "dataset", "loss"):
        if not callable(getattr(spec, field)):
            raise TypeError(f"model {name!r}: {field} must be callable")
    if not isinstance(spec.in_channels, int) or spec.in_channels < 1:
        raise ValueError(f"model {name!r}: in_channels must be a positive int, "
                         f"got {spec.in_channels!r}")
    if not isinstance(spec.size, tuple) or not spec.size or \
            not all(isinstance(s, int) and s >= 1 for s in spec.size):
        raise ValueError(f"model {name!r}: size must be a tuple of positive ints, "
                         f"got {spec.size!r}")
    if not spec.lr > 0:
        raise ValueError(f"model {name!r}: lr must be > 0, got {spec.lr!r}")
    if not isinstance(spec.batch, int) or spec.batch < 1:
        raise ValueError(f"model {name!r}: batch must be a positive int, got {spec.batch!r}")


def register_model(name: str, spec: ModelSpec, *, replace: bool = False) -> None:
    """Make ``name`` known to the training driver and the command-line tools.

    Call it identically on every rank (e.g. at import time of the module that
    defines the model), before :func:`~disttensor_nn.training.train` or the
    tools' ``main`` functions.

    Parameters
    ----------
    name : str
        The model's name (``TrainConfig.model``, ``disttensor-train NAME``).
    spec : ModelSpec
        How to build and train it.
    replace : bool
        Allow replacing a model of the same name.

    Raises
    ------
    TypeError, ValueError
        For a malformed name or spec, or a name already registered without
        ``replace``.
    """
    _check_spec(name, spec)
    if name in _REGISTRY and not replace:
        raise ValueError(f"model {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = spec


def model_names() -> tuple[str, ...]:
    """The registered model names, in registration order."""
    return tuple(_REGISTRY)


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` registered as ``name``.

    Raises
    ------
    ValueError
        For a name that is not registered; the message lists the known ones.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; choose from "
                         f"{', '.join(model_names())}") from None


def build_model(name: str, size: tuple[int, ...] | None = None, batch: int = 1,
                dtype: Any = np.float32, seed: int = 0) -> tuple[Any, tuple[int, ...]]:
    """A model from the registry and the global batch shape it trains on.

    Parameters
    ----------
    name : str
        A registered name (:func:`model_names`).
    size : tuple of int, optional
        Spatial size of a sample (default: the model's :attr:`ModelSpec.size`).
    batch : int
        Global batch size N.
    dtype : dtype
        Element type of the parameters.
    seed : int
        Seed of the initial weights.

    Returns
    -------
    model : Layer
        The network.
    shape : tuple of int
        The global batch shape (N, C, *S).

    Raises
    ------
    ValueError
        For an unknown name.
    """
    spec = model_spec(name)
    size = tuple(size) if size else spec.size
    if spec.sized:
        return spec.builder(size=size, dtype=dtype, seed=seed), (batch, spec.in_channels, *size)
    return spec.builder(dtype=dtype, seed=seed), (batch, spec.in_channels, *size)


def _size_problem(name: str, model: Layer, size: tuple[int, ...]) -> str | None:
    """Why ``model`` (the registered ``name``) cannot train on samples of ``size``, or None."""
    spec = model_spec(name)
    shape = (1, spec.in_channels, *size)
    try:
        if spec.sized:  # a network built for this size (its builder checks the size first)
            model = spec.builder(size=size)
        out = tuple(model.output_shape(shape))
    except ValueError as exc:
        return str(exc)
    target = spec.dataset(1, shape[1:], 0).target_shape
    # spatial sizes must agree; the channels may not (logits per class vs. one label)
    if len(target) and tuple(out[2:]) != tuple(target[1:]):
        return (f"the network's output per sample {out[1:]} does not match the data's "
                f"target {tuple(target)}")
    return None


def check_size(name: str, size: tuple[int, ...] | None, model: Layer | None = None) -> None:
    """Check that the model ``name`` trains on samples of spatial ``size``; say which sizes do.

    Nothing is computed: the network's :meth:`~disttensor_nn.Layer.output_shape`
    runs through its layers, and a spatial target of the data set must have
    the output's shape.

    Parameters
    ----------
    name : str
        A registered model.
    size : tuple of int or None
        Spatial size S of a sample (None: the model's default, which is fine).
    model : Layer, optional
        The built model (built here if not given).

    Raises
    ------
    ValueError
        Naming the problem and, per spatial dimension, the nearest sizes that
        work (with the other dimensions at the model's default size).
    """
    spec = model_spec(name)
    if size is None:
        return
    size = tuple(size)
    nd = len(spec.size)
    if len(size) != nd:
        raise ValueError(f"model {name!r} takes {nd}-D sizes like "
                         f"{'x'.join(map(str, spec.size))}, got {'x'.join(map(str, size))}")
    if model is None and not spec.sized:  # (a sized network is built for each size tried)
        model = build_model(name)[0]
    problem = _size_problem(name, model, size)
    if problem is None:
        return
    hints = []
    for i, n in enumerate(size):
        if _size_problem(name, model, spec.size[:i] + (n,) + spec.size[i + 1:]) is None:
            hints.append(f"dimension {i}: {n}")
            continue
        works = []
        for direction in (-1, 1):
            m = n + direction
            while 1 <= m <= 4 * max(n, spec.size[i]) and \
                    _size_problem(name, model, spec.size[:i] + (m,) + spec.size[i + 1:]):
                m += direction
            if 1 <= m <= 4 * max(n, spec.size[i]):
                works.append(str(m))
        hints.append(f"dimension {i}: {' or '.join(works) or 'none near it'}")
    raise ValueError(f"model {name!r} cannot train on {'x'.join(map(str, size))} samples: "
                     f"{problem}. Nearest sizes that work: {'; '.join(hints)} (the default is "
                     f"{'x'.join(map(str, spec.size))})")


def _imagenet(num_samples: int, sample_shape: tuple[int, ...], seed: int) -> Dataset:
    return ImageNetSynthetic(num_samples, sample_shape[1:], seed=seed)


def _mesh(num_samples: int, sample_shape: tuple[int, ...], seed: int) -> Dataset:
    return MeshSynthetic(num_samples, sample_shape[1:], channels=sample_shape[0], seed=seed)


for _depth in (18, 34, 50, 101, 152):
    register_model(f"resnet{_depth}", ModelSpec(
        partial(resnet, _depth), 3, (224, 224), _imagenet, SoftmaxCrossEntropy, 0.01, 32))
register_model("mesh", ModelSpec(mesh_fcn, 18, (2048, 2048), _mesh, MSELoss, 0.1))
register_model("mesh-small", ModelSpec(
    partial(mesh_fcn, widths=(8, 16, 16, 24, 24, 8)), 18, (256, 256), _mesh, MSELoss, 0.1))
# three stages: fine enough output patches to learn in a minute
register_model("mesh-demo", ModelSpec(
    partial(mesh_fcn, widths=(16, 24, 32), convs_per_stage=2), 18, (256, 256), _mesh, MSELoss,
    0.1))


def _segmentation(num_samples: int, sample_shape: tuple[int, ...], seed: int) -> Dataset:
    return SegmentationSynthetic(num_samples, sample_shape[1:], channels=sample_shape[0],
                                 classes=2, seed=seed)


def _cosmo(num_samples: int, sample_shape: tuple[int, ...], seed: int) -> Dataset:
    return CosmoSynthetic(num_samples, sample_shape[1:], channels=sample_shape[0], seed=seed)


# small widths: the demos train in seconds to a minute on a laptop
register_model("unet2d", ModelSpec(
    partial(unet, 2, 1, 2, depth=3, width=8, norm="batch"), 1, (64, 64), _segmentation,
    CrossEntropyLoss, 0.1))
register_model("unet3d", ModelSpec(
    partial(unet, 3, 1, 2, depth=3, width=4, norm="group"), 1, (32, 32, 32), _segmentation,
    CrossEntropyLoss, 0.1, 2))
# the network's dense layers depend on the input size (built for each size, sides divisible
# by 32): "cosmoflow" is a reduced demo (32^3, narrow), "cosmoflow-mlperf" the benchmark's
# network on its 4 x 128^3 samples
register_model("cosmoflow", ModelSpec(
    partial(cosmoflow, 4, conv_layers=5, width=8), 4, (32, 32, 32), _cosmo, MSELoss, 0.01,
    sized=True))
register_model("cosmoflow-mlperf", ModelSpec(
    partial(cosmoflow, 4, conv_layers=5, width=32), 4, (128, 128, 128), _cosmo, MSELoss,
    0.01, 2, sized=True))
