"""``dynamo_kv``: NVIDIA Dynamo's KV router cost function, as a baseline.

Follows Dynamo's source (github.com/ai-dynamo/dynamo ``lib/kv-router/src/scheduling/``:
``selector/default.rs`` at a4bdb9b, ``pick_default_worker`` / ``worker_logit`` /
``softmax_sample_index``; defaults from ``KvRouterConfig::default``: overlap_score_credit 1,
prefill_load_scale 1, credit decay 0, decode_active_request_weight 0, router_temperature 0):
per worker

    prefill_blocks = (tokens still to prefill there + this request's tokens) / block - overlap
    decode_blocks  = active KV blocks there + this request's blocks
    cost           = overlap_score_weight x prefill_blocks + decode_blocks

(the older ``--router-kv-overlap-score-weight`` is today's ``prefill_load_scale``; with the
shipped defaults both spellings give this cost). Lowest cost wins. ``router_temperature`` 0
(the default): the minimum, exact ties to a uniformly random one of them (Dynamo's reservoir
draw; here the policy's seeded RNG, over the sorted worker ids); above 0: a softmax sample
with ``p ~ exp(-(cost - min) / ((max - min) x temperature))``, uniform when all costs are equal.

Simplifications: the overlap comes from our exact prefix index (Dynamo's is the same idea, fed
by KV events; no host / disk tiers here); "tokens still to prefill" is the snapshot's
``pending_prefill_tokens`` (the router's count of uncached prompt tokens without a first token,
which is when Dynamo drops them too); active blocks are the worker's used KV blocks by the
snapshot's free-block estimate (``num_gpu_blocks - kv_blocks_free``, else ``kv_usage``), not
Dynamo's per-sequence block tracking, and this request's blocks are all counted (Dynamo counts
only those not already active there); output blocks are not tracked (Dynamo's default,
``--no-router-track-output-blocks``).
"""

from __future__ import annotations

import math

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.types import RequestInfo, WorkerState


def used_blocks(w: WorkerState) -> float:
    """KV blocks in use on ``w`` (free-block estimate when known, else telemetry usage)."""
    cap = w.capacity.num_gpu_blocks
    if w.kv_blocks_free is not None:
        return float(max(0, cap - w.kv_blocks_free))
    return (w.kv_usage or 0.0) * cap


@register
class DynamoKv(PolicyImpl):
    name = "dynamo_kv"
    description = (
        "baseline: Dynamo KV router cost (overlap weight x prefill blocks + decode blocks)"
    )
    PARAMS = {
        "overlap_score_weight": {
            "type": "number",
            "minimum": 0,
            "default": 1.0,
            "description": "weight of the prefill blocks against the decode blocks",
        },
        "router_temperature": {
            "type": "number",
            "minimum": 0,
            "default": 0.0,
            "description": "0: lowest cost (ties at random); above 0: softmax sampling of the "
            "costs normalised by their range",
        },
    }

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        wt = self.p["overlap_score_weight"]
        out: dict[str, float] = {}
        for w in cands:
            bs = w.capacity.block_size
            cached = min(overlaps.get(w.worker_id, 0) * bs, req.prompt_tokens)
            prefill = (w.pending_prefill_tokens + req.prompt_tokens - cached) / bs
            decode = used_blocks(w) + req.prompt_tokens / bs
            out[w.worker_id] = wt * prefill + decode
        return out

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        temperature = self.p["router_temperature"]
        if temperature == 0.0:
            return pick_min(costs, state.rng)
        return softmax_pick(costs, temperature, state.rng.random())


def softmax_pick(costs: dict[str, float], temperature: float, sample: float) -> str:
    """Dynamo's ``softmax_sample_index`` over the sorted worker ids: ``sample`` in [0, 1)."""
    ids = sorted(costs)
    lo, hi = min(costs.values()), max(costs.values())
    if hi == lo:
        weights = [1.0] * len(ids)
    else:
        scale = -1.0 / ((hi - lo) * temperature)
        weights = [math.exp((costs[w] - lo) * scale) for w in ids]
    total = sum(weights)
    cumulative = 0.0
    for wid, weight in zip(ids, weights, strict=True):
        cumulative += weight / total
        if sample <= cumulative:
            return wid
    return ids[-1]
