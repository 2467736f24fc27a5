"""What the planner prices for a traced node: the work :func:`~disttensor_nn.torch.parallelize`
runs for it on each layout, not the built-in layer that stands for it.

The planner sees a traced model as a network of built-in layers (a convolution
module as :class:`~disttensor_nn.Conv2d`, and so on: :mod:`.autoplan`), whose cost
specs and 1-process twins it prices. What the parallelized model does
differently, and which change which layout is cheapest:

- **Dimensions of length one are never split.** Where a candidate's grid splits
  the samples of a one-sample batch, the built-in layers leave the other ranks'
  blocks empty and still sum statistics over them; the compiler instead keeps
  the dimension whole, so that every rank computes the same whole block (its
  grid axis holds replicas), with no message for it. :func:`as_run` is that
  distribution; the planner prices every layer on it (the cost model's
  ``runs_as``). The moves between two layers' distributions stay priced on the
  candidates' own: a move into replicas waits for every rank, which its bytes
  do not show.
- **A block of whole samples runs the module itself.** Where no dimension of a
  module's input but the samples is split and nothing but parameter gradients
  is summed over the ranks (:func:`runs_as_module`), the compiler calls the
  PyTorch module as it is on each rank's block (a convolution with its own
  padding, ``F.batch_norm`` over the block), a few microseconds of Python a
  call; the built-in layer's own per-call work costs some hundred
  microseconds. Such a node's kernels are timed on a :class:`ModuleTwin`: the
  module run forward and backward by PyTorch's autograd on the local block
  (:func:`priced`); its gradients' sums stay priced as the built-in layer's.
- **A batch norm whose statistics span ranks is the split batch norm.** Where
  its input's space, or its samples under whole-batch statistics, are split,
  the compiler runs :func:`~disttensor_nn.torch.split_batch_norm`: its kernels
  and per-call work are timed on a :class:`SplitNormTwin` (the same function
  over one rank), its statistics' messages priced as the built-in layer's
  allreduces. The built-in layer's own passes cost 2-3 times as much on small
  blocks, which made plans gather the deep layers' blocks for their batch norms
  and split them again for the convolutions.
- A node whose input is split otherwise (a convolution's or pooling's space,
  channels) keeps the built-in layer's twin, whose per-call work is of the
  order of the compiler's halo exchanges on small blocks (compared in
  ``docs/performance.md``); function nodes (``F.relu``, ``F.interpolate``)
  and traced operations keep the built-in price everywhere.
- **Channels are split for convolutions alone.** Under a grid over ``(N, C, S..)``
  a convolution may take its input with the channels split and sum its partial
  outputs over those ranks (the planner's ``"channel"`` mode; the compiler's
  channel-parallel convolution), or run whole on each replica of a channel axis
  (``"replicated"``); every other operation takes its channels whole
  (:func:`whole_channels`: its cost spec refuses a channel split, so that the
  planner does not choose one). Values are then split along their channels only
  between the move into a convolution and that convolution.
- **Blocks may be channels-last.** The modules that run as themselves are
  timed on blocks of the layout the plan is for (``ModuleTwin(channels_last=...)``,
  reading the timer's C-contiguous arrays as channels-last memory with no copy),
  and a channels-last plan pays for putting each input block in that layout
  (:func:`conversion_seconds`).
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import replace
from types import ModuleType
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.backend import array_namespace

from ..costspec import CostSpec, largest_block
from ..module import Layer
from ..plan.timer import seconds_on_every_rank
from .norm import split_batch_norm

__all__ = ["CONV_MODES", "ModuleTwin", "SplitNormTwin", "as_run", "channels_last_view",
           "conversion_seconds", "priced", "runs_as_module", "standard_view", "whole_channels"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

CONV_MODES = ("channel", "replicated")
"""The convolution modes (:data:`disttensor_nn.plan.result.MODES`) the compiler runs under a
grid over ``(N, C, S..)``: channel-parallel (split channels in, partial outputs summed over
their ranks) and replicated (whole in and out on each replica)."""


def as_run(dist: Distribution) -> Distribution:
    """The distribution :func:`~disttensor_nn.torch.parallelize` holds for ``dist``.

    Parameters
    ----------
    dist : Distribution
        A candidate's distribution of a layer's input (pure or on a grid).

    Returns
    -------
    Distribution
        ``dist`` with every dimension of length one whole (its grid axes hold
        replicas: every rank has the same block), ``dist`` itself where no
        such dimension is split.
    """
    if all(n > 1 or dist.nblocks[d] == 1 for d, n in enumerate(dist.global_shape)):
        return dist
    shape = dist.global_shape
    return dist.replace(splits=[None if n <= 1 else c for n, c in zip(shape, dist.splits)],
                        axes=[None if n <= 1 else a for n, a in zip(shape, dist.axes)])


@functools.lru_cache(maxsize=256)
def _self_dist(shape: tuple[int, ...]) -> Distribution:
    return Distribution(shape, ProcessGrid((1,) * len(shape), MPI.COMM_SELF),
                        tuple(range(len(shape))))


def _own(local: Any) -> DistArray:
    """``local`` as a DistArray on a 1-process grid."""
    return DistArray(local, _self_dist(tuple(local.shape)))


def _as_tensor(a: Any) -> torch.Tensor:
    """An array's memory as a tensor (no copy)."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


