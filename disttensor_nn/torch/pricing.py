"""What the planner prices for a traced node: the work :func:`~disttensor_nn.torch.parallelize`
runs for it on each layout, not the built-in layer that stands for it.

The planner sees a traced model as a network of built-in layers (a convolution
module as :class:`~disttensor_nn.Conv2d`, and so on: :mod:`.autoplan`), whose cost
specs and 1-process twins it prices. Two things the parallelized model does
differently, and which change which layout is cheapest:

- **Dimensions of length one are never split.** Where a candidate's grid splits
  the samples of a one-sample batch, the built-in layers leave the other ranks'
  blocks empty and still sum statistics over them; the compiler instead keeps
  the dimension whole, so that every rank computes the same whole block (its
  grid axis holds replicas), with no message and no sum. :func:`as_run` is
  that distribution, and a node is priced on it.
- **A whole block runs the module itself.** Where no dimension of a node's
  input is split, the compiler calls the PyTorch module as it is (a convolution
  with its own padding, ``F.batch_norm`` over the block), a few microseconds of
  Python a call; the built-in layer's own per-call work costs some hundred
  microseconds. Such a node's kernels are timed on a :class:`ModuleTwin`: the
  module run forward and backward by PyTorch's autograd on the local block. A
  node whose input is split keeps the built-in layer's twin, whose per-call work
  stands for that of the compiler's halo exchanges and split statistics.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import replace
from types import ModuleType
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.backend import array_namespace, is_numpy

from ..costspec import CostSpec, largest_block
from ..module import Layer

__all__ = ["ModuleTwin", "as_run", "priced"]


def as_run(dist: Distribution) -> Distribution:
    """``dist`` as the compiler runs it: dimensions of length one whole (their grid
    axes hold replicas)."""
    if all(n > 1 or dist.nblocks[d] == 1 for d, n in enumerate(dist.global_shape)):
        return dist
    axes = [None if n <= 1 else a for n, a in zip(dist.global_shape, dist.axes)]
    return Distribution(dist.global_shape, dist.grid_arg, axes)


@functools.lru_cache(maxsize=256)
def _self_dist(shape: tuple[int, ...]) -> Distribution:
    return Distribution(shape, ProcessGrid((1,) * len(shape), MPI.COMM_SELF),
                        tuple(range(len(shape))))


def _own(local: Any) -> DistArray:
    """``local`` as a DistArray on a 1-process grid."""
    return DistArray(local, _self_dist(tuple(local.shape)))


class ModuleTwin(Layer):
    """A PyTorch module run on a local block, as the kernel timer runs a layer's twin.

    ``forward`` runs the module under autograd on the block (shared with
    PyTorch, not copied), ``backward`` runs PyTorch's backward from the given
    gradient and returns the input's (None with ``input_grad`` off, as a
    first layer's). The module is a copy: timing never changes the model's
    parameters or statistics.

    Parameters
    ----------
    module : torch.nn.Module
        The traced model's module.
    like : Layer
        The built-in layer that stands for it in the planner's network: its
        output shapes and its FLOPs, bytes and memory on a block.
    """

    def __init__(self, module: nn.Module, like: Layer):
        object.__setattr__(self, "torch_module", copy.deepcopy(module).train())
        object.__setattr__(self, "like", like)
        object.__setattr__(self, "_saved", None)

    def kernel_signature(self) -> str:
        return f"torch.nn.{self.torch_module!r}"

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.like.output_shape(tuple(in_shape)))

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """The built-in layer's work on the whole block, run as it is: no halo, no
        message."""
        spec = self.like.cost_spec(dist, itemsize)
        return replace(spec, local_shape=largest_block(dist), halo=None, allreduces=(),
                       redistributions=(), twin=None)

    def local_twin(self) -> ModuleTwin:
        return ModuleTwin(self.torch_module, self.like)

    def to(self, xp: ModuleType, device: Any = None) -> ModuleTwin:
        if not is_numpy(xp):
            self.torch_module.to("cuda" if device is None else f"cuda:{int(device)}")
        return self

    def zero_grad(self) -> None:
        self.torch_module.zero_grad(set_to_none=False)

    def run_forward(self, x: DistArray) -> DistArray:
        """The module forward on ``x``'s block, under autograd."""
        t = torch.from_dlpack(x.local) if not isinstance(x.local, np.ndarray) else \
            torch.from_numpy(x.local)
        t.requires_grad_(self.input_grad)
        with torch.enable_grad():
            y = self.torch_module(t)
        if isinstance(y, tuple):  # max pooling's values and indices: the values
            y = y[0]
        object.__setattr__(self, "_saved", (t, y))
        out = y.detach()
        return _own(out.numpy() if out.device.type == "cpu" else _as_array(out, x.local))

    def run_backward(self, dy: DistArray) -> DistArray | None:
        """PyTorch's backward from ``dy``'s block: the input's gradient (or None)."""
        t, y = self._saved
        object.__setattr__(self, "_saved", None)
        g = dy.local
        y.backward(torch.from_numpy(g) if isinstance(g, np.ndarray) else torch.from_dlpack(g))
        if t.grad is None:
            return None
        return _own(t.grad.numpy() if t.grad.device.type == "cpu" else _as_array(t.grad, g))

    def __repr__(self) -> str:
        return f"ModuleTwin({self.torch_module!r})"


