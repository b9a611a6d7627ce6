"""``pd_round_robin``: round-robin pairing, as a P/D baseline.

Follows vLLM's own P/D proxy (github.com/vllm-project/vllm
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` at 030ea52, the proxy vLLM's NIXL
docs run): two independent ``itertools.cycle`` iterators, one over the prefill instances and one
over the decode instances; every request takes the next prefiller (a ``max_tokens`` 1 request
with ``do_remote_decode``) and then the next decoder. No load, no cache, no conditional
disaggregation: every request is disaggregated.

vLLM's production stack routes P/D with ``DisaggregatedPrefillRouter``
(github.com/vllm-project/production-stack ``src/vllm_router/routers/routing_logic.py`` at
008a23b): the *first* endpoint with a prefill label and the first with a decode label, every
time; with one prefiller and one decoder (its examples) that is the same pairing, and with more it
uses only the first pair, so the round robin is the stronger of the two and the one kept here.

Simplification: the cycles run over the candidates our filters leave (sorted by id), so a
worker at its cap or unroutable is skipped where the proxy would send to it anyway.
"""

from __future__ import annotations

from services.core.pd.pools import pd_decision, pools
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo


@register
class PdRoundRobin(PolicyImpl):
    name = "pd_round_robin"
    description = "P/D baseline: vLLM's P/D proxy (round-robin prefiller, round-robin decoder)"
    disaggregated = True
    PARAMS: dict = {}

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
        ps = sorted(pl.prefillers, key=lambda w: w.worker_id)
        ds = sorted(pl.decoders, key=lambda w: w.worker_id)
        i = state.extra.get("rr_prefill", 0)
        j = state.extra.get("rr_decode", 0)
        state.extra["rr_prefill"] = i + 1
        state.extra["rr_decode"] = j + 1
        p, d = ps[i % len(ps)], ds[j % len(ds)]
        return pd_decision(req, d, p, overlaps, pl.filtered, {}, "round robin")
