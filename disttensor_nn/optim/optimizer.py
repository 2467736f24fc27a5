"""The base of the optimizers: parameters, hyper-parameters, per-parameter state that follows
the parameters' splits and array modules, and whole (unsharded) state dictionaries."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from disttensor.backend import (
    array_namespace,
    as_module,
    contiguous,
    device_of,
    reshape,
    to_numpy,
)

from ..kernels import check_backend
from ..kernels.numpy_kernels import run_split
from ..layout import full_array, local_block
from ..parameter import Parameter
from ..shards import gather_shards, shard_range

__all__ = ["Optimizer", "STAGES", "add_scaled_", "by_chunks"]

STAGES = ("none", "optimizer", "gradients", "full")
"""The stages of sharded parameter state (:func:`disttensor_nn.optim.shard_state`)."""


class _Shard(NamedTuple):
    """The piece ``[start, stop)`` of a parameter's flat local block (``size`` elements,
    of ``shape``) whose state this rank keeps, over the ranks of ``comm``."""

    comm: MPI.Intracomm
    start: int
    stop: int
    size: int
    shape: tuple[int, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shard) and self.comm == other.comm and \
            (self.start, self.stop, self.size, self.shape) == \
            (other.start, other.stop, other.size, other.shape)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


class _Piece:
    """What an optimizer's ``_update`` sees of a parameter under sharded state: flat
    views of this rank's piece of its data and gradient."""

    __slots__ = ("data", "grad", "dist", "unreduced")

    def __init__(self, data: Any, grad: Any):
        self.data, self.grad, self.dist, self.unreduced = data, grad, None, None


def _flat(a: Any) -> Any:
    return reshape(a, (-1,))


def _whole_piece(a: Any, shard: _Shard) -> Any:
    """The local block (of ``shard.shape``) whose piece ``a`` is (collective)."""
    return reshape(gather_shards(a, shard.comm, shard.size), shard.shape)


def _like(ref: Any, buf: Any) -> Any:
    """A copy of ``buf`` in the array module and on the device of ``ref``."""
    moved = as_module(buf, array_namespace(ref), device_of(ref))
    return contiguous(moved, copy=True) if moved is buf else moved


CHUNK = 2**17
"""Elements per piece in which :func:`by_chunks` runs NumPy arrays (a few pieces fit a core's
cache). SGD with momentum over 16.6 M float32 parameters, one thread: 26.3 ms in pieces of
2**15, 24.6 ms of 2**17, 33.7 ms of 2**19; two threads: 27.9, 17.7 and 26.2 ms (small
pieces leave the GIL little time released)."""


def by_chunks(fn: Callable[..., None], *arrays: Any) -> None:
    """``fn(*pieces, scratch)`` over matching flat pieces of ``arrays``, updated in place.

    For NumPy arrays, contiguous and of one shape and dtype, the pieces are
    ``CHUNK`` elements long and ``scratch`` a buffer of a piece's size, so
    that an update of several passes reads and writes each array once while
    a piece is in cache, and makes no temporary of the arrays' size (one is
    mapped afresh and faulted in at every step). The pieces are shared out in
    contiguous runs over the NumPy kernels' threads
    (:func:`disttensor_nn.kernels.numpy_kernels.run_split`), each run with a
    scratch of its own, so ``fn`` must touch nothing but its pieces.
    Otherwise ``fn`` runs once on the whole arrays with ``scratch`` None.
    """
    first = arrays[0]
    if not isinstance(first, np.ndarray) or first.size <= CHUNK or not all(
            isinstance(a, np.ndarray) and a.flags.c_contiguous and a.shape == first.shape
            and a.dtype == first.dtype for a in arrays):
        fn(*arrays, None)
        return
    flat = [a.reshape(-1) for a in arrays]

    def run(start: int, stop: int) -> None:
        scratch = np.empty(min(CHUNK, stop - start), first.dtype)
        for i in range(start, stop, CHUNK):
            n = min(CHUNK, stop - i)
            fn(*(a[i:i + n] for a in flat), scratch[:n])

    run_split(run, first.size, CHUNK)


def _scaled(scratch: Any | None, x: Any, alpha: float) -> Any:
    """``alpha * x``, written into ``scratch`` where there is one."""
    return alpha * x if scratch is None else np.multiply(x, alpha, out=scratch)


