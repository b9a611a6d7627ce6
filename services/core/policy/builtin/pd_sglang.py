"""``pd_sglang``: sgl-model-gateway's P/D router, as a baseline.

Follows github.com/sgl-project/sglang ``sgl-model-gateway/src/routers/http/pd_router.rs`` at
004dcda (``select_pd_pair`` / ``pick_worker_by_policy_arc``): the prefill worker is the
``prefill_policy``'s pick among the available prefill workers and the decode worker the
``decode_policy``'s among the decode workers, independently; both default to the router's
``--policy``, ``cache_aware`` (cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5: :mod:`~services.core.policy.builtin.sglang_cache_aware`), each with
its own radix tree of the prompts it routed. Then both requests go out at once with the
SGLang bootstrap fields; every request is disaggregated (the gateway has no conditional path).
"""

from __future__ import annotations

from services.core.pd.pools import pd_decision, pools
from services.core.pd.stages import Stage
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo

RULES = ["sglang_cache_aware", "round_robin", "random", "power_of_two"]


@register
class PdSglang(PolicyImpl):
    name = "pd_sglang"
    description = "P/D baseline: sgl-model-gateway PD router (cache_aware per pool)"
    disaggregated = True
    PARAMS = {
        "prefill_policy": {
            "type": "string",
            "enum": RULES,
            "default": "sglang_cache_aware",
            "description": "rule choosing the prefill worker (the gateway's --prefill-policy)",
        },
        "decode_policy": {
            "type": "string",
            "enum": RULES,
            "default": "sglang_cache_aware",
            "description": "rule choosing the decode worker (the gateway's --decode-policy)",
        },
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        self.prefill = Stage(params["prefill_policy"], None, params["seed"])
        self.decode = Stage(params["decode_policy"], None, params["seed"] + 1)

    def wants_block_keys(self) -> bool:
        return self.prefill.wants_block_keys() or self.decode.wants_block_keys()

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
        if not pl.prefillers:
            return Decision(
                None, reason="all prefill workers at capacity", wait=True, filtered=pl.filtered
            )
        pid, _ = self.prefill.pick(req, pl.prefillers, overlaps, snapshot.now)
        did, costs = self.decode.pick(req, pl.decoders, overlaps, snapshot.now)
        p = snapshot.workers[pid]
        d = snapshot.workers[did]
        return pd_decision(req, d, p, overlaps, pl.filtered, costs, "prefill and decode policies")
