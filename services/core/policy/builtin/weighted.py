"""``weighted``: any scorers from :mod:`..scorers` combined by configured weights.

Example: ``{"name": "weighted", "params": {"weights": {"prefix": 1.0, "inflight": 0.5}}}``.
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.scorers import SCORERS
from services.core.policy.types import RequestInfo, WorkerState


@register
class Weighted(PolicyImpl):
    name = "weighted"
    description = "sum of named scorers times weights (a policy made from configuration)"
    PARAMS = {
        "weights": {
            "type": "object",
            "description": "scorer name -> weight (scorers: " + ", ".join(SCORERS) + ")",
            "properties": {k: {"type": "number", "minimum": -100, "maximum": 100} for k in SCORERS},
            "additionalProperties": False,
            "default": {"prefix": 1.0, "inflight": 1.0},
        }
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        self.terms = [(SCORERS[k], float(v)) for k, v in sorted(params["weights"].items()) if v]

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        out = {}
        for w in cands:
            cap = self.cap(w)
            ov = overlaps.get(w.worker_id, 0)
            out[w.worker_id] = sum(wt * f(req, w, ov, cap) for f, wt in self.terms)
        return out