# The timer calls forward and backward: here they are the runs alone, without the checks a
# Layer's own forward and backward are wrapped in (a compiled node makes none of them; they
# would add some 100 us a call to what is timed)
ModuleTwin.forward = ModuleTwin.run_forward  # type: ignore[method-assign]
ModuleTwin.backward = ModuleTwin.run_backward  # type: ignore[method-assign]


def _as_array(t: torch.Tensor, like: Any) -> Any:
    """A device tensor as an array of ``like``'s module (DLPack, no copy)."""
    return array_namespace(like).from_dlpack(t)


def _on(run: Distribution, spec: CostSpec) -> CostSpec:
    """``spec`` (of a layer on ``run``) with no message along a dimension of length one: the
    cost model prices halos and sums by the candidate's grid, where such a dimension is
    split (one rank's block whole, the others' empty)."""
    unit = {d for d, n in enumerate(run.global_shape) if n <= 1 and run.nblocks[d] == 1}
    if not unit:
        return spec
    sums = []
    for a in spec.allreduces:
        dims = tuple(d for d in a.dims if d not in unit and run.nblocks[d] > 1)
        if dims or a.axes:
            sums.append(replace(a, dims=dims))
    halo = None if spec.halo is None else tuple(
        (0, 0) if d in unit else w for d, w in enumerate(spec.halo))
    return replace(spec, allreduces=tuple(sums), halo=halo)


class _Priced:
    """The planner's view of a traced node: a built-in layer priced as the compiler runs
    it (the module's notes). Mixed into the built-in layer's class by :func:`priced`."""

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        run = as_run(dist)
        spec = _on(run, super().cost_spec(run, itemsize))  # type: ignore[misc]
        module = self.__dict__.get("_traced_module")
        if module is None or not spec.timed or \
                any(n > 1 for n in run.nblocks):
            return spec
        twin = self.__dict__.get("_module_twin")
        if twin is None:
            twin = ModuleTwin(module, self.local_twin())
            object.__setattr__(self, "_module_twin", twin)
        twin.input_grad = self.input_grad  # type: ignore[attr-defined]
        return replace(spec, local_shape=largest_block(run), twin=twin)

    def local_twin(self) -> Layer:
        """The built-in layer's twin (what the timer runs for a split input)."""
        twin = super().local_twin()  # type: ignore[misc]
        base = next(c for c in type(twin).__mro__ if not issubclass(c, _Priced))
        plain = base.__new__(base)
        plain.__dict__.update(twin.__dict__)
        for key in ("_traced_module", "_module_twin"):
            plain.__dict__.pop(key, None)
        return plain


@functools.cache
def _priced_class(cls: type) -> type:
    return type(cls.__name__, (_Priced, cls), {"__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__})


def priced(layer: Layer, module: nn.Module | None) -> Layer:
    """``layer`` (a built-in layer standing for a traced node) priced as the compiler runs
    the node: on :func:`as_run`'s distribution, and, where ``module`` is the node's
    PyTorch module and no dimension of its input is split, by the module's own time."""
    if isinstance(layer, _Priced):
        return layer
    new = _priced_class(type(layer)).__new__(_priced_class(type(layer)))
    new.__dict__.update(layer.__dict__)
    if module is not None:
        new.__dict__["_traced_module"] = module
    return new
