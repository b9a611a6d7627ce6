"""``gpu_aware``: NVML pressure from telemetry (SM util, memory used, memory bandwidth) plus
in-flight load. Decode is bandwidth-bound, so bandwidth gets its own weight."""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import RequestInfo, WorkerState


def _w(desc: str, default: float) -> dict:
    return {"type": "number", "minimum": 0, "default": default, "description": desc}


@register
class GpuAware(PolicyImpl):
    name = "gpu_aware"
    cost_reason = "policy"  # ignores prefixes
    description = "least GPU pressure (SM, memory, bandwidth) and load; stale telemetry = neutral"
    PARAMS = {
        "sm_weight": _w("weight of SM utilisation 0..1", 1.0),
        "mem_weight": _w("weight of GPU memory used fraction", 0.5),
        "bw_weight": _w("weight of memory bandwidth utilisation", 1.0),
        "inflight_weight": _w("weight of in-flight/cap", 1.0),
        "neutral": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": 0.5,
            "description": "pressure assumed for unknown or stale readings",
        },
    }

    def costs(self, req: RequestInfo, cands: list[WorkerState], overlaps, state: PolicyState):
        p = self.p
        n = p["neutral"]
        out = {}
        for w in cands:
            stale = w.telemetry_stale
            sm = n if stale or w.gpu_sm_util is None else w.gpu_sm_util
            mem = n if stale or w.gpu_mem_used is None else w.gpu_mem_used
            bw = n if stale or w.gpu_bw_util is None else w.gpu_bw_util
            out[w.worker_id] = (
                p["sm_weight"] * sm
                + p["mem_weight"] * mem
                + p["bw_weight"] * bw
                + p["inflight_weight"] * w.inflight / self.cap(w)
            )
        return out
