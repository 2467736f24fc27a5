"""The Layer base class: the interface of distributed layers, with its calling protocol
(hooks; every pass checked, recorded, and run with the layer's sharded weights gathered)
and its state protocol (registries, state_dict, to, train).

The parameters, layouts, gradient reductions and input checks that used to be defined
here live in :mod:`disttensor_nn.parameter`, :mod:`disttensor_nn.layout`,
:mod:`disttensor_nn.reduction`, :mod:`disttensor_nn.shards` and
:mod:`disttensor_nn.checks`; this module re-exports them under their former names.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import (
    array_namespace,
    as_module,
    astype,
    contiguous,
    device_of,
    is_channels_last,
    is_numpy,
    numpy_dtype,
    reshape,
)

from .checks import check_grad, check_input, check_int, check_kernels, check_kernels_on
from .costspec import CostSpec, largest_block
from .layout import Layout, full_array, local_block, to_memory_format
from .parameter import Parameter
from .reduction import (
    DEFAULT_BUCKET_BYTES,  # noqa: F401 (a former public name outside __all__)
    GradientBuckets,
    allreduce_,  # noqa: F401 (a former public name outside __all__)
    no_sync,
    reduce_gradients_,
    split_axes_comm,
)
from .shards import (  # noqa: F401 (former public names outside __all__)
    gather_shards,
    reduce_scatter_,
    shard_counts,
    shard_range,
)

__all__ = ["Parameter", "Layer", "Layout", "RemovableHandle", "IncompatibleKeys",
           "GradientBuckets", "no_sync", "reduce_gradients_", "split_axes_comm", "check_input",
           "check_grad", "check_int", "check_kernels", "full_array", "local_block",
           "prefetch_weights", "derived"]


_UNCHECKED = ()
"""What a forward call that returned something other than a DistArray records: its
backward gets ``dy`` unchecked."""


_DERIVED_KEPT = 32
"""Results of :func:`derived` methods a layer keeps (the oldest dropped first)."""


def derived(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a :class:`Layer` method whose result follows from the layer's settings and
    its (hashable) arguments alone, a ``Distribution`` say: the result is kept per
    arguments and returned again, until one of the layer's settings is set (an attribute
    whose name does not start with ``_`` and that is not a parameter or a buffer:
    ``training``, ``kernel_backend``, ``filter_axes``...), which drops all it kept.

    For what a layer derives from its input's distribution on every call (the output's
    distribution, the kernels' padding, the weight's splits): a training step calls
    each layer on the same distributions step after step. An exception is not kept:
    the next call raises again. A copy of a layer keeps its own results.

    Examples
    --------
    >>> class Twice(Layer):                             # doctest: +SKIP
    ...     @derived
    ...     def output_distribution(self, dist):
    ...         return dist.replace(global_shape=...)    # computed once per dist
    """
    name = method.__qualname__

    @functools.wraps(method)
    def wrapper(self: Layer, *args: Any) -> Any:
        kept = self.__dict__.get("_derived")
        if kept is None:
            kept = self.__dict__["_derived"] = {}
        key = (name, *args)
        value = kept.get(key, kept)
        if value is kept:
            value = method(self, *args)
            if len(kept) >= _DERIVED_KEPT:
                del kept[next(iter(kept))]
            kept[key] = value
        return value

    return wrapper


def prefetch_weights(layer: Layer | None, last: bool = False) -> None:
    """Start gathering the sharded weights (stage ``"full"``) of the first layer of
    ``layer`` that has parameters of its own (the last with ``last``: the next one of a
    backward pass), to overlap with the layer running now (:meth:`Parameter.prefetch_`).
    Containers call it before each of their layers; collective as the passes are."""
    if not Parameter.ever_sharded:  # nothing to gather anywhere (the common case)
        return
    while layer is not None:
        own = [p for p in layer.__dict__["_parameters"].values() if p is not None]
        if own:
            for p in own:
                p.prefetch_()
            return
        children = [c for c in layer.__dict__["_modules"].values() if c is not None]
        layer = (children[-1] if last else children[0]) if children else None


