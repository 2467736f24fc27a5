"""Library options, and the collective-consistency check mode.

The classic MPI deadlock is one rank passing a different argument to a
collective call than the others (a rank-dependent shape, root, axis, halo
width, index or target distribution): the ranks then post different
messages and wait for each other forever, or, worse, exchange the wrong
data. In *check mode* every collective entry point of disttensor (the
functions decorated with :func:`collective`) first gathers a description of
its arguments from every rank of the communicator and compares them; if
any differs, every rank raises the same :class:`CollectiveMismatchError`,
naming the function, the argument and the two values. This is the spirit
of PETSc's debug checks and of MPI correctness tools, at the level of the
library's own calls.

Check mode is off by default and costs one flag test per call then; on, it
costs one small ``allgather`` per outermost collective call (calls made
from inside another checked call are not checked again). Turn it on with
:func:`set_options` (``check_collective=True``), for a block of code with
:func:`options`, or for a whole launch with the environment variable
``DISTTENSOR_CHECK_COLLECTIVE=1``, read once at import. Set it alike on
every rank.

What is compared: metadata, never the data. A DistArray is described by its
global shape, dtype and distribution, a Distribution and a ProcessGrid by
their repr, a NumPy (or other local) array by shape and dtype (and its
values when it has at most 32 elements: indices and fill values are small),
numbers, strings, slices and None by value, containers element by element,
an object whose class defines ``__collective_repr__(self)`` by the text it
returns (a :class:`disttensor.random.Generator` by its seed and how many
arrays it has drawn), and other objects by their class.
Arguments that legitimately differ between ranks (a local block, the array
of a non-root rank) are left out by each entry point. The same message also
carries the per-process options that change the course of a collective (the
implicit-redistribution switch of :mod:`disttensor.ops`), so that one rank
with another setting raises with the others instead of moving data alone.

**One agreement before any rank raises.** Validation that runs on one rank
only can fail on that rank only: an argument valid on one rank and not on
another, say. In check mode such validation is agreed collectively: the
argument digest and this rank's verdict (None, or the exception its own
validation raised) travel in the one ``allgather`` of :func:`check_arguments`,
and every rank then raises the same error, of the same type and with the same
message. Where the arguments differ, that is the
:class:`CollectiveMismatchError` naming the argument and both values; where
they agree and validation failed on some ranks only, it is the first failing
rank's exception, naming the ranks that raised it. Entry points decorated with
:func:`collective` can pass their validation as ``check=``; other validation
blocks run inside :class:`validating`.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

__all__ = [
    "CollectiveMismatchError",
    "check_arguments",
    "collective",
    "get_options",
    "options",
    "set_options",
    "track_option",
    "validating",
]

ENV_CHECK = "DISTTENSOR_CHECK_COLLECTIVE"

F = TypeVar("F", bound=Callable[..., Any])


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected 0 or 1")


_check = _env_flag(ENV_CHECK)
_pool_bytes = 2**24  # buffer_pool_bytes
_nesting = threading.local()
_SMALL = 32  # local arrays up to this many elements are compared by value
_SHOWN = 160  # characters of a value shown in a mismatch message
# per-process options that change the course of a collective: compared with the arguments
_tracked_options: dict[str, Callable[[], Any]] = {}


def track_option(name: str, getter: Callable[[], Any]) -> None:
    """Compare the option ``name`` (its value is ``getter()``) in every check-mode agreement.

    For per-process switches that change which messages a collective posts
    (such as :func:`disttensor.ops.set_implicit_redistribution`): with check
    mode on, a rank whose value differs raises with every other rank, naming
    the option and both values, instead of entering another collective.

    Parameters
    ----------
    name : str
        The option, as messages name it.
    getter : callable
        Returns the option's current value (a bool, number or string).
    """
    _tracked_options[str(name)] = getter


class CollectiveMismatchError(ValueError):
    """Ranks passed different arguments to one collective call (check mode only).

    Raised on every rank of the communicator with the same message, which
    names the function, the first argument that differs, and its value on
    rank 0 and on the first rank that differs from it.
    """


def get_options() -> dict[str, Any]:
    """The current options, as a dict (``{"check_collective": bool, "buffer_pool_bytes": int}``)."""
    return {"check_collective": _check, "buffer_pool_bytes": _pool_bytes}


def set_options(*, check_collective: bool | None = None,
                buffer_pool_bytes: int | None = None) -> dict[str, Any]:
    """Change options; returns the previous ones (the form :func:`get_options` gives).

    Parameters
    ----------
    check_collective : bool, optional
        Check mode (see the module docstring): every collective entry point
        compares its arguments across the communicator first. ``None``
        leaves it as it is. Set it alike on every rank.
    buffer_pool_bytes : int, optional
        The most bytes of message and scratch buffers that halo exchanges,
        redistributions and reductions keep for reuse, per array module
        (default 16 MiB). Buffers are kept least recently used first out; a
        buffer larger than the cap is freed after use. 0 keeps none.
        ``None`` leaves it as it is.

    Returns
    -------
    dict
        The options before the change; ``set_options(**previous)`` restores them.

    Raises
    ------
    TypeError
        If ``check_collective`` is not a bool.
    """
    global _check, _pool_bytes
    if check_collective is not None and not isinstance(check_collective, (bool, np.bool_)):
        raise TypeError(f"check_collective must be a bool, got {check_collective!r}")
    if buffer_pool_bytes is not None and (
            isinstance(buffer_pool_bytes, (bool, np.bool_)) or
            not isinstance(buffer_pool_bytes, (int, np.integer)) or buffer_pool_bytes < 0):
        raise ValueError(f"buffer_pool_bytes must be an integer >= 0, got {buffer_pool_bytes!r}")
    previous = get_options()
    if check_collective is not None:
        _check = bool(check_collective)
    if buffer_pool_bytes is not None:
        _pool_bytes = int(buffer_pool_bytes)
    return previous


@contextmanager
def options(*, check_collective: bool | None = None,
            buffer_pool_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Context manager form of :func:`set_options`, like :func:`numpy.errstate`.

    Examples
    --------
    >>> import disttensor as dt
    >>> with dt.options(check_collective=True):   # doctest: +SKIP
    ...     y = x.redistribute(target)   # CollectiveMismatchError if target differs by rank
    """
    previous = set_options(check_collective=check_collective,
                           buffer_pool_bytes=buffer_pool_bytes)
    try:
        yield get_options()
    finally:
        set_options(**previous)


