"""The performance model and the planner that picks every layer's distribution."""

from .apply import apply_plan
from .costmodel import CostModel, LayerCost, candidates
from .machine import MachineProfile, builtin_profiles, load_profile
from .make import kernel_choice, make_plan, predict_scaling, wait_for_root
from .planner import Planner
from .result import Plan
from .timer import KernelTimer
from .tracing import trace

__all__ = ["CostModel", "KernelTimer", "LayerCost", "MachineProfile", "Plan", "Planner",
           "apply_plan", "builtin_profiles", "candidates", "load_profile", "make_plan",
           "predict_scaling", "trace", "wait_for_root", "kernel_choice"]
