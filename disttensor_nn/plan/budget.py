"""Meet a per-rank memory budget: the plan of the smallest memory weight ``lambda`` that fits.

The search minimises ``time + lambda * memory``; :func:`fit_budget` finds, by
growing ``lambda`` and then bisecting, the smallest weight whose cheapest
assignment fits the budget.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fit_budget"]


def fit_budget(solve: Callable[[float], dict | None], memory: Callable[[dict], float],
               budget: float) -> dict | None:
    """The assignment ``solve(lam)`` of the smallest ``lam`` found whose ``memory`` fits
    ``budget`` (None: none fits).

    ``solve(lam)`` is the cheapest assignment at memory weight ``lam`` (None
    where nothing runs), ``memory(assign)`` its peak memory. ``lam`` grows by
    fours from ``1e-6`` (at most 60 times) until a plan fits, then 30
    bisection steps shrink it to the cheapest plan that still fits.
    """
    hi = 1e-6
    best = None
    for _ in range(60):  # grow lambda until the plan fits
        cand = solve(hi)
        if cand is not None and memory(cand) <= budget:
            best = cand
            break
        hi *= 4
    if best is None:
        return None
    lo = 0.0
    for _ in range(30):  # then shrink it to the cheapest plan that still fits
        mid = (lo + hi) / 2
        cand = solve(mid)
        if cand is not None and memory(cand) <= budget:
            best, hi = cand, mid
        else:
            lo = mid
    return best
