"""The one switch of the array layer: may operations move operands between ranks implicitly?"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..settings import track_option

__all__ = [
    "implicit_redistribution",
    "implicit_redistribution_enabled",
    "set_implicit_redistribution",
]

_implicit = True


def set_implicit_redistribution(enabled: bool) -> bool:
    """Allow or forbid the redistributions that operations insert on their own.

    With ``enabled=False``, an operation whose operands would have to move
    between ranks to line up (a binary ufunc on two differently distributed
    arrays, a DistArray value in ``__setitem__``, the inputs of ``matmul``,
    ...) raises a ValueError instead, on every rank and before any
    communication. Taking a sub-block of data a rank already holds (a
    replicated operand, say) is still allowed, and so are the collectives
    that *are* the operation (the Allreduce of a reduction, the broadcasts of
    ``matmul``).

    The setting is per process: set it to the same value on every rank (in
    check mode every collective call compares it, see :mod:`disttensor.settings`).

    Parameters
    ----------
    enabled : bool
        The new setting.

    Returns
    -------
    bool
        The previous setting.
    """
    global _implicit
    previous, _implicit = _implicit, bool(enabled)
    return previous


def implicit_redistribution_enabled() -> bool:
    """Whether operations may redistribute operands on their own (the default)."""
    return _implicit


@contextmanager
def implicit_redistribution(enabled: bool) -> Iterator[None]:
    """Context manager form of :func:`set_implicit_redistribution`.

    Examples
    --------
    >>> from disttensor.ops import implicit_redistribution
    >>> with implicit_redistribution(False):   # doctest: +SKIP
    ...     z = x + y      # ValueError if y must move to line up with x
    """
    previous = set_implicit_redistribution(enabled)
    try:
        yield
    finally:
        set_implicit_redistribution(previous)


track_option("implicit_redistribution", implicit_redistribution_enabled)
