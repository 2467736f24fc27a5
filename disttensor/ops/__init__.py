"""NumPy-style programming on DistArrays: protocols, ufuncs, reductions, indexing, shapes."""

from __future__ import annotations


class ArrayOperators:
    """Operators and NumPy protocols that DistArray inherits."""

    __slots__ = ()
