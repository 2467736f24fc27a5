"""Containers that chain layers and insert redistributions between their layouts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from disttensor import DistArray, Distribution

from .layers.elementwise import Add, add_blocks
from .layers.merge import Concat
from .layout import Layout
from .module import Layer, prefetch_weights
from .parameter import Parameter

__all__ = ["Sequential", "Residual", "Skip"]


class Sequential(Layer):
    """Layers applied in order; each may ask for its input in a :class:`Layout`.

    When a layer has ``layout`` set and the incoming activation is laid out
    differently, the activation is redistributed first; the backward pass
    moves the gradient back (the reverse redistribution).

    The layers are the sub-layers ``"0"``, ``"1"``, ... (so state_dict keys
    read ``"0.weight"``); ``model[i]``, ``len(model)`` and ``iter(model)``
    work as for a list, and ``model[a:b]`` is a Sequential of the same layers.
    """

    def __init__(self, *layers: Layer):
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential takes Layers, got a {type(layer).__name__} at {i}")
            self.add_module(str(i), layer)

    def __getitem__(self, i: int | slice) -> Layer:
        """The ``i``-th layer, or a Sequential of the same layer objects for a slice."""
        layers = list(self)
        return Sequential(*layers[i]) if isinstance(i, slice) else layers[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Layer]:
        """The layers in order (a layer given twice comes twice)."""
        return iter(self._modules.values())

    def takes_channels_last(self, dist: Distribution) -> bool:
        """True: each layer takes the blocks as it says (:meth:`Layer.takes_channels_last`)."""
        return True

    def forward(self, x: DistArray) -> DistArray:
        self._moves = moves = []
        layers = list(self)
        for k, layer in enumerate(layers):
            # sharded weights (shard_state "full"): the next layer's gathered meanwhile (read
            # at each layer: a pass may shard a weight that a later layer shares)
            if Parameter.ever_sharded:
                prefetch_weights(layers[k + 1] if k + 1 < len(layers) else None)
            layout = layer.layout
            if layout is None:
                moves.append(None)
            else:
                x, moved_from = _to_layout(x, layout)
                moves.append(moved_from)
            x = layer(x)
        return x

    def backward(self, dy: DistArray) -> DistArray:
        layers = list(self)
        for k, (layer, moved_from) in enumerate(zip(reversed(layers), reversed(self._moves))):
            if Parameter.ever_sharded:
                prefetch_weights(layers[-k - 2] if k + 1 < len(layers) else None, last=True)
            dy = layer.call_backward(dy)
            if dy is None:  # the layer computes no input gradient: nothing flows further back
                return None
            if moved_from is not None:
                dy = dy.redistribute(moved_from)
        return dy

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        for layer in self:
            in_shape = layer.output_shape(in_shape)
        return tuple(in_shape)

    @property
    def reads_grad_only(self) -> bool:  # type: ignore[override]
        """Whether the last layer (the first that backward gives ``dy``) only reads it."""
        layers = list(self)
        return bool(layers) and layers[-1].reads_grad_only

    def set_layouts(self, layouts: Iterable[Layout | None]) -> None:
        """Give every layer its input layout (None: take the input as it comes)."""
        for layer, layout in zip(self, layouts, strict=True):
            layer.layout = layout

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({i}) {layer!r}" for i, layer in enumerate(self))
        return f"Sequential(\n{inner}\n)"


def _to_layout(x: DistArray, layout: Layout | None):
    if layout is None:
        return x, None
    if layout.matches(x.dist):  # same split; derived block boundaries are kept
        return x, None
    return x.redistribute(layout.distribution(x.shape)), x.dist


class Residual(Layer):
    """``post(merge(branch(x), shortcut(x)))``: by default ``branch(x) + shortcut(x)``.

    The shortcut is the identity when None, as in ResNet blocks. The merge
    is :class:`~disttensor_nn.Add` by default, or :class:`~disttensor_nn.Concat`
    (U-Net's skip connections, see :class:`Skip`); it redistributes the
    shortcut's output to the branch's distribution when they differ. The
    input gradient is the sum of both paths' gradients. The sub-layers are
    named ``branch``, ``shortcut`` and ``post``; the planner treats the block
    as one residual edge whatever the merge.
    """

    def __init__(self, branch: Layer, shortcut: Layer | None = None, post: Layer | None = None,
                 *, merge: Add | Concat | None = None):
        self.add_module("branch", branch)
        self.add_module("shortcut", shortcut)
        self.add_module("post", post)
        self._merge = Add() if merge is None else merge

    def merged_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global shape after the merge (the input shape of ``post``)."""
        a = self.branch.output_shape(in_shape)
        if isinstance(self._merge, Add):
            return a
        b = self.shortcut.output_shape(in_shape) if self.shortcut is not None else in_shape
        return self._merge.output_shape(tuple(a), tuple(b))

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        out = self.merged_shape(in_shape)
        return self.post.output_shape(out) if self.post is not None else out

    def takes_channels_last(self, dist: Distribution) -> bool:
        """With an addition (each sub-layer takes the blocks as it says, and the sum keeps
        its operands' layout); not with a concatenation."""
        return isinstance(self._merge, Add)

    def forward(self, x: DistArray) -> DistArray:
        x, self._moved = _to_layout(x, self.layout)
        # the branch's and shortcut's outputs are temporaries: nothing holds them once merged
        y = self._merge(self.branch(x), self.shortcut(x) if self.shortcut is not None else x)
        return self.post(y) if self.post is not None else y

    @property
    def reads_grad_only(self) -> bool:  # type: ignore[override]
        """Whether backward only reads ``dy``: ``post``'s, where there is one; else the
        merge's (a concatenation's copies its parts) or both paths' (an addition's give
        them ``dy``)."""
        if self.post is not None:
            return self.post.reads_grad_only
        return isinstance(self._merge, Concat) or self.branch.reads_grad_only and (
            self.shortcut is None or self.shortcut.reads_grad_only)

    def backward(self, dy: DistArray) -> DistArray:
        if self.post is not None:
            dy = self.post.call_backward(dy)
        # one gradient for both paths where the branch does not write it (the shortcut's
        # is read after the branch ran)
        da, db = self._merge.backward(dy) if isinstance(self._merge, Concat) else \
            self._merge.backward(dy, copy=not self.branch.reads_grad_only)
        dx = self.branch.call_backward(da)
        if self.shortcut is not None:
            db = self.shortcut.call_backward(db)
        if db.dist != dx.dist:
            db = db.redistribute(dx.dist)
        dx = add_blocks(dx, db)
        return dx if self._moved is None else dx.redistribute(self._moved)


class Skip(Residual):
    """U-Net's skip connection: ``post(concatenate([branch(x), x], axis=1))``.

    A :class:`Residual` block whose merge is :class:`~disttensor_nn.Concat`:
    the branch's output channels come first, then the input's. The branch
    usually goes down and back up (pool, the inner levels, an up-convolution)
    and must return the input's spatial size; ``post`` is the decoder that
    reads the concatenation.
    """

    def __init__(self, branch: Layer, post: Layer | None = None):
        super().__init__(branch, None, post, merge=Concat(1))