def add_scaled_(y: Any, x: Any, alpha: float) -> Any:
    """``y += alpha * x`` in place (:func:`by_chunks`), and ``y``."""
    def axpy(y: Any, x: Any, scratch: Any | None) -> None:
        y += _scaled(scratch, x, alpha)

    by_chunks(axpy, y, x)
    return y


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _map_arrays(entry: Any, fn: Callable[[Any], Any]) -> Any:
    """``entry`` (None, an array or a dict of arrays and numbers) with ``fn`` applied to its
    arrays."""
    if entry is None:
        return None
    if isinstance(entry, Mapping):
        return {k: fn(v) if _is_array(v) else v for k, v in entry.items()}
    return fn(entry)


def _arrays(entry: Any) -> list[Any]:
    if entry is None:
        return []
    if isinstance(entry, Mapping):
        return [v for v in entry.values() if _is_array(v)]
    return [entry]


def check_number(name: str, value: Any, low: float = 0.0, *, strict: bool = False,
                 high: float | None = None, high_strict: bool = True) -> float:
    """``value`` as a float, or a ValueError naming ``name`` when it is not a real number in
    range (``>= low``, or ``> low`` when ``strict``; ``< high`` or ``<= high``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    bad = value != value or value < low or (strict and value == low)
    if high is not None:
        bad = bad or value > high or (high_strict and value == high)
    if bad:
        rng = f"{'>' if strict else '>='} {low:g}"
        if high is not None:
            rng += f" and {'<' if high_strict else '<='} {high:g}"
        raise ValueError(f"{name} must be {rng}, got {value!r}")
    return value


class Optimizer:
    """The base of :class:`SGD`, :class:`Adam` and :class:`AdamW`, as ``torch.optim.Optimizer``
    for one parameter group.

    ``params`` is the list of parameters and ``param_groups`` holds one
    dictionary (``"params"`` and the hyper-parameters, such as ``"lr"``) that
    learning-rate schedulers (:mod:`disttensor_nn.optim.lr_scheduler`) read
    and change; the hyper-parameters are also attributes (``opt.lr``).
    ``state[i]`` is the state of ``params[i]`` (None before its first step):
    arrays in the parameter's array module, on its device, and of its local
    shape. A sharded parameter's (``Parameter.dist``) state is sharded the
    same way and follows the parameter when a layer re-splits it, or moves it
    to another array module.

    Gradients of replicated parameters are already summed over ranks by the
    layers' backward passes, so every rank applies the same update and the
    parameters stay identical without further communication.

    :func:`~disttensor_nn.optim.shard_state` (``shard_stage``) shards the
    state over the ranks that replicate each parameter: ``state[i]`` then
    holds flat arrays of this rank's piece of the parameter's elements
    (``_update`` runs on that piece), and :meth:`step` all-gathers the
    updated pieces.

    :attr:`kernel_backend` names the kernels of the update (None: the
    arrays' module's; ``"torch"``: PyTorch's element-wise kernels on NumPy
    parameters, shared zero-copy and spread over PyTorch's intra-op threads,
    where the optimizer has them).

    Subclasses give ``_saved`` (the hyper-parameters that :meth:`state_dict`
    stores) and ``_update(i, p)``; the constructor validates every
    hyper-parameter before anything is kept.
    """

    _saved: tuple[str, ...] = ("lr",)
    _kernel_backend: str | None = None

    @property
    def kernel_backend(self) -> str | None:
        """The update's kernels: None (the arrays' module's) or ``"torch"``.

        Setting it validates the name first (ValueError for an unknown one,
        ImportError naming the extra for ``"torch"`` without PyTorch).
        """
        return self._kernel_backend

    @kernel_backend.setter
    def kernel_backend(self, name: str | None) -> None:
        self._kernel_backend = None if check_backend(name) == "numpy" else name

    def __init__(self, params: Iterable[Parameter], defaults: dict[str, Any]):
        if isinstance(params, Parameter):
            raise TypeError(f"{type(self).__name__}: params must be an iterable of "
                            "Parameters, got one Parameter (wrap it in a list)")
        params = list(params)
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError(f"{type(self).__name__}: params must be Parameters, got a "
                                f"{type(p).__name__}")
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in params")
        self.params: list[Parameter] = params
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = [{"params": self.params, **defaults}]
        self.state: list[Any] = [None] * len(self.params)
        self._dists: list[Any] = [p.dist for p in self.params]  # the state's splits
        self.shard_stage = "none"  # disttensor_nn.optim.shard_state
        self.shard_comm: MPI.Intracomm | None = None
        self._shards: list[_Shard | None] = [None] * len(self.params)  # the state's pieces

    def __getattr__(self, name: str) -> Any:
        # the hyper-parameters of the (one) group: opt.lr is param_groups[0]["lr"]
        groups = self.__dict__.get("param_groups")
        if groups and name in groups[0] and name != "params":
            return groups[0][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        groups = self.__dict__.get("param_groups")
        if groups and name in groups[0] and name != "params":
            groups[0][name] = value
        else:
            super().__setattr__(name, value)

    # ---------------------------------------------------------------- stepping
    def step(self) -> None:
        """Update every parameter from its gradient.

        Raises
        ------
        RuntimeError
            When gradient parts kept back by :func:`~disttensor_nn.no_sync`
            have not been reduced by a backward pass outside it (the update
            would use gradients that differ from rank to rank). Nothing is
            updated then.
        """
        name = type(self).__name__
        if any(p.unreduced is not None for p in self.params):
            raise RuntimeError(f"{name}.step: gradients accumulated under no_sync are not "
                               "reduced yet; run the last micro-batch's backward outside no_sync")
        if self.lr < 0:
            raise ValueError(f"{name}.step: lr must be >= 0, got {self.lr!r}")
        for i, p in enumerate(self.params):
            if self.shard_stage == "none" and self._shards[i] is None \
                    and p.grad_range is None and not p.sharded_weights:
                self._follow(i, p)
                self._update(i, p)
            else:
                self._sharded_update(i, p)

    def _shard_of(self, p: Parameter) -> _Shard | None:
        """The piece of ``p`` whose state this rank keeps (None: all of it)."""
        comm = p.grad_comm if p.grad_comm is not None else self.shard_comm
        if self.shard_stage == "none" or comm is None or comm.size == 1:
            return None
        size = p.local_size
        start, stop = shard_range(size, comm.size, comm.rank)
        return _Shard(comm, start, stop, size, p.local_shape)

    def _sharded_update(self, i: int, p: Parameter) -> None:
        """Update this rank's piece of ``p`` and all-gather the pieces (see shard_state);
        under ``"full"`` keep only the updated piece of the weights."""
        shard, old = self._shard_of(p), self._shards[i]
        held = p._held
        if held is not None and (shard is None or self.shard_stage != "full" or
                                 (held.comm, held.start, held.stop) !=
                                 (shard.comm, shard.start, shard.stop)):
            p.unshard_weights_()  # whole weights again (collective)
            held = None
        if old is not None and (shard != old or self._dists[i] != p.dist):
            # the state as the local block, gathered over the ranks that kept it
            self.state[i] = _map_arrays(self.state[i], lambda a: _whole_piece(a, old))
            self._shards[i] = None
        self._follow(i, p)
        if p.grad_range is not None and (shard is None or p.grad_range
                                         != (shard.start, shard.stop)):
            p.grad = reshape(gather_shards(p.grad, p.grad_comm, p.local_size), p.local_shape)
            p.grad_range = None
        if shard is None:
            self._update(i, p)
            return
        if self._shards[i] is None:  # keep this rank's piece of the state
            self.state[i] = _map_arrays(self.state[i], lambda a: contiguous(
                _flat(a)[shard.start:shard.stop], copy=True))
            self._shards[i] = shard
        grad = p.grad if p.grad_range is not None else _flat(p.grad)[shard.start:shard.stop]
        if held is not None:  # the weights' piece alone, updated in place
            p._finish_prefetch()  # a gather started ahead reads the piece: done first
            self._update(i, _Piece(p.piece, grad))  # type: ignore[arg-type]
            return
        flat = _flat(p.data)
        piece = _Piece(flat[shard.start:shard.stop], grad)
        self._update(i, piece)  # type: ignore[arg-type]
        if self.shard_stage == "full":  # keep the piece, drop the block
            p.release_(shard.comm, shard.start, shard.stop)
        else:
            gather_shards(piece.data, shard.comm, shard.size, out=flat)

    def _follow(self, i: int, p: Parameter) -> None:
        """Re-split and move ``state[i]`` as ``p`` was (collective when ``p`` is sharded)."""
        entry = self.state[i]
        if entry is None:
            self._dists[i] = p.dist
            return
        if self._dists[i] != p.dist:  # the layer re-split p
            old, new = self._dists[i], p.dist
            entry = _map_arrays(entry, lambda a: local_block(full_array(a, old), new))
        self._dists[i] = p.dist
        like = p.like
        if type(entry) is not type(like) and any(  # (one array type: one module)
                array_namespace(a) is not array_namespace(like)
                for a in _arrays(entry)):  # the model moved
            entry = _map_arrays(entry, lambda a: _like(like, a))
        self.state[i] = entry

    def _update(self, i: int, p: Parameter) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        for p in self.params:
            p.zero_grad()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The per-parameter state (NumPy copies, by parameter order) and hyper-parameters.

        ``state[i]`` is the state of ``params[i]`` (None before its first
        step), copied to host memory whatever module the parameters use, so
        that checkpoints can store it. The state of sharded parameters, and
        state sharded by :func:`~disttensor_nn.optim.shard_state`, is given
        whole (gathered: the call is then collective), with the keys and
        shapes of the unsharded state, so that it loads under any other split,
        stage or rank count.
        """
        def whole(d: Any, shard: _Shard | None) -> Callable[[Any], np.ndarray]:
            def one(a: Any) -> np.ndarray:
                if shard is not None:
                    a = _whole_piece(a, shard)
                return np.array(to_numpy(full_array(a, d)), copy=True)
            return one
        out: dict[str, Any] = {"state": [_map_arrays(s, whole(d, sh)) for s, d, sh
                                         in zip(self.state, self._dists, self._shards)]}
        for k in self._saved:
            v = self.param_groups[0][k]
            out[k] = tuple(v) if isinstance(v, tuple) else v
        return out

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError (nothing changed) when ``state`` cannot be loaded.

        It must be a :meth:`state_dict` of this class: the hyper-parameters
        it stores, and one entry per parameter of the parameter's full shape.
        """
        name = type(self).__name__
        if not isinstance(state, Mapping) or "state" not in state:
            raise ValueError(f"{name}.load_state_dict: not a state dictionary of an optimizer")
        missing = [k for k in self._saved if k not in state]
        if missing:
            raise ValueError(f"{name}.load_state_dict: the state lacks {missing} (it was saved "
                             "by another optimizer)")
        self._check_hyper({k: state[k] for k in self._saved})
        entries = state["state"]
        if not isinstance(entries, (list, tuple)) or len(entries) != len(self.params):
            n = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
            raise ValueError(f"{name}.load_state_dict: the state is for {n} parameters, the "
                             f"optimizer has {len(self.params)}")
        for i, (e, p) in enumerate(zip(entries, self.params)):
            self._check_entry(i, e, p, state)

    def _check_entry(self, i: int, entry: Any, p: Parameter, state: Mapping[str, Any]) -> None:
        """Raise ValueError when ``entry`` (of ``state``) is not a state of ``p``."""
        for a in _arrays(entry):
            if tuple(np.shape(a)) != tuple(p.shape):
                raise ValueError(f"{type(self).__name__}.load_state_dict: state {i} has shape "
                                 f"{tuple(np.shape(a))}, its parameter {tuple(p.shape)}")

    def _check_hyper(self, hyper: dict[str, Any]) -> None:
        """Raise for hyper-parameters out of range (the constructor's checks)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (arrays go to their parameters' array module).

        Whole arrays; a sharded parameter keeps its block of its state.
        Checked first (:meth:`check_state_dict`): a state that does not fit
        raises ValueError and changes nothing.
        """
        self.check_state_dict(state)

        def block(p: Parameter) -> Callable[[Any], Any]:
            return lambda b: _like(p.like, np.asarray(b) if p.dist is None
                                   else np.asarray(b)[p.dist.local_slices()])
        self.state = [_map_arrays(dict(e) if isinstance(e, Mapping) else e, block(p))
                      for p, e in zip(self.params, state["state"])]
        self._dists = [p.dist for p in self.params]
        self._shards = [None] * len(self.params)  # pieces taken at the next step
        for k in self._saved:
            v = state[k]
            self.param_groups[0][k] = tuple(v) if isinstance(v, list) else v

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={v!r}" for k, v in self.param_groups[0].items()
                          if k not in ("params", "initial_lr"))
        return f"{type(self).__name__}({len(self.params)} parameters, {hyper})"
