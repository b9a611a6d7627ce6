"""``pd_llmd``: llm-d's P/D scheduling (decode profile, prefix-based decider, prefill profile),
as a baseline.

Follows github.com/llm-d/llm-d-inference-scheduler at 06c08c0:
``pkg/plugins/profile/pd_profile_handler.go`` runs the decode profile first; then its decider,
``pkg/plugins/profile/prefix_based_pd_decider.go`` (``prefix-based-pd-decider``), decides on the
decode endpoint it picked: with ``nonCachedTokens`` N > 0, the prefill profile runs (the request
is disaggregated) unless the prompt is shorter than N or the part the decode endpoint does not
hold (``prompt - matched blocks x block size``) is shorter than N; N = 0 (the plugin's default)
disaggregates every request. Each profile picks with llm-d's scorers (prefix-cache x3 + queue
x2, max-score picker: :mod:`~services.core.policy.builtin.llmd`'s ``llmd_default``) over its own
pool, with its own approximate prefix index.

Simplification: the decider's prefix match is our KV-event index (llm-d reads the decode
endpoint's match from the prefix plugin's view, approximate by default), and the prompt length
is in tokens (llm-d estimates it from the body's characters / 4).
"""

from __future__ import annotations

from services.core.pd.pools import pd_decision, pools
from services.core.pd.stages import Stage
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.builtin.llmd import PREFIX_PARAMS
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo


def disaggregate(prompt: int, decode_cached: int, non_cached_tokens: int) -> bool:
    """llm-d's ``PrefixBasedPDDecider.decide`` for the decode endpoint picked."""
    if non_cached_tokens <= 0:
        return True
    if prompt < non_cached_tokens:
        return False
    return prompt - decode_cached >= non_cached_tokens


@register
class PdLlmd(PolicyImpl):
    name = "pd_llmd"
    description = "P/D baseline: llm-d pd-profile-handler + prefix-based-pd-decider"
    disaggregated = True
    PARAMS = {
        "non_cached_tokens": {
            "type": "integer",
            "minimum": 0,
            "default": 0,
            "description": "disaggregate when the decoder lacks at least this many prompt "
            "tokens (llm-d's nonCachedTokens; 0, its default: always)",
        },
        "prefix_mode": PREFIX_PARAMS["prefix_mode"],
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        mode = {"prefix_mode": params["prefix_mode"]}
        self.decode = Stage("llmd_default", mode, params["seed"])
        self.prefill = Stage("llmd_default", mode, params["seed"] + 1)

    def wants_block_keys(self) -> bool:
        return self.decode.wants_block_keys()

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
        cached = min(overlaps.get(did, 0) * d.capacity.block_size, req.prompt_tokens)
        if not disaggregate(req.prompt_tokens, cached, self.p["non_cached_tokens"]):
            return pd_decision(req, d, None, overlaps, pl.filtered, costs, "decode only")
        if not pl.prefillers:
            return Decision(
                None, reason="all prefill workers at capacity", wait=True, filtered=pl.filtered
            )
        pid, _ = self.prefill.pick(req, pl.prefillers, overlaps, snapshot.now)
        return pd_decision(
            req, d, snapshot.workers[pid], overlaps, pl.filtered, costs, "prefill + decode"
        )
