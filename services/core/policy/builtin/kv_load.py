"""``kv_load``: least KV-cache usage, ignoring prefixes (the seed-000 "kv-load" mode)."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.scorers import kv_usage
from services.core.policy.types import RequestInfo, WorkerState


@register
class KvLoad(PolicyImpl):
    name = "kv_load"
    cost_reason = "policy"  # ignores prefixes
    description = "least KV cache usage (in-flight breaks ties); prefixes ignored"
    PARAMS = {
        "inflight_weight": {
            "type": "number",
            "minimum": 0,
            "default": 0.1,
            "description": "weight of in-flight/cap added to KV usage",
        }
    }

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        wi = self.p["inflight_weight"]
        out = {}
        for w in cands:
            cap = self.cap(w)
            out[w.worker_id] = kv_usage(req, w, 0, cap) + wi * w.inflight / cap
        return out
