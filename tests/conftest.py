import os

import pytest
from hypothesis import settings
from mpi_helpers import remove_shared_tmpdirs

import disttensor.testing.strategies  # noqa: F401  (registers the "mpi" profile)
from disttensor_nn.kernels import limit_threads, threads_now

pytest_plugins = ["disttensor.testing.pytest_plugin"]

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mpi"))


@pytest.fixture(autouse=True)
def _one_kernel_thread_again():
    """A test that set this process's kernel threads (a command-line entry point does)
    leaves one thread to the tests after it, whose memory and timings assume one."""
    before = threads_now()
    yield
    if threads_now() != before:
        limit_threads(1)


@pytest.fixture(autouse=True)
def _no_shared_tmpdir_left():
    """The directories a test made with ``mpi_helpers.shared_tmpdir`` go with it."""
    yield
    remove_shared_tmpdirs()
