"""``power_of_two``: sample two candidates at random, take the one with fewer in flight."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


@register
class PowerOfTwo(PolicyImpl):
    name = "power_of_two"
    cost_reason = "policy"  # ignores prefixes
    description = "two random choices, the less loaded one wins"

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        ordered = sorted(cands, key=lambda w: w.worker_id)
        sample = ordered if len(ordered) <= 2 else state.rng.sample(ordered, 2)
        return {w.worker_id: float(w.inflight) for w in sample}
