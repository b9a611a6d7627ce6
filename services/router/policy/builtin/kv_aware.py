"""``kv_aware`` (default): lowest estimated time to first token, in prefill-token equivalents.

    cost(w) = pending_prefill(w)              # uncached prompt tokens queued ahead (all routers)
            + uncached(w)                     # this prompt minus the prefix w already holds
            + decode_weight * inflight(w)     # each running sequence slows every step
            + kv_pressure_weight * kv_usage(w)

Seed 000 (one shared system prompt): pure prefix affinity sends everything to the first holder.
Here the holder wins only while its extra queue is smaller than the prefill it saves, and the
**hot-prefix rule** spreads the prefix: when the request matches at least ``hot_min_blocks``
blocks and every candidate holding that prefix has ``spread_margin`` or more requests in flight
than the least-loaded candidate, non-holders are credited ``spread_credit`` of the prefix (they
will hold it after this request), so the least-loaded one takes it and becomes a holder.
The per-worker cap (``max_inflight``, default max_num_seqs) is enforced by admission.
"""

from __future__ import annotations

from services.router.policy.base import PolicyImpl, PolicyState, register
from services.router.policy.types import RequestInfo, WorkerState


def _num(desc: str, default: float, maximum: float | None = None) -> dict:
    s = {"type": "number", "minimum": 0, "default": default, "description": desc}
    if maximum is not None:
        s["maximum"] = maximum
    return s


@register
class KvAware(PolicyImpl):
    name = "kv_aware"
    description = "lowest estimated TTFT: queued prefill + uncached prompt + decode load"
    PARAMS = {
        "decode_weight": _num("prefill-token equivalents per in-flight request", 32.0),
        "kv_pressure_weight": _num("prefill-token equivalents at 100% KV usage", 256.0),
        "hot_min_blocks": {
            "type": "integer",
            "minimum": 1,
            "default": 2,
            "description": "matched blocks from which the hot-prefix rule applies",
        },
        "spread_margin": {
            "type": "integer",
            "minimum": 1,
            "default": 2,
            "description": "holders' in-flight excess over the least loaded that spreads a prefix",
        },
        "spread_credit": _num("fraction of the hot prefix credited to non-holders", 1.0, 1.0),
    }

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        p = self.p
        dw = p["decode_weight"]
        kw = p["kv_pressure_weight"]
        prompt = req.prompt_tokens
        ovs = [overlaps.get(w.worker_id, 0) for w in cands]
        best = max(ovs)
        spread_to = 0
        if best >= p["hot_min_blocks"]:
            holder_min = min(w.inflight for w, o in zip(cands, ovs, strict=True) if o >= best)
            if holder_min - min(w.inflight for w in cands) >= p["spread_margin"]:
                spread_to = int(best * p["spread_credit"])
        out: dict[str, float] = {}
        for w, ov in zip(cands, ovs, strict=True):
            if ov < spread_to:
                ov = spread_to
            cap = w.capacity
            cached = ov * cap.block_size
            uncached = prompt - cached if cached < prompt else 0
            free = w.kv_blocks_free
            if free is not None:
                usage = 1.0 - free / cap.num_gpu_blocks if free < cap.num_gpu_blocks else 0.0
            else:
                usage = w.kv_usage or 0.0
            out[w.worker_id] = w.pending_prefill_tokens + uncached + dw * w.inflight + kw * usage
        return out
