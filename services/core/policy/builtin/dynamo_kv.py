"""``dynamo_kv``: NVIDIA Dynamo's KV router cost function, as a baseline.

Follows the cost in Dynamo's router docs ("KV Router" / "Routing Concepts", Cost Calculation,
https://docs.nvidia.com/dynamo/latest/components/router/): per worker

    prefill_blocks = (tokens still to prefill there + this request's uncached tokens) / block
    decode_blocks  = active KV blocks there + this request's blocks
    cost           = overlap_score_weight x prefill_blocks + decode_blocks

lowest cost wins; ``--router-temperature 0`` (the default) makes that deterministic (exact ties
broken by the policy's seeded RNG here). ``overlap_score_weight`` defaults to 1.0 like
``--router-kv-overlap-score-weight``.

Simplifications: the uncached part comes from our exact prefix index (Dynamo's is the same
idea, fed by KV events); "tokens still to prefill" is the snapshot's
``pending_prefill_tokens`` (the router's count of uncached prompt tokens without a first token,
which is when Dynamo drops them too); active blocks are the worker's used KV blocks by the
snapshot's free-block estimate (``num_gpu_blocks - kv_blocks_free``, else ``kv_usage``), not
Dynamo's per-sequence block tracking; output blocks are not tracked (Dynamo's default,
``--no-router-track-output-blocks``).
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
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
        }
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
