"""Load MPI first, so that a missing MPI library gives one clear ImportError."""

try:
    from mpi4py import MPI  # noqa: F401  (only whether it loads matters here)
except (ImportError, RuntimeError) as exc:  # mpi4py raises RuntimeError when libmpi is absent
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise ImportError(
        f"disttensor needs an MPI library and none could be loaded ({first}). Install one "
        "with `pip install \"disttensor[mpich]\"`, or load your cluster's MPI (for example "
        "`module load mpi`) before starting Python.") from None
