"""Trace a model into the chain of layers (:class:`Node`) and residual blocks (:class:`Block`)
that the planner searches.

A :class:`~disttensor_nn.Sequential` is flattened, a
:class:`~disttensor_nn.Residual` becomes a :class:`Block` of traced chains
(branch, shortcut, post-chain), and every other layer a :class:`Node` with
its input and output shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..container import Residual, Sequential
from ..module import Layer

__all__ = ["Node", "Block", "trace", "leaf_nodes", "spine"]


@dataclass
class Node:
    """One layer of the traced network."""

    name: str
    layer: Layer
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass
class Block:
    """A residual block: ``post(branch(x) + shortcut(x))``."""

    name: str
    branch: list
    shortcut: list | None
    post: list
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def trace(model: Layer, in_shape: tuple[int, ...], prefix: str = "") -> list:
    """Flatten ``model`` into a chain of :class:`Node` and :class:`Block` items."""
    items: list = []
    if isinstance(model, Sequential):
        for i, layer in enumerate(model):
            sub = trace(layer, in_shape, f"{prefix}{i}.")
            items += sub
            in_shape = (sub[-1].out_shape if sub else in_shape)
        return items
    if isinstance(model, Residual):
        branch = trace(model.branch, in_shape, prefix + "branch.")
        mid = model.merged_shape(in_shape)
        shortcut = trace(model.shortcut, in_shape, prefix + "shortcut.") \
            if model.shortcut is not None else None
        post = trace(model.post, mid, prefix + "post.") if model.post is not None else []
        return [Block(prefix.rstrip("."), branch, shortcut, post, tuple(in_shape),
                      model.output_shape(in_shape))]
    out = model.output_shape(in_shape)
    return [Node(prefix.rstrip(".") or type(model).__name__, model, tuple(in_shape), out)]


def leaf_nodes(items: list) -> list[Node]:
    """The :class:`Node` s of a traced chain (:func:`trace`) in network order, blocks opened."""
    out = []
    for it in items:
        if isinstance(it, Node):
            out.append(it)
        else:
            out += leaf_nodes(it.branch) + (leaf_nodes(it.shortcut) if it.shortcut else []) + \
                leaf_nodes(it.post)
    return out


def spine(items: list) -> tuple[list[Node], list[Node]]:
    """The nodes from a chain's input to its output through every block's branch and
    post-chain (in order), and the others (those of the shortcuts)."""
    path: list[Node] = []
    side: list[Node] = []
    for it in items:
        if isinstance(it, Node):
            path.append(it)
            continue
        for part, on in ((it.branch, True), (it.shortcut or [], False), (it.post, True)):
            sp, sd = spine(part)
            (path if on else side).extend(sp)
            side.extend(sd)
    return path, side
