"""``random``: uniform choice among the candidates (seeded)."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


@register
class RandomPick(PolicyImpl):
    name = "random"
    cost_reason = "policy"  # ignores prefixes
    description = "uniformly random worker (seeded; deterministic per seed)"

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        return {w.worker_id: state.rng.random() for w in cands}