def _as_array(t: torch.Tensor, like: Any) -> Any:
    """A tensor's memory as an array of ``like``'s module (no copy)."""
    return t.numpy() if t.device.type == "cpu" else array_namespace(like).from_dlpack(t)


def channels_last_view(t: torch.Tensor) -> torch.Tensor:
    """A C-contiguous ``(N, C, *S)`` tensor's memory read as a channels-last tensor of the
    same shape (no copy; the values land elsewhere: what a kernel timer needs, whose
    inputs are random)."""
    n, c, *space = t.shape
    return t.view(n, *space, c).permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def standard_view(t: torch.Tensor) -> torch.Tensor:
    """A channels-last tensor's memory read as a C-contiguous one of the same shape (no
    copy, as :func:`channels_last_view` undoes); other tensors made contiguous."""
    if t.is_contiguous():
        return t
    back = t.permute(0, *range(2, t.dim()), 1)
    return back.view(t.shape) if back.is_contiguous() else t.contiguous()


def conversion_seconds(block: tuple[int, ...], dtype: torch.dtype, comm: MPI.Intracomm,
                       reps: int = 5) -> float:
    """Seconds to put an ``(N, C, *S)`` block of ``block``'s shape in channels-last layout
    (``Tensor.contiguous(memory_format=...)``, what a parallel model does to each input
    block it is given in another layout), timed on every rank of ``comm`` at once: the
    slowest rank's median of ``reps``, the same on every rank (collective). Timed once
    per process for each shape, dtype and number of ranks (so that plans made in turn
    compare alike).
    """
    key = (tuple(block), dtype, comm.Get_size())
    if comm.allreduce(key in _CONVERSIONS, op=MPI.LAND):  # every rank's, or timed again
        return float(comm.allreduce(_CONVERSIONS[key], op=MPI.MAX))
    fmt = torch.channels_last if len(block) == 4 else torch.channels_last_3d
    x = torch.rand(tuple(block), dtype=torch.float32).to(dtype)
    _CONVERSIONS[key] = seconds_on_every_rank(lambda: x.contiguous(memory_format=fmt), comm,
                                              reps)
    return _CONVERSIONS[key]


_CONVERSIONS: dict[tuple[Any, ...], float] = {}


def _settings(module: nn.Module) -> str:
    """What of a module's plain attributes ``repr`` leaves out (pooling's
    ``count_include_pad``, interpolation's ``align_corners``, ...), for the timer's key."""
    plain = (bool, int, float, str, tuple, type(None))
    return ",".join(f"{k}={v!r}" for k, v in sorted(vars(module).items())
                    if not k.startswith("_") and k != "training" and isinstance(v, plain))


