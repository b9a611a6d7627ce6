"""``round_robin``: cycle over the candidates (sorted by id); ignores load and cache."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


@register
class RoundRobin(PolicyImpl):
    name = "round_robin"
    cost_reason = "policy"  # ignores prefixes
    description = "cycle over the workers that can take the request"

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        ids = sorted(w.worker_id for w in cands)
        k = state.counter % len(ids)
        state.counter += 1
        return {wid: float((i - k) % len(ids)) for i, wid in enumerate(ids)}
