"""``sglang_cache_aware``: sglang-router's ``cache_aware`` selection rule, as a baseline.

Follows the rule as sglang-router / SMG document it (docs "Cache-Aware Routing" and "Load
Balancing", https://github.com/lightseekorg/smg docs/concepts/routing/cache-aware.md; the
``--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5`` defaults):

1. **balance check**: with ``load`` = the router's in-flight requests per worker, the cluster is
   imbalanced when ``max_load - min_load > balance_abs_threshold`` *and*
   ``max_load > balance_rel_threshold x min_load``; then the least-loaded worker gets it;
2. **cache affinity**: otherwise, when the longest prefix match covers more than
   ``cache_threshold`` of the prompt, the worker with that match gets it;
3. **smallest tree**: otherwise the worker whose prefix tree is smallest (most room) gets it.

Simplifications (say so when comparing): matches come from our *exact* prefix index (KV events)
instead of sglang's approximate per-worker character tree, in blocks instead of characters;
"tree size" is this policy's own count of the prompt tokens each worker added to its tree (a
routed prompt adds its unmatched part, as an insert into sglang's tree does), never evicted
(sglang evicts at 2^26 characters, far beyond these runs); loads are the snapshot's global
in-flight counts. Ties are broken by the policy's seeded RNG.

Invariant: state is only ``extra["sglang_tree"]`` (worker -> tokens inserted), updated in
:meth:`pick` from the decision's own inputs.
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.types import RequestInfo, WorkerState


@register
class SglangCacheAware(PolicyImpl):
    name = "sglang_cache_aware"
    description = (
        "baseline: sglang-router cache_aware (balance 64 / 1.5x, cache threshold, smallest tree)"
    )
    PARAMS = {
        "cache_threshold": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": 0.3,
            "description": "longest match must cover more than this fraction of the prompt",
        },
        "balance_abs_threshold": {
            "type": "integer",
            "minimum": 0,
            "default": 64,
            "description": "imbalanced when max - min in-flight exceeds this ...",
        },
        "balance_rel_threshold": {
            "type": "number",
            "minimum": 1,
            "default": 1.5,
            "description": "... and max in-flight exceeds this x min in-flight",
        },
    }

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        p = self.p
        loads = [w.inflight for w in cands]
        hi, lo = max(loads), min(loads)
        tree: dict[str, int] = state.extra.setdefault("sglang_tree", {})
        state.extra["sglang_req"] = (req.prompt_tokens, {w.worker_id: w for w in cands}, overlaps)
        if hi - lo > p["balance_abs_threshold"] and hi > p["balance_rel_threshold"] * lo:
            return {w.worker_id: float(w.inflight) for w in cands}
        prompt = max(1, req.prompt_tokens)
        best = max(min(overlaps.get(w.worker_id, 0) * w.capacity.block_size, prompt) for w in cands)
        if best / prompt > p["cache_threshold"]:
            # the longest match wins outright (load is not looked at on this path)
            return {
                w.worker_id: -float(
                    min(overlaps.get(w.worker_id, 0) * w.capacity.block_size, prompt)
                )
                for w in cands
            }
        return {w.worker_id: float(tree.get(w.worker_id, 0)) for w in cands}

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = pick_min(costs, state.rng)
        prompt, by_id, overlaps = state.extra.pop("sglang_req")
        w = by_id[wid]
        added = max(0, prompt - overlaps.get(wid, 0) * w.capacity.block_size)
        tree: dict[str, int] = state.extra["sglang_tree"]
        tree[wid] = tree.get(wid, 0) + added
        return wid