def _gather_weights(layer: Layer) -> list[Parameter]:
    """Gather the sharded weights of ``layer``'s own parameters for one pass (the
    ``"full"`` stage of :func:`disttensor_nn.optim.shard_state`); those gathered, to drop
    after it. Collective over the ranks that hold their pieces, as every pass."""
    return [p for p in layer.__dict__["_parameters"].values()
            if p is not None and p._held is not None and p.gather_()]


@derived
def _kernels_run(layer: Layer, dtype: np.dtype, device: str) -> bool:
    """:func:`check_kernels` of ``layer`` on ``dtype`` blocks on ``device``; kept once
    passed."""
    check_kernels_on(layer, dtype, device)
    return True


def _channels_last(y: Any) -> Any:
    """A 4-D or 5-D DistArray ``y`` on a channels-last block (a copy where it is not), what
    a layer that took a C-order copy of a channels-last input gives back; anything else
    as it is."""
    if isinstance(y, DistArray) and y.ndim in (4, 5):
        return to_memory_format(y, "channels_last")
    return y


def _recording_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` that remembers its output's distribution and dtype for :func:`check_grad`."""

    @functools.wraps(forward)
    def wrapper(self: Layer, x: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        if d.get("_in_forward"):  # a subclass's forward calling super().forward
            return forward(self, x, *args, **kwargs)
        copied = False
        if isinstance(x, DistArray):
            if is_channels_last(x.local):  # a layer that does not say it runs on
                d["_took_channels_last"] = ok = self.takes_channels_last(x.dist)
                if not ok:  # channels-last blocks gets a C-contiguous copy
                    x = DistArray(contiguous(x.local), x.dist)
                    copied = True
            else:
                d["_took_channels_last"] = False
            if d.get("kernel_backend") not in (None, "numpy"):
                _kernels_run(self, x.dtype, "cpu" if is_numpy(x.xp) else "gpu")
        d["_output"], d["_in_forward"] = None, True
        gathered = _gather_weights(self) if Parameter.ever_sharded else ()
        try:
            y = forward(self, x, *args, **kwargs)
        finally:
            d["_in_forward"] = False
            for p in gathered:
                p.drop_()
        # and its output goes on channels-last, as the layers after it were planned and
        # timed to get it (the input gradient likewise in backward)
        d["_restores"] = copied
        if copied:
            y = _channels_last(y)
        d["_output"] = (y.dist, y.dtype) if isinstance(y, DistArray) else _UNCHECKED
        return y

    return wrapper


def _checked_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` that validates ``dy`` with :func:`check_grad` first."""

    @functools.wraps(backward)
    def wrapper(self: Layer, dy: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        out = d.get("_output")
        if d.get("_in_backward"):
            return backward(self, dy, *args, **kwargs)
        # a gradient on the output's own distribution and dtype passes (the common case,
        # checked first); any other goes through check_grad
        if out is not _UNCHECKED and not (
                isinstance(dy, DistArray) and out is not None and dy.dist is out[0] and
                dy.dtype == out[1]):
            dy = check_grad(dy, out, f"{type(self).__name__}.backward")
        if not d.get("_took_channels_last") and isinstance(dy, DistArray) and \
                is_channels_last(dy.local):  # as its forward's input (see takes_channels_last)
            dy = DistArray(contiguous(dy.local), dy.dist)
        d["_in_backward"] = True
        gathered = _gather_weights(self) if Parameter.ever_sharded else ()
        try:
            dx = backward(self, dy, *args, **kwargs)
            return _channels_last(dx) if d.get("_restores") else dx
        finally:
            d["_in_backward"] = False
            for p in gathered:
                p.drop_()
            for p in d["_parameters"].values():
                if p is not None and p.shard_weights:
                    p.settle_weights_()

    return wrapper


class RemovableHandle:
    """What the ``register_*_hook`` methods of :class:`Layer` return: :meth:`remove` undoes it.

    Also a context manager that removes the hook on exit (as PyTorch's handle).
    """

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Callable[..., Any]]):
        self._hooks = hooks
        self.id = next(self._ids)

    def remove(self) -> None:
        """Unregister the hook (nothing happens the second time)."""
        self._hooks.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class IncompatibleKeys(NamedTuple):
    """Keys that :meth:`Layer.load_state_dict` with ``strict=False`` did not match."""

    missing_keys: list[str]
    """Keys of the layer's state that the given state lacks (left unchanged)."""
    unexpected_keys: list[str]
    """Keys of the given state that the layer does not have (ignored)."""


_REGISTRIES = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks",
               "_backward_pre_hooks", "_backward_hooks")