class ModuleTwin(Layer, checked=False):
    """A PyTorch module run on a local block, as the kernel timer runs a layer's twin.

    ``forward`` runs the module under autograd on the block (shared with
    PyTorch, not copied), on the block's device; ``backward`` runs PyTorch's
    backward from the given gradient and returns the input's (None with
    ``input_grad`` off, as for a first layer, which PyTorch then skips). The
    twin that runs (:meth:`local_twin`, as the timer takes it) has a copy of
    the module, in-place operations off: timing never changes the model's
    parameters or statistics. ``forward`` and ``backward`` are the runs
    alone, without the checks of a layer's (``checked=False``): the compiled
    node makes none of them.

    Parameters
    ----------
    module : torch.nn.Module
        The traced model's module (kept as it is; copied by :meth:`local_twin`).
    like : Layer
        The built-in layer that stands for it in the planner's network: its
        output shapes and its FLOPs, bytes and memory on a block.
    channels_last : bool
        Run it on channels-last blocks (``parallelize(memory_format=...)``):
        a C-contiguous block is read as one (:func:`channels_last_view`, no
        copy), and its output and input gradient are given back read as
        C-contiguous blocks again (:func:`standard_view`), so that a chain of
        such twins hands each other channels-last memory, as the step does.
    """

    def __init__(self, module: nn.Module, like: Layer, channels_last: bool = False):
        object.__setattr__(self, "torch_module", module)
        object.__setattr__(self, "like", like)
        object.__setattr__(self, "channels_last", bool(channels_last))
        object.__setattr__(self, "_saved", None)

    def kernel_signature(self) -> str:
        """The module's type, ``repr``, plain settings and memory format: the timer's key."""
        m = self.torch_module
        return f"torch.nn.{type(m).__name__}:{m!r}|{_settings(m)}" + \
            ("|channels_last" if self.channels_last else "")

    def _in_format(self, t: torch.Tensor) -> torch.Tensor:
        last = self.channels_last and t.dim() in (4, 5) and t.is_contiguous()
        return channels_last_view(t) if last else t

    def _out_format(self, t: torch.Tensor) -> torch.Tensor:
        return standard_view(t) if self.channels_last and t.dim() in (4, 5) else t

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The module's output shape on an input of ``in_shape``."""
        return tuple(self.like.output_shape(tuple(in_shape)))

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """The built-in layer's work on the block, run as it is: no halo, no message (the
        sums of its parameters' gradients are priced by the layer it stands for)."""
        spec = self.like.cost_spec(dist, itemsize)
        return replace(spec, local_shape=largest_block(dist), halo=None, allreduces=(),
                       redistributions=(), twin=None)

    def local_twin(self) -> ModuleTwin:
        """A twin with its own copy of the module (training mode, nothing in place)."""
        module = copy.deepcopy(self.torch_module).train()
        for m in module.modules():
            if getattr(m, "inplace", False) is True:
                m.inplace = False  # a leaf that requires a gradient: no in-place writes
        twin = type(self)(module, self.like, self.channels_last)
        twin.input_grad = self.input_grad
        return twin

    def to(self, xp: ModuleType, device: Any = None) -> ModuleTwin:
        """Itself: the module follows its input's device when it runs."""
        return self

    def zero_grad(self) -> None:
        """Zero the module's parameters' gradients."""
        self.torch_module.zero_grad(set_to_none=False)

    def forward(self, x: DistArray) -> DistArray:
        """The module forward on ``x``'s block, under autograd (the block converted to the
        module's floating dtype where it differs, as a bfloat16 model's 16-bit blocks)."""
        t = self._in_format(_as_tensor(x.local))
        module = self.torch_module
        state = next(itertools.chain(module.parameters(), module.buffers()), None)
        if state is not None and state.device != t.device:
            module.to(t.device)
        t.requires_grad_(self.input_grad)
        inner = t.to(state.dtype) if state is not None and state.dtype.is_floating_point \
            and t.dtype.is_floating_point and state.dtype != t.dtype else t
        with torch.enable_grad():
            y = self._call(module, inner)
        if isinstance(y, tuple):  # max pooling's values and indices: the values
            y = y[0]
        object.__setattr__(self, "_saved", (t, y))
        out = y.detach()
        out = self._out_format(out if out.dtype == t.dtype else out.to(t.dtype))
        return _own(_as_array(out, x.local))

    def backward(self, dy: DistArray) -> DistArray | None:
        """PyTorch's backward from ``dy``'s block: the input's gradient (or None)."""
        t, y = self._saved
        object.__setattr__(self, "_saved", None)
        if not y.requires_grad:  # no parameter and no input gradient: nothing to run
            return None
        y.backward(self._in_format(_as_tensor(dy.local)).to(y.dtype))
        return None if t.grad is None else _own(_as_array(self._out_format(t.grad),
                                                          dy.local))

    def _call(self, module: nn.Module, t: torch.Tensor) -> Any:
        """The module's work on the block ``t`` (its own call)."""
        return module(t)

    def __repr__(self) -> str:
        last = ", channels_last=True" if self.channels_last else ""
        return f"{type(self).__name__}({self.torch_module!r}{last})"


class SplitNormTwin(ModuleTwin, checked=False):
    """A batch norm whose statistics span ranks, run on a local block as the compiler runs
    it: :func:`~disttensor_nn.torch.split_batch_norm` of the block over one rank (its
    kernels and per-call work; the statistics' messages are priced by the layer's
    allreduces), where the built-in layer's twin would time the built-in layer's own
    passes (2-3 times slower on small blocks)."""

    def kernel_signature(self) -> str:
        """:class:`ModuleTwin`'s, marked as the split statistics' run."""
        return super().kernel_signature() + "|split"

    def _call(self, module: nn.Module, t: torch.Tensor) -> Any:
        weight = module.weight if module.affine else None
        bias = module.bias if module.affine else None
        count = t.numel() // max(t.shape[1], 1)
        return split_batch_norm(t, weight, bias, MPI.COMM_SELF, count, module.eps)[0]


def runs_as_module(spec: CostSpec, dist: Distribution) -> bool:
    """Whether a layer of cost ``spec`` on an input in ``dist`` is the module's own call on
    each rank's block: no dimension but the samples split, nothing summed over the ranks
    but parameter gradients, no move.

    The compiler runs such a node as the module on the block (a convolution with its own
    padding, a batch norm whose statistics are the block's), as one process runs it on
    those samples.
    """
    if any(n > 1 for d, n in enumerate(dist.nblocks) if d != 0):
        return False
    summed = [a for a in spec.allreduces if not a.gradient and
              (a.axes or any(dist.nblocks[d] > 1 for d in a.dims))]  # over more than one rank
    return not spec.redistributions and not summed


