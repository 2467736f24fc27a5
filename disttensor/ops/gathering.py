"""The policy for operations that gather a whole split axis (or matrix) onto ranks.

A few operations have no reasonable distributed algorithm for some inputs
(an FFT of a split 1-D array whose length has no factorisation, a general
square matrix factorisation): they move the data they need to every rank
that computes with it. They call :func:`warn_gather`, which raises a
:class:`GatherWarning` when the gathered piece is at least
:data:`GATHER_WARN_BYTES` per rank, so that users see the cost and can
silence it with :mod:`warnings` filters.
"""

from __future__ import annotations

import warnings

__all__ = ["GatherWarning", "GATHER_WARN_BYTES", "warn_gather"]

#: Gathers of at least this many bytes per rank warn (64 MiB).
GATHER_WARN_BYTES = 64 << 20


class GatherWarning(UserWarning):
    """An operation gathered a large split array onto the ranks that compute with it."""


def warn_gather(what: str, nbytes: int, stacklevel: int = 3) -> None:
    """Warn (a :class:`GatherWarning`) that ``what`` gathers ``nbytes`` bytes per rank.

    Silent below :data:`GATHER_WARN_BYTES`. Every rank decides alike, from
    metadata, so every rank warns or none does.
    """
    if nbytes >= GATHER_WARN_BYTES:
        warnings.warn(f"{what} gathers {nbytes / 2**20:.1f} MiB onto every rank that computes "
                      "with it (no distributed algorithm applies to this layout)",
                      GatherWarning, stacklevel=stacklevel)