"""The per-layer dictionaries that :meth:`Layer.__new__` creates."""


_RESERVED = frozenset((
    "forward", "backward", "call_backward", "output_shape", "children", "named_children",
    "modules", "named_modules", "layers", "parameters", "named_parameters", "own_parameters",
    "buffers", "named_buffers", "state_dict", "load_state_dict", "to", "zero_grad", "train",
    "eval", "register_parameter", "register_buffer", "add_module", "register_module",
    "register_forward_pre_hook", "register_forward_hook", "register_full_backward_pre_hook",
    "register_full_backward_hook", "release_saved"))
"""Layer methods of the calling and state protocol: no attribute, parameter, buffer or
sub-layer may take their names (an attribute ``layers`` would hide ``layers()``)."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_name(owner: Layer, name: Any, kind: str, registry: dict[str, Any]) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, got {type(name).__name__}")
    if not name or "." in name:
        raise KeyError(f"{kind} name must be non-empty and contain no '.', got {name!r}")
    if name in _RESERVED:
        raise KeyError(f"{kind} name {name!r} would hide the Layer method {name}()")
    if hasattr(owner, name) and name not in registry:
        raise KeyError(f"attribute {name!r} already exists on {type(owner).__name__}")


def _copy_into(dst: Any, src: Any) -> None:
    """Write ``src`` (an array of any module) into ``dst``, in ``dst``'s module and dtype."""
    src = as_module(src, array_namespace(dst), device_of(dst))
    if numpy_dtype(src.dtype) != numpy_dtype(dst.dtype):
        src = astype(src, dst.dtype)
    dst[...] = src


