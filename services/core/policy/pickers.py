"""Pickers turn costs into one worker. Deterministic given the RNG state."""

from __future__ import annotations

import random

TIE_EPS = 1e-9


def pick_min(costs: dict[str, float], rng: random.Random) -> str:
    """Lowest cost; exact ties (within 1e-9) broken uniformly by ``rng`` over sorted ids."""
    limit = min(costs.values()) + TIE_EPS
    ties = [w for w, c in costs.items() if c <= limit]
    if len(ties) == 1:
        return ties[0]
    ties.sort()
    return ties[rng.randrange(len(ties))]
