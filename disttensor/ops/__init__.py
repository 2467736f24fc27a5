"""NumPy-style programming on DistArrays: protocols, ufuncs, reductions, indexing, shapes.

Importing this package gives ``DistArray`` the members of
:class:`ArrayOperators` (:mod:`~disttensor.ops.methods`):

* ``__array_ufunc__``: every element-wise ufunc and the Python operators
  (:mod:`~disttensor.ops.ufuncs`), ``ufunc.reduce``/``accumulate`` for the
  usual reductions;
* ``__array_function__``: the NumPy functions listed in
  :data:`disttensor.ops.functions.HANDLED` (reductions, shape functions,
  ``where``, ``clip``, ``dot``, ...); other NumPy functions raise NumPy's
  ``TypeError`` on every rank;
* ``__array_namespace__``: the Python array API namespace
  (:mod:`~disttensor.ops.namespace`);
* ``x[key]`` and ``x[key] = value`` (:mod:`~disttensor.ops.indexing`, integer arrays:
  :mod:`~disttensor.ops.advanced`);
* sorting, searching and set functions (:mod:`~disttensor.ops.sorting`,
  :mod:`~disttensor.ops.searching`, :mod:`~disttensor.ops.sets`) and
  ``__dlpack__`` for arrays that are whole on the rank;
* NumPy-style methods (``x.sum()``, ``x.reshape(...)``, ``x.T``, ...).

Operands with different distributions are lined up by the rule in
:mod:`~disttensor.ops.align`; :func:`set_implicit_redistribution` turns the
implicit moves into errors. Rules and costs: docs/array_programming.md.

The modules import :mod:`disttensor.array`, never the reverse, in one
direction among themselves too: ``align``, ``indexing``, ``shape``,
``reductions``, ``linalg``, ``ufuncs``, ``elementwise``, ``gathering``,
``fft``, ``linalg_ext``, ``sorting``, ``searching``, ``advanced``, ``sets``,
``replication``, ``namespace``, ``functions``, ``methods`` (each uses only those
before it).
``fft`` and ``linalg_ext`` are the array API's extensions, ``xp.fft`` and
``xp.linalg`` (docs/fft_linalg.md).
"""

from ._config import (
    implicit_redistribution,
    implicit_redistribution_enabled,
    set_implicit_redistribution,
)
from .linalg import matmul_distributions
from .methods import ArrayOperators

__all__ = [
    "ArrayOperators",
    "implicit_redistribution",
    "implicit_redistribution_enabled",
    "set_implicit_redistribution",
    "matmul_distributions",
]