class Layer:
    """Base class of distributed layers: ``forward(x) -> y`` and ``backward(dy) -> dx``.

    Inputs and outputs are DistArrays; a layer keeps what its backward pass
    needs from the last forward call. ``layout`` (optional) asks the
    containers to redistribute the input to that layout first.

    The state protocol follows ``torch.nn.Module``. Assigning a
    :class:`Parameter` or a Layer to an attribute registers it (in that
    order) as a parameter or a sub-layer; arrays that are state but not
    trained (batch-norm running statistics) are registered with
    :meth:`register_buffer`. From these registries come
    :meth:`named_parameters`, :meth:`named_buffers`, :meth:`named_children`,
    :meth:`named_modules`, :meth:`state_dict` and :meth:`load_state_dict`,
    :meth:`to` and :meth:`train`. A layer author writes only ``__init__``,
    ``forward`` and ``backward`` (and ``output_shape`` where the shape
    changes); calling ``super().__init__()`` is not needed.

    Calling a layer (``layer(x)``) runs :meth:`forward` between the forward
    hooks; :meth:`call_backward` runs :meth:`backward` between the backward
    hooks. Containers call their sub-layers these two ways, so hooks fire for
    every layer of a model.

    Every subclass's ``backward`` checks its ``dy`` first (:func:`check_grad`),
    identically on every rank and before any communication: when the last
    forward call returned a DistArray, ``dy`` must be a DistArray of its
    shape and dtype (else ValueError or TypeError), and one in another
    distribution over the same processes is redistributed to the output's
    distribution. ``backward`` before any successful ``forward`` raises
    RuntimeError. Layer authors get
    this without writing it: the base class wraps the ``forward`` and
    ``backward`` a subclass defines.

    ``input_grad`` (default True) says whether the input gradient is
    wanted. A layer fed data needs none (PyTorch skips the gradient of an
    input that does not require one); with ``input_grad = False`` a layer
    may skip computing it, and its ``backward`` then returns None
    (convolution and pooling layers do; the others ignore the attribute).

    ``kernel_backend`` names the local kernels a layer runs (``"numpy"``,
    ``"torch"``; None: those of its arrays' module, see
    :func:`disttensor_nn.kernels.kernels_for`); ``kernel_backends`` lists
    the backends a layer has kernels in (empty: its arithmetic is the
    array module's whatever the backend). A plan sets it per layer.

    ``activation_dtype`` (None: the parameters' dtype) is the dtype of the
    layer's inputs and outputs when they differ from its parameters' (16-bit
    activations with float32 weights: :func:`disttensor_nn.set_precision`).
    """

    training: bool = True
    layout: Layout | None = None
    input_grad: bool = True
    kernel_backend: str | None = None
    kernel_backends: tuple[str, ...] = ()
    activation_dtype: Any = None
    saved_for_backward: tuple[str, ...] = ()
    """Attributes that ``forward`` sets for ``backward`` (see :meth:`release_saved`)."""
    reads_grad_only: bool = False
    """Whether ``backward`` only reads its incoming gradient (never writes into ``dy``'s
    buffer). A :class:`~disttensor_nn.Residual` whose branch takes the gradient first in
    such a layer gives the same gradient to the branch and the shortcut; otherwise the
    shortcut's is a copy. False unless a layer says so (as PyTorch's autograd functions,
    the built-in convolutions, batch norms and ReLUs leave ``dy`` as it is)."""

    def takes_channels_last(self, dist: Distribution) -> bool:
        """Whether this layer runs on channels-last blocks of an input distributed as
        ``dist`` (:func:`~disttensor.backend.is_channels_last`: ``(N, C, H, W)`` blocks lying
        in memory as ``(N, H, W, C)``, where PyTorch's CPU convolutions run fastest), and
        gives its output and input gradient in the layout of its input and output gradient.

        False here: the calling protocol gives a layer that does not say so a C-contiguous
        copy of such a block (and of such a gradient, when it took its input C-contiguous),
        so that a layer author never meets one unasked, and puts that layer's output and
        input gradient back on channels-last blocks for the layers around it. The torch
        kernels' convolutions, pooling, batch norms and element-wise layers, the residual
        sum, global pooling and the containers say so
        (:func:`~disttensor_nn.layout.to_memory_format` puts a model's input in that layout;
        the planner decides whether it pays).
        """
        return False

    def compute_dtype(self, dtype: Any, backend: str | None = None,
                      device: str = "cpu") -> np.dtype:
        """The dtype this layer computes blocks of ``dtype`` in, with ``backend``'s kernels.

        ``dtype`` itself here (element-wise layers, pooling, merges run 16-bit
        blocks as they are); convolutions run them in 16 bits where the
        backend has such kernels, else in float32 on converted blocks
        (:func:`disttensor_nn.precision.compute_dtype`), and normalisations
        and ``Linear`` always in their parameters' dtype.
        """
        return numpy_dtype(dtype)

    def __init_subclass__(cls, checked: bool = True, **kwargs: Any) -> None:
        """Wrap the subclass's own ``forward`` and ``backward`` in the checks above.

        Parameters
        ----------
        checked : bool
            False (``class Twin(Layer, checked=False)``) leaves them as written: for a
            stand-in that only the kernel timer runs, whose time the checks would
            distort.
        """
        super().__init_subclass__(**kwargs)
        if not checked:
            return
        if inspect.isfunction(cls.__dict__.get("forward")):
            cls.forward = _recording_forward(cls.__dict__["forward"])
        if inspect.isfunction(cls.__dict__.get("backward")):
            cls.backward = _checked_backward(cls.__dict__["backward"])

    def __new__(cls, *args: Any, **kwargs: Any) -> Layer:
        self = super().__new__(cls)
        d = self.__dict__
        for name in _REGISTRIES:
            d[name] = {}
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _RESERVED:
            raise AttributeError(f"{type(self).__name__}.{name} is a Layer method; an "
                                 f"attribute of that name would hide it")
        d = self.__dict__
        params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
        if name[0] == "_" and name not in params and name not in buffers and \
                name not in modules and not isinstance(value, (Parameter, Layer)):
            # per-pass state (``_saved``...): no registry, no setting
            object.__setattr__(self, name, value)
            return
        if isinstance(value, Parameter):
            buffers.pop(name, None)
            modules.pop(name, None)
            params[name] = value
        elif isinstance(value, Layer):
            params.pop(name, None)
            buffers.pop(name, None)
            modules[name] = value
        elif name in params or name in modules:
            if value is not None:
                kind = "Parameter" if name in params else "Layer"
                raise TypeError(f"cannot assign a {type(value).__name__} to {name!r} of "
                                f"{type(self).__name__}: a {kind} or None is expected")
            (params if name in params else modules)[name] = None
        elif name in buffers:
            if value is not None and not hasattr(value, "shape"):
                raise TypeError(f"buffer {name!r} must be an array or None, got "
                                f"{type(value).__name__}")
            buffers[name] = value
        if name[0] != "_" and name not in params and name not in buffers:
            d.pop("_derived", None)  # a setting: what derived methods kept may not hold
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        self.__dict__.pop("_derived", None)
        object.__delattr__(self, name)

    def __copy__(self) -> Layer:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.pop("_derived", None)  # a copy's settings may change apart
        for name in _REGISTRIES:  # a copy registers and hooks on its own
            new.__dict__[name] = dict(self.__dict__[name])
        return new

    # ------------------------------------------------------------ calling
    def forward(self, x: DistArray) -> DistArray:  # pragma: no cover - interface
        """The layer's output for the input ``x``."""
        raise NotImplementedError

    def backward(self, dy: DistArray) -> DistArray:  # pragma: no cover - interface
        """The input gradient for the output gradient ``dy`` (after :meth:`forward`)."""
        raise NotImplementedError

    def release_saved(self) -> None:
        """Drop what :meth:`forward` kept for :meth:`backward` (the activations it saved).

        Only that per-pass state goes; the mode (``training``), ``input_grad``,
        hooks, parameters and buffers stay. :meth:`backward` then needs another
        :meth:`forward` first (what :mod:`disttensor_nn.recompute` runs).
        """
        for name in type(self).saved_for_backward:
            self.__dict__.pop(name, None)

    def __call__(self, x: DistArray) -> DistArray:
        """:meth:`forward` with the forward pre-hooks before and the forward hooks after."""
        d = self.__dict__
        if d["_forward_pre_hooks"]:
            for hook in tuple(d["_forward_pre_hooks"].values()):
                result = hook(self, x)
                if result is not None:
                    x = result
        y = self.forward(x)
        if d["_forward_hooks"]:
            for hook in tuple(d["_forward_hooks"].values()):
                result = hook(self, x, y)
                if result is not None:
                    y = result
        return y

    def call_backward(self, dy: DistArray) -> DistArray:
        """:meth:`backward` with the backward pre-hooks before and the backward hooks after.

        Containers call their sub-layers' backward passes this way; a training
        loop may call ``model.backward(dy)`` (no hooks of the model itself) or
        ``model.call_backward(dy)``.
        """
        d = self.__dict__
        if d["_backward_pre_hooks"]:
            for hook in tuple(d["_backward_pre_hooks"].values()):
                result = hook(self, dy)
                if result is not None:
                    dy = result
        dx = self.backward(dy)
        if d["_backward_hooks"]:
            for hook in tuple(d["_backward_hooks"].values()):
                result = hook(self, dx, dy)
                if result is not None:
                    dx = result
        return dx

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global output shape for a global input shape (element-wise layers keep it)."""
        return tuple(in_shape)

    # ------------------------------------------------------------ hooks
    def register_forward_pre_hook(self, hook: Callable[[Layer, Any], Any]) -> RemovableHandle:
        """Call ``hook(layer, input)`` before every call of the layer.

        A result other than None replaces the input. Returns a handle whose
        ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[[Layer, Any, Any], Any]) -> RemovableHandle:
        """Call ``hook(layer, input, output)`` after every call of the layer.

        A result other than None replaces the output. Returns a handle whose
        ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._forward_hooks, hook)

    def register_full_backward_pre_hook(self, hook: Callable[[Layer, Any], Any]
                                        ) -> RemovableHandle:
        """Call ``hook(layer, grad_output)`` before every :meth:`call_backward`.

        A result other than None replaces ``grad_output``. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._backward_pre_hooks, hook)

    def register_full_backward_hook(self, hook: Callable[[Layer, Any, Any], Any]
                                    ) -> RemovableHandle:
        """Call ``hook(layer, grad_input, grad_output)`` after every :meth:`call_backward`.

        ``grad_input`` is the gradient with respect to the layer's input (what
        :meth:`backward` returned), ``grad_output`` the one it was given. A
        result other than None replaces ``grad_input``. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._backward_hooks, hook)

    @staticmethod
    def _add_hook(hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]
                  ) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"a hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------ registration
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` as the parameter ``name`` (None: registered, but no state)."""
        _check_name(self, name, "parameter", self._parameters)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"parameter {name!r} must be a Parameter or None, got "
                            f"{type(param).__name__}")
        self._parameters[name] = param
        setattr(self, name, param)

    def register_buffer(self, name: str, value: Any) -> None:
        """Register the array ``value`` (any array module, or None) as the buffer ``name``.

        Buffers are state that is not trained, such as batch-norm running
        statistics: they are in :meth:`state_dict` and move with :meth:`to`.
        Later assignments to the attribute ``name`` replace the buffer.
        """
        _check_name(self, name, "buffer", self._buffers)
        if value is not None and not hasattr(value, "shape"):
            raise TypeError(f"buffer {name!r} must be an array or None, got "
                            f"{type(value).__name__}")
        self._buffers[name] = value
        setattr(self, name, value)

    def add_module(self, name: str, module: Layer | None) -> None:
        """Register ``module`` as the sub-layer ``name`` (None: registered, but empty)."""
        _check_name(self, name, "sub-layer", self._modules)
        if module is not None and not isinstance(module, Layer):
            raise TypeError(f"sub-layer {name!r} must be a Layer or None, got "
                            f"{type(module).__name__}")
        self._modules[name] = module
        setattr(self, name, module)

    register_module = add_module

    # ------------------------------------------------------------ walking
    def named_children(self) -> Iterator[tuple[str, Layer]]:
        """(name, layer) of the direct sub-layers, in registration order, each once."""
        seen: set[int] = set()
        for name, child in self._modules.items():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield name, child

    def children(self) -> Iterator[Layer]:
        """Direct sub-layers."""
        for _, child in self.named_children():
            yield child

    def named_modules(self, memo: set[int] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Layer]]:
        """(dotted name, layer) of this layer (named ``prefix``) and all its sub-layers.

        Depth first, in registration order; a layer reachable twice is given
        once unless ``remove_duplicate`` is False.
        """
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(memo, _join(prefix, name), remove_duplicate)

    def modules(self) -> Iterator[Layer]:
        """This layer and all its sub-layers, depth first, each once."""
        for _, layer in self.named_modules():
            yield layer

    layers = modules

    def _named_members(self, registry: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else iter([(prefix, self)])
        for path, layer in modules:
            for name, value in getattr(layer, registry).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield _join(path, name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) of every parameter, such as ``("3.branch.0.weight", p)``.

        A layer's own parameters come before its sub-layers', each layer in
        :meth:`named_modules` order; a shared parameter is given once (under
        its first name) unless ``remove_duplicate`` is False. With
        ``recurse=False`` only this layer's own parameters.
        """
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """The parameters of :meth:`named_parameters`, in the same fixed order."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def own_parameters(self) -> list[Parameter]:
        """Parameters of this layer itself (not its children)."""
        return list(self.parameters(recurse=False))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        """(dotted name, array) of every buffer, such as ``("1.running_mean", a)``."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Any]:
        """The arrays of :meth:`named_buffers`, in the same order."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # ------------------------------------------------------------ state
    def _state_entries(self) -> Iterator[tuple[str, Layer, str, Any]]:
        """(key, owner, attribute, value) of every state_dict entry, in state_dict order."""
        for path, layer in self.named_modules(remove_duplicate=False):
            for registry in (layer._parameters, layer._buffers):
                for name, value in registry.items():
                    if value is not None:
                        yield _join(path, name), layer, name, value

    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Every parameter's and buffer's array under its dotted name, in a fixed order.

        The keys are those of :meth:`named_parameters` and :meth:`named_buffers`
        (a layer's parameters, then its buffers, then its sub-layers'), and a
        shared parameter appears under each of its names, as in PyTorch. The
        values are the arrays themselves, not copies (``Parameter.data``, or
        the Parameter with ``keep_vars=True``); copy them to keep a snapshot.
        A sharded parameter (``Parameter.dist``) is given as its full array,
        gathered from its shards: the call is then collective, and the
        result loads under any other split.

        Parameters
        ----------
        prefix : str
            Put before every key (``prefix + key``).
        keep_vars : bool
            Give parameters as :class:`Parameter` objects instead of their data.

        Returns
        -------
        dict
            Ordered name -> array.
        """
        out: dict[str, Any] = {}
        for key, _, _, value in self._state_entries():
            if isinstance(value, Parameter) and not keep_vars:
                value = value.full()
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True
                        ) -> IncompatibleKeys:
        """Copy arrays (of any array module) into the parameters and buffers, in place.

        Every value is moved to its target's array module and device and cast
        to its dtype. Nothing is changed unless the whole ``state_dict`` is
        accepted: a missing or unexpected key (with ``strict``), a value that is
        not an array or one of another shape raise one ValueError that lists
        them all.

        Parameters
        ----------
        state_dict : mapping of str to array
            As :meth:`state_dict` returns (its values may be Parameters too):
            full arrays, also for sharded parameters, which keep their block
            of it (so a state saved under one split loads under another).
        strict : bool
            Require exactly this layer's keys. With False, missing keys are
            left unchanged and unexpected keys ignored (shapes are still
            checked).

        Returns
        -------
        IncompatibleKeys
            ``(missing_keys, unexpected_keys)``; both empty when ``strict``.

        Raises
        ------
        ValueError
            On a refused ``state_dict``; the layer is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        targets: dict[str, Any] = {}
        for key, _, _, value in self._state_entries():
            targets.setdefault(key, value)
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        problems = []
        if strict and missing:
            problems.append(f"missing keys {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys {unexpected}")
        for key, dst in targets.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            if not hasattr(src, "shape"):
                problems.append(f"{key!r} is a {type(src).__name__}, not an array")
            elif tuple(src.shape) != tuple(dst.shape):  # a Parameter's full shape
                problems.append(f"{key!r} has shape {tuple(src.shape)}, the layer's "
                                f"{tuple(dst.shape)}")
        if problems:
            raise ValueError(f"load_state_dict refused for {type(self).__name__} (nothing "
                             f"changed): " + "; ".join(problems))
        for key, dst in targets.items():
            if key in state_dict:
                src = state_dict[key]
                src = src.full() if isinstance(src, Parameter) else src
                if isinstance(dst, Parameter):
                    if dst.dist is not None:  # this rank's block of the full value
                        src = src[dst.dist.local_slices()]
                    if dst.sharded_weights and dst._data is None:  # this rank's piece of it
                        dst._finish_prefetch()
                        h = dst._held
                        src = reshape(as_module(src, array_namespace(dst.piece),
                                                device_of(dst.piece)), (-1,))[h.start:h.stop]
                        dst = dst.piece
                    else:
                        dst = dst.data
                _copy_into(dst, src)
        return IncompatibleKeys(missing if not strict else [],
                                unexpected if not strict else [])

    def to(self, xp: ModuleType, device: Any = None) -> Layer:
        """Move every parameter (data and gradient) and buffer to the array module ``xp``.

        Layers compute with their input's array module, and their parameters
        must live there too: call ``model.to(cupy)`` before feeding the model
        DistArrays whose blocks are CuPy arrays (``model.to(numpy)`` brings it
        back). Arrays already there are kept as they are. An optimiser's
        momentum buffers follow on its next step only if it has none yet, so
        move the model before creating the optimiser.

        Parameters
        ----------
        xp : module
            The target array module (``numpy``, ``cupy``, ``array_api_strict``...).
        device : optional
            The device of array API namespaces that have several (None: the
            module's default).

        Returns
        -------
        Layer
            This layer itself.
        """
        for p in self.parameters():
            if p.sharded_weights:
                p._finish_prefetch()
                p.piece = as_module(p.piece, xp, device)
                if p._data is not None:
                    p._data = as_module(p._data, xp, device)
            else:
                p.data = as_module(p.data, xp, device)
            p.grad = as_module(p.grad, xp, device)
            if p.unreduced is not None:
                p.unreduced = as_module(p.unreduced, xp, device)
        for layer in self.modules():
            for name, value in layer._buffers.items():
                if value is not None:
                    setattr(layer, name, as_module(value, xp, device))
        return self

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> Layer:
        """Training mode (batch statistics) or, with ``mode=False``, evaluation mode."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode) takes a bool, got {type(mode).__name__}")
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> Layer:
        """Evaluation mode."""
        return self.train(False)

    # ------------------------------------------------------------ cost model
    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """What the planner's cost model needs of this layer on an input split as ``dist``.

        The default describes a local element-wise layer: one FLOP per
        element of the largest block, which is read and written once; the
        input is kept for backward; no communication. Layers that do other
        work or keep something else override it (see
        :mod:`disttensor_nn.costspec`).

        Parameters
        ----------
        dist : Distribution
            The global input's distribution, pure (built on a grid shape, no
            communicator): the planner asks for every candidate.
        itemsize : int
            Bytes per activation element.

        Returns
        -------
        CostSpec
            The work on the largest local block, per training iteration.
        """
        block = largest_block(dist)
        n = math.prod(block)
        return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize, keeps_input=True)

    def kernel_signature(self) -> str:
        """What determines this layer's local kernel time besides the input: the timer's cache key.

        Two layers with the same signature take the same time on the same
        local input shape and dtype. The default is the class name (right for
        layers without parameters or options that change their work).
        """
        return type(self).__name__

    def local_twin(self) -> Layer:
        """A 1-process copy that does the same local work, for timing the kernels.

        The twin runs on the halo-extended local block on a 1-process grid,
        so window layers drop their padding, and it has its own parameters
        and statistics, so timing never changes this layer's. The default is
        a shallow copy with copies of this layer's own parameters and buffers,
        and twins of its sub-layers.
        """
        twin = copy.copy(self)
        for name, child in self._modules.items():
            if child is not None:
                setattr(twin, name, child.local_twin())
        for name, p in self._parameters.items():
            if p is not None:
                setattr(twin, name, Parameter(contiguous(p.data, copy=True)))
        for name, b in self._buffers.items():
            if b is not None:
                setattr(twin, name, contiguous(b, copy=True))
        return twin
