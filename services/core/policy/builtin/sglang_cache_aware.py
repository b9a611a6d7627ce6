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

Like sglang-router, the tree is *approximate*: built from the prompts this policy routed (each
routed prompt is inserted into the chosen worker's tree at once, before the engine has computed
it), not from KV events. Ours is keyed by the request's block keys (``RequestInfo.block_keys``,
which the router and the simulator pass to this policy: a prefix tree at block granularity
instead of characters); a request without keys (several block sizes in the cluster) is matched
in our exact prefix index instead. "Tree size" is the tokens each worker's tree gained (a routed prompt adds
its unmatched part). sglang evicts its tree at 2^26 characters; ours keeps the newest
``max_tree_blocks`` block keys. Loads are the snapshot's global in-flight counts. Ties are
broken by the policy's seeded RNG.

Invariant: state is only ``extra["sglang_tree"]`` (a
:class:`~services.core.policy.routed_tree.RoutedTree`), updated in :meth:`pick` from the
decision's own inputs.
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.routed_tree import RoutedTree
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
        "max_tree_blocks": {
            "type": "integer",
            "minimum": 1,
            "default": 4_000_000,
            "description": "block keys kept in the approximate tree (oldest go first)",
        },
        "balance_rel_threshold": {
            "type": "number",
            "minimum": 1,
            "default": 1.5,
            "description": "... and max in-flight exceeds this x min in-flight",
        },
    }

    def wants_block_keys(self) -> bool:
        return True  # its tree is made of the routed prompts' block keys

    def _tree(self, state: PolicyState) -> RoutedTree:
        t = state.extra.get("sglang_tree")
        if t is None:
            t = state.extra["sglang_tree"] = RoutedTree(self.p["max_tree_blocks"])
        return t

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
        tree = self._tree(state)
        if req.block_keys:
            matched = tree.match(req.block_keys, {w.worker_id for w in cands})
        else:
            matched = overlaps
        state.extra["sglang_req"] = (req, {w.worker_id: w for w in cands}, matched)
        if hi - lo > p["balance_abs_threshold"] and hi > p["balance_rel_threshold"] * lo:
            return {w.worker_id: float(w.inflight) for w in cands}
        prompt = max(1, req.prompt_tokens)
        got = {
            w.worker_id: min(matched.get(w.worker_id, 0) * w.capacity.block_size, prompt)
            for w in cands
        }
        if max(got.values()) / prompt > p["cache_threshold"]:
            # the longest match wins outright (load is not looked at on this path)
            return {wid: -float(n) for wid, n in got.items()}
        return {w.worker_id: float(tree.size.get(w.worker_id, 0)) for w in cands}

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = pick_min(costs, state.rng)
        req, by_id, matched = state.extra.pop("sglang_req")
        w = by_id[wid]
        added = max(0, req.prompt_tokens - matched.get(wid, 0) * w.capacity.block_size)
        self._tree(state).insert(wid, req.block_keys, added)
        return wid
