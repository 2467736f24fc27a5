"""Deterministic per-layer seeds derived from one model seed."""

from __future__ import annotations

import numpy as np

__all__ = ["SeedStream"]


class SeedStream:
    """Hands out a distinct, reproducible seed per layer: the i-th call gives
    ``SeedSequence([seed, i])``'s first 32-bit word.

    The sequence depends only on ``seed`` and the construction order, so every
    rank that builds the same model gets the same initial parameters.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.count = 0

    def __call__(self) -> int:
        state = np.random.SeedSequence([self.seed, self.count]).generate_state(1, np.uint32)
        self.count += 1
        return int(state[0])
