"""Testing tools for distributed code: collective assertions and Hypothesis strategies.

The strategies need Hypothesis (the ``test`` extra); they are imported lazily.
"""

from __future__ import annotations

from typing import Any

from .assertions import assert_allclose, assert_equal, collective_assert, collective_outcome

__all__ = [
    "assert_allclose",
    "assert_equal",
    "collective_assert",
    "collective_outcome",
    "grids",
    "process_grids",
    "distributions",
    "dist_arrays",
]


def __getattr__(name: str) -> Any:
    if name in ("grids", "process_grids", "distributions", "dist_arrays", "MPI_PROFILE"):
        from . import strategies  # needs hypothesis (the test extra): loaded only when asked

        return getattr(strategies, name)
    raise AttributeError(name)
