"""``prefix``: pure longest-prefix affinity (ties: fewest in flight).

Kept on purpose to show the seed-000 failure: with a shared system prompt every request
matches the first worker that cached it, so one worker gets everything while the rest idle
(until it hits its cap).
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


@register
class PrefixAffinity(PolicyImpl):
    name = "prefix"
    description = "longest cached prefix wins; load only breaks ties (shows the hot spot)"

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        return {
            w.worker_id: -float(overlaps.get(w.worker_id, 0)) + w.inflight / (1.0 + self.cap(w))
            for w in cands
        }