# ---------------------------------------------------------------- descriptions
# Duck-typed, so that every module of the package (grid and distribution included) can
# use this one without an import cycle.
def _is_distribution(value: Any) -> bool:
    return hasattr(value, "global_shape") and hasattr(value, "grid_shape")


def _describe(value: Any, depth: int = 0) -> str:
    """A rank-independent text for ``value`` that equal arguments share (metadata only)."""
    if value is None or value is Ellipsis or isinstance(
        value, (bool, int, float, complex, str, bytes, np.generic, np.dtype)
    ):
        return repr(value)
    if isinstance(value, type) or inspect.isroutine(value) or inspect.ismodule(value):
        name = getattr(value, "__qualname__", value.__name__)
        return f"{getattr(value, '__module__', '')}.{name}"
    if isinstance(value, slice):
        return f"slice({value.start!r}, {value.stop!r}, {value.step!r})"
    if isinstance(value, MPI.Comm):
        return f"{type(value).__name__}(size={value.Get_size()})"
    if _is_distribution(value) or (isinstance(getattr(value, "comm", None), MPI.Comm)
                                   and type(value).__repr__ is not object.__repr__):
        return repr(value)  # Distribution, ProcessGrid, DistArray: metadata-only reprs
    src, dst = getattr(value, "src", None), getattr(value, "dst", None)
    if _is_distribution(src) and _is_distribution(dst):  # a redistribution plan
        return f"{type(value).__name__}({src!r} -> {dst!r})"
    dist = getattr(value, "dist", None)
    if _is_distribution(dist):  # a halo plan
        return (f"{type(value).__name__}({dist!r}, widths={getattr(value, 'widths', None)!r}, "
                f"mode={getattr(value, 'mode', None)!r})")
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a local array of any module
        shape = tuple(value.shape)
        if int(np.prod(shape)) <= _SMALL and isinstance(value, np.ndarray):
            # the shape first: a long value is cut short in messages
            return f"array(shape={shape}, dtype={value.dtype}, values={value.tolist()!r})"
        return f"array(shape={shape}, dtype={value.dtype})"
    if depth < 4 and isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v, depth + 1) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if depth < 4 and isinstance(value, Mapping):
        items = sorted((str(k), _describe(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, np.ufunc):
        return f"ufunc {value.__name__}"
    own = getattr(type(value), "__collective_repr__", None)
    if own is not None:  # an object that says what every rank must hold alike (a Generator)
        return str(own(value))
    return type(value).__qualname__  # other objects: their type only


def _comm_of(value: Any, depth: int = 0) -> MPI.Comm | None:
    """The communicator ``value`` lives on (a DistArray, Distribution, grid, plan...), if any."""
    if isinstance(value, MPI.Comm):
        return value
    comm = getattr(value, "comm", None)  # DistArray, ProcessGrid, redistribution plan
    if isinstance(comm, MPI.Comm):
        return comm
    if _is_distribution(value):
        return None if value.grid is None else value.grid.comm
    dist = getattr(value, "dist", None)  # a halo plan
    if _is_distribution(dist) and dist.grid is not None:
        return dist.grid.comm
    if depth < 2 and isinstance(value, (tuple, list)):
        values = value
    elif depth < 2 and isinstance(value, Mapping):
        values = list(value.values())
    else:
        return None
    for v in values:
        comm = _comm_of(v, depth + 1)
        if comm is not None:
            return comm
    return None


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _verdict_of(error: BaseException | None) -> tuple[Any, str, str] | None:
    """This rank's verdict as plain data: None, or (the class pickled, its name, the message).

    The class travels pickled (by reference) only when every rank can rebuild
    the exception from it and a message; otherwise None, and the other ranks
    raise a :class:`CollectiveMismatchError` that names the class instead.
    """
    if error is None:
        return None
    cls = type(error)
    message = str(error)
    try:
        payload: Any = pickle.dumps(cls)
        if str(cls(message)) != message:  # KeyError quotes, OSError reorders: not rebuilt as is
            payload = None
    except Exception:  # a local class, or one whose constructor wants more than a message
        payload = None
    return payload, f"{cls.__module__}.{cls.__qualname__}", message


def _agreed_error(verdicts: list[Any], own: BaseException | None) -> BaseException | None:
    """The one error every rank raises for the gathered ``verdicts`` (None: none failed)."""
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not failed:
        return None
    rank, (payload, typename, message) = failed[0]
    ranks = [r for r, _ in failed]
    if len(failed) < len(verdicts):
        accepted = [r for r in range(len(verdicts)) if r not in ranks]
        message = (f"{message} (raised on rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))} only; rank{'s' if len(accepted) > 1 else ''} "
                   f"{', '.join(map(str, accepted))} accepted the same arguments)")
    elif any(v[1:] != (typename, message) for _, v in failed):
        message = f"{message} (on rank {rank}; the ranks' errors differ)"
    if own is not None and _verdict_of(own) == (payload, typename, message):
        return own  # this rank's own error, raised unchanged (with its traceback)
    if payload is not None:
        return pickle.loads(payload)(message)  # noqa: S301  (a class pickled by this library)
    return CollectiveMismatchError(f"{typename}: {message}")


def check_arguments(name: str, arguments: Mapping[str, Any], comm: MPI.Comm | None = None,
                    error: BaseException | None = None) -> None:
    """Agree on a call's arguments and on its validation; raise alike on every rank.

    The one agreement of check mode, behind :func:`collective` and
    :class:`validating`, for entry points that check by hand. One
    ``allgather`` carries this rank's description of ``arguments`` (and of
    the options registered with :func:`track_option`) together with its
    verdict ``error``; then every rank raises the same error:

    * :class:`CollectiveMismatchError` when the ranks are in different
      calls, or pass a different argument (naming it and the values of rank 0
      and of the first rank that differs), or have a different option;
    * otherwise, when validation failed on some rank, the exception of the
      lowest such rank, of its class and with its message (which names the
      ranks that raised it when others did not).

    Collective over ``comm`` (by default the communicator of the first
    argument that has one, else ``COMM_WORLD``), whether or not check mode
    is on. On a single process nothing is sent, and ``error`` is raised as it is.

    Parameters
    ----------
    name : str
        The call, as the message names it.
    arguments : mapping
        Argument names to values.
    comm : mpi4py.MPI.Comm, optional
        The communicator of the call.
    error : BaseException, optional
        This rank's verdict: the exception its own validation of the call
        raised, or None when the arguments passed it.

    Raises
    ------
    CollectiveMismatchError
        On every rank, when the ranks' calls, arguments or options differ.
    Exception
        On every rank, the agreed validation error (see above).
    """
    if comm is None:
        comm = next((c for c in map(_comm_of, arguments.values()) if c is not None),
                    MPI.COMM_WORLD)
    if comm.Get_size() == 1:
        if error is not None:
            raise error
        return
    tracked = [(k, _describe(get())) for k, get in _tracked_options.items()]
    mine = (name, [(k, _describe(v)) for k, v in arguments.items()], tracked,
            _verdict_of(error))
    gathered = comm.allgather(mine)
    # every rank reads the same gathered list, so every rank raises the same message
    first = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs[:3] == first[:3]:
            continue
        if not (isinstance(theirs, tuple) and isinstance(first, tuple)) or theirs[0] != first[0]:
            calls = [g[0] if isinstance(g, tuple) else "another collective" for g in gathered]
            raise CollectiveMismatchError(
                f"ranks are in different collective calls: rank 0 in {calls[0]}, rank {rank} in "
                f"{calls[rank]}; every rank must make the same calls in the same order"
            ) from error
        call, args0, args = first[0], first[1], theirs[1]
        if [k for k, _ in args0] != [k for k, _ in args]:
            raise CollectiveMismatchError(
                f"{call}: ranks 0 and {rank} pass different arguments ({[k for k, _ in args0]} "
                f"and {[k for k, _ in args]}); every rank must make the same collective call"
            ) from error
        for (k, v0), (_, v) in zip(args0, args):
            if v0 != v:
                raise CollectiveMismatchError(
                    f"{call}: argument {k!r} differs across ranks: rank 0 passes "
                    f"{_short(v0)}, rank {rank} passes {_short(v)}; every rank must pass "
                    "the same value to a collective call"
                ) from error
        for (k, v0), (_, v) in zip(first[2], theirs[2]):
            if v0 != v:
                raise CollectiveMismatchError(
                    f"{call}: option {k!r} differs across ranks: rank 0 has {_short(v0)}, "
                    f"rank {rank} has {_short(v)}; set it alike on every rank"
                ) from error
    agreed = _agreed_error([g[3] for g in gathered], error)
    if agreed is not None:
        raise agreed from (None if agreed is error else error)


class validating:  # noqa: N801  (used as a context manager, like contextlib's)
    """Agree on a block of rank-local validation before any rank raises (check mode).

    With check mode on (and outside another checked call), leaving the
    block calls :func:`check_arguments` with ``arguments`` and the block's
    exception, or None: every rank leaves with the same error, or none. With
    check mode off it does nothing, and an exception leaves the block as it
    is. Put only validation in the block, no communication. ``arguments`` is
    read when the block ends, so the block may replace its values by
    normalised ones.

    Parameters
    ----------
    name : str
        The call, as messages name it.
    arguments : mapping
        Argument names to values, compared as :func:`collective` compares them.
    comm : mpi4py.MPI.Comm, optional
        The communicator of the call (see :func:`check_arguments`).

    Examples
    --------
    >>> arguments = {"target": target}                     # doctest: +SKIP
    >>> with validating("MSELoss.forward", arguments, comm):   # doctest: +SKIP
    ...     if target.shape != prediction.shape:
    ...         raise ValueError("target shape differs")
    """

    __slots__ = ("name", "arguments", "comm", "active")

    def __init__(self, name: str, arguments: Mapping[str, Any],
                 comm: MPI.Comm | None = None) -> None:
        self.name = name
        self.arguments = arguments
        self.comm = comm
        self.active = False

    def __enter__(self) -> validating:
        self.active = _check and not getattr(_nesting, "depth", 0)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if self.active and (error is None or isinstance(error, Exception)):
            check_arguments(self.name, self.arguments, self.comm, error)
        return False


def collective(func: F | None = None, *,
               ignore: tuple[str, ...] | Callable[[Mapping[str, Any]], Iterable[str]] = (),
               check: Callable[..., Any] | None = None) -> Any:
    """Mark ``func`` as a collective entry point: in check mode its arguments are compared.

    With check mode off the wrapper tests one flag and calls ``func``. With
    it on, the outermost decorated call runs ``check`` (if given), then
    compares the description of every bound argument (except those
    ``ignore`` names) and the verdict of ``check`` across the communicator
    of its arguments in one message (:func:`check_arguments`), then calls
    ``func``; decorated calls made inside it are not compared again.

    Parameters
    ----------
    func : callable
        The entry point (use as ``@collective`` or ``@collective(ignore=(...))``).
    ignore : tuple of str, or callable
        Arguments that may differ between ranks (local blocks, root-only
        data); or a function of the bound arguments (a mapping of names to
        values) that returns their names, for arguments that may differ in
        some calls only (an array read on the root alone when a root is given).
    check : callable, optional
        Validation that may fail on some ranks only (it reads more than the
        arguments: a per-process setting, a local array), called with the
        call's arguments before the agreement; what it raises is this rank's
        verdict, which every rank then raises alike. Only in check mode:
        ``func`` must validate on its own too.

    Returns
    -------
    callable
        The wrapped function (or a decorator, without ``func``).
    """

    def decorate(f: F) -> F:
        signature = inspect.signature(f)
        name = f.__qualname__
        var_kw = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _check or getattr(_nesting, "depth", 0):
                return f(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a wrong call: f raises its own TypeError, alike everywhere
                return f(*args, **kwargs)
            left_out = set(ignore(bound.arguments) if callable(ignore) else ignore)
            arguments = {k: v for k, v in bound.arguments.items()
                         if k not in left_out and k not in var_kw}
            for k in var_kw:  # **keywords compared one by one, under their own names
                arguments.update(sorted(bound.arguments.get(k, {}).items()))
            error = None
            if check is not None:
                try:
                    check(*args, **kwargs)
                except Exception as exc:  # this rank's verdict, agreed on below
                    error = exc
            check_arguments(name, arguments, error=error)
            _nesting.depth = 1
            try:
                return f(*args, **kwargs)
            finally:
                _nesting.depth = 0

        return wrapper  # type: ignore[return-value]

    return decorate if func is None else decorate(func)
