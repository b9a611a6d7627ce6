"""``least_request``: fewest in-flight requests cluster-wide (global across router replicas)."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


@register
class LeastRequest(PolicyImpl):
    name = "least_request"
    cost_reason = "policy"  # ignores prefixes
    description = "fewest in-flight requests, counted over all router replicas"

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        return {w.worker_id: float(w.inflight) for w in cands}
