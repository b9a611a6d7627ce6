"""``pd_dynamo``: NVIDIA Dynamo's prefill router with conditional disaggregation, as a baseline.

Follows github.com/ai-dynamo/dynamo: ``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs``
(at 07a6c9c) and ``lib/kv-router/src/conditional_disagg.rs`` (at 088ca50):

1. the decode worker is the decode pool's KV router pick
   (:mod:`~services.core.policy.builtin.dynamo_kv`'s cost over the decoders);
2. conditional disaggregation, ``IslBoundingPolicy``: with ``eff_isl = prompt - the decode
   worker's overlap x block size``, the request *bypasses* remote prefill (the decoder prefills
   it) iff ``eff_isl < conditional_disagg_eff_isl_threshold`` (2048) and
   ``eff_isl / prompt < conditional_disagg_eff_isl_ratio_threshold`` (0.7); the optional decode
   busy gate is off by default (``conditional_disagg_decode_busy_threshold`` unset) and so here;
3. otherwise the prefill worker is the prefill pool's KV router pick (the same cost over the
   prefillers, its own overlaps and queued prefill) and the KV moves to the decoder.

``conditional`` false: Dynamo without conditional disaggregation (every request remote).
"""

from __future__ import annotations

from services.core.pd.pools import pd_decision, pools
from services.core.pd.stages import Stage
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo


def bypass(prompt: int, overlap_tokens: int, threshold: int, ratio: float) -> bool:
    """Dynamo's ``IslBoundingPolicy.should_bypass_remote_prefill`` (enabled)."""
    eff = max(0, prompt - overlap_tokens)
    return eff < threshold and eff / max(prompt, 1) < ratio


@register
class PdDynamo(PolicyImpl):
    name = "pd_dynamo"
    description = "P/D baseline: Dynamo prefill router + KV router per pool + conditional disagg"
    disaggregated = True
    PARAMS = {
        "conditional": {
            "type": "boolean",
            "default": True,
            "description": "conditional disaggregation (Dynamo's conditional_disagg_enabled)",
        },
        "eff_isl_threshold": {
            "type": "integer",
            "minimum": 0,
            "default": 2048,
            "description": "bypass only when the uncached prompt is shorter than this (tokens)",
        },
        "eff_isl_ratio_threshold": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": 0.7,
            "description": "... and less than this fraction of the prompt",
        },
        "overlap_score_weight": {
            "type": "number",
            "minimum": 0,
            "default": 1.0,
            "description": "the KV routers' prefill-blocks weight",
        },
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        kv = {"overlap_score_weight": params["overlap_score_weight"]}
        self.decode = Stage("dynamo_kv", kv, params["seed"])
        self.prefill = Stage("dynamo_kv", kv, params["seed"] + 1)

    def decide_pd(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> Decision:
        pl = pools(req, snapshot, overlaps, self.max_inflight)
        if pl.none is not None:
            return pl.none
        did, costs = self.decode.pick(req, pl.decoders, overlaps, snapshot.now)
        d = snapshot.workers[did]
        p = self.p
        ov = min(overlaps.get(did, 0) * d.capacity.block_size, req.prompt_tokens)
        if p["conditional"] and bypass(
            req.prompt_tokens, ov, p["eff_isl_threshold"], p["eff_isl_ratio_threshold"]
        ):
            return pd_decision(req, d, None, overlaps, pl.filtered, costs, "conditional bypass")
        if not pl.prefillers:
            return Decision(
                None, reason="all prefill workers at capacity", wait=True, filtered=pl.filtered
            )
        pid, _ = self.prefill.pick(req, pl.prefillers, overlaps, snapshot.now)
        return pd_decision(
            req, d, snapshot.workers[pid], overlaps, pl.filtered, costs, "remote prefill"
        )
