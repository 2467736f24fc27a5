import os

from hypothesis import settings

import disttensor.testing.strategies  # noqa: F401  (registers the "mpi" profile)

pytest_plugins = ["disttensor.testing.pytest_plugin"]

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mpi"))
