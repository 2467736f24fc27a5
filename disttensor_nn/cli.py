"""Former path of :mod:`disttensor_nn.training.cli`, kept as an alias.

``build_model`` is :func:`disttensor_nn.training.build_model` and
``make_plan`` is :func:`disttensor_nn.plan.make_plan`. ``python -m
disttensor_nn.cli`` says which modules run the tools (``python -m
disttensor_nn.train``, ``python -m disttensor_nn.plan``).
"""

import sys

from .plan.make import (
    make_plan,
    wait_for_root,  # noqa: F401 (a former public name outside __all__)
)
from .training.cli import _refuse_main, parse_bytes, parse_size, plan_main, train_main
from .training.registry import build_model, model_names

MODELS = tuple(model_names())
"""The registered model names when this alias was imported (see ``model_names()``)."""

__all__ = ["build_model", "parse_bytes", "parse_size", "plan_main", "make_plan", "train_main"]

if __name__ == "__main__":
    sys.exit(_refuse_main("disttensor_nn.cli"))
