"""``python -m disttensor_nn.plan`` is ``disttensor-plan``."""

import sys

from ..training.cli import plan_main

sys.exit(plan_main())