def _plain(layer: Layer) -> Layer:
    """A copy of ``layer`` of its built-in class (without :class:`_Priced` and
    :class:`_WholeChannels`)."""
    base = next(c for c in type(layer).__mro__
                if not issubclass(c, (_Priced, _WholeChannels)))
    plain = copy.copy(layer)
    plain.__class__ = base
    for key in ("_traced_module", "_module_twins", "_channels_last"):
        plain.__dict__.pop(key, None)
    return plain


class _Priced:
    """A built-in layer standing for a module of a traced model, timed as the module
    where it runs as itself on each rank's block (mixed in by :func:`priced`)."""

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        spec = super().cost_spec(dist, itemsize)  # type: ignore[misc]
        module = self.__dict__.get("_traced_module")
        if module is None or not spec.timed:
            return spec
        if runs_as_module(spec, dist):
            kind: type[ModuleTwin] = ModuleTwin
        elif isinstance(module, _BATCH_NORMS):  # statistics over ranks (channels whole)
            kind = SplitNormTwin
        else:
            return spec
        twins = self.__dict__.setdefault("_module_twins", {})
        last = self.__dict__.get("_channels_last", False)
        key = (bool(self.input_grad), self.kernel_backend, last,  # type: ignore[attr-defined]
               kind)
        if key not in twins:
            twins[key] = kind(module, _plain(self), last)
            twins[key].input_grad = key[0]
        return replace(spec, local_shape=largest_block(dist), twin=twins[key])

    def local_twin(self) -> Layer:
        """The built-in layer's twin (what the timer runs for a split input)."""
        return _plain(super().local_twin())  # type: ignore[misc]


@functools.cache
def _priced_class(cls: type) -> type:
    # the built-in class's name, which kernel signatures and reprs are made of: the
    # work is the built-in layer's wherever it is timed as the layer
    return type(cls.__name__, (_Priced, cls),
                {"__module__": __name__, "__qualname__": f"priced[{cls.__qualname__}]"})


def priced(layer: Layer, module: nn.Module, channels_last: bool = False) -> Layer:
    """``layer`` priced as :func:`~disttensor_nn.torch.parallelize` runs ``module``.

    Parameters
    ----------
    layer : Layer
        The built-in layer that stands for a traced module in the planner's
        network (its kernels timed as the layer's where the input is split).
    module : torch.nn.Module
        The module, called on its input alone.
    channels_last : bool
        Time the module on channels-last blocks (:class:`ModuleTwin`'s).

    Returns
    -------
    Layer
        A copy of ``layer`` whose cost spec, where the module runs as itself on
        each rank's block (:func:`runs_as_module`), names a :class:`ModuleTwin`
        of ``module`` as the twin to time, on that block; for a batch norm whose
        statistics span ranks, a :class:`SplitNormTwin` (the layer's
        collectives kept in the spec).
    """
    new = copy.copy(layer)
    new.__class__ = _priced_class(type(layer))
    new.__dict__["_traced_module"] = module
    new.__dict__["_channels_last"] = bool(channels_last)
    return new


def _channels_split(dist: Distribution) -> bool:
    return dist.ndim > 2 and dist.nblocks[1] > 1


class _WholeChannels:
    """A layer standing for an operation that the compiler runs on whole channels only: a
    channel split of its input is refused where the planner asks (its cost spec, and for
    a convolution the weight splits of a mode), so that no plan chooses one (mixed in by
    :func:`whole_channels`)."""

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        if _channels_split(dist):
            raise ValueError(f"parallelize runs {type(self).__name__} on whole channels")
        return super().cost_spec(dist, itemsize)  # type: ignore[misc]

    def weight_splits(self, dist: Distribution) -> Any:
        if _channels_split(dist):
            raise ValueError(f"parallelize runs {type(self).__name__} on whole channels")
        return super().weight_splits(dist)  # type: ignore[misc]


@functools.cache
def _whole_class(cls: type) -> type:
    return type(cls.__name__, (_WholeChannels, cls),
                {"__module__": __name__, "__qualname__": f"whole[{cls.__qualname__}]"})


def whole_channels(layer: Layer) -> Layer:
    """A copy of ``layer`` that refuses an input whose channels are split.

    Parameters
    ----------
    layer : Layer
        The layer standing for a traced operation that the compiler does not run on a
        channel split (any but a convolution).

    Returns
    -------
    Layer
        The copy; its work, signature and twin are ``layer``'s.
    """
    new = copy.copy(layer)
    new.__class__ = _whole_class(type(layer))
    return new
