"""Start MPI first: MPICH's waits set to yield where this node's ranks outnumber its cores,
and one clear ImportError when no MPI library loads.

A rank that waits for a message in MPICH polls for it, and yields its core only
every thousand polls. Where a node runs more ranks than it has cores (the
README's demo: 4 ranks on 2 cores; the tests at 3 and 4 ranks), the rank being
waited for may be the one kept off a core, so before MPI starts,
:func:`yield_when_oversubscribed` asks MPICH to yield after every poll
(``MPIR_CVAR_POSIX_POLL_FREQUENCY=1``). A modest gain, within a shared machine's
noise: on 2 cores, the demo's step on 4 ranks was faster in 9 of 15 alternated
pairs, 87.7 against 93.8 ms by the medians; the halo and redistribution tests
at 4 ranks took 7-10% less in two pairs; a loop of matrix products and small
allreduces, 3% less by the median of four pairs. A value the environment
already gives is kept, and nothing changes where the ranks fit the cores, the
launcher does not say how many share the node, or MPI was started before
``disttensor`` was imported (a script that imports ``mpi4py.MPI`` first can set
the variable itself).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

POLL_YIELD = "MPIR_CVAR_POSIX_POLL_FREQUENCY"
"""MPICH's setting: busy-wait loops between two yields of the core (1000 by default)."""


def yield_when_oversubscribed(environ: MutableMapping[str, str] | None = None,
                              cores: int | None = None) -> bool:
    """Ask MPICH to yield the core at every poll where this node's ranks outnumber its
    cores; whether it was asked. Call before MPI starts (``import disttensor`` does).

    Parameters
    ----------
    environ : mapping, optional
        The environment (``os.environ`` by default); the launcher's
        ``MPI_LOCALNRANKS`` (MPICH's Hydra) or ``OMPI_COMM_WORLD_LOCAL_SIZE``
        (Open MPI's) gives the ranks on this node.
    cores : int, optional
        The cores this process may use (by default its affinity's).
    """
    environ = os.environ if environ is None else environ
    local = environ.get("MPI_LOCALNRANKS") or environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if POLL_YIELD in environ or not (local and local.isdigit()):
        return False
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    if int(local) <= cores:
        return False
    environ[POLL_YIELD] = "1"
    return True


yield_when_oversubscribed()

try:
    from mpi4py import MPI  # noqa: E402, F401  (only whether it loads matters here)
except (ImportError, RuntimeError) as exc:  # mpi4py raises RuntimeError when libmpi is absent
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise ImportError(
        f"disttensor needs an MPI library and none could be loaded ({first}). Install one "
        "with `pip install \"disttensor[mpich]\"`, or load your cluster's MPI (for example "
        "`module load mpi`) before starting Python.") from None
