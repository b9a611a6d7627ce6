"""``sglang_cache_aware``: sglang-router / SMG's ``cache_aware`` selection rule, as a baseline.

Follows Shepherd Model Gateway's source (github.com/lightseekorg/smg, commit 73da68c, Aug 2026:
``model_gateway/src/policies/cache_aware.rs``, its approximate ``kv_index`` string tree, and the
CLI defaults of ``model_gateway/src/main.rs``: ``--cache-threshold 0.3
--balance-abs-threshold 64 --balance-rel-threshold 1.5 --max-tree-size 2^26``):

1. **balance check**: with ``load`` = the router's in-flight requests per worker, the cluster is
   imbalanced when ``max_load - min_load > balance_abs_threshold`` *and*
   ``max_load > balance_rel_threshold x min_load``; then the least-loaded worker gets it;
2. **cache affinity**: otherwise the prompt is matched in one tree shared by all workers; when
   the match covers more than ``cache_threshold`` of the prompt, the worker that created the
   deepest matched position (the node's ``last_tenant``) gets it;
3. **least loaded**: otherwise the least-loaded worker (``min_load_idx``; SMG no longer sends a
   cold prompt to the worker with the smallest tree).

"Least loaded" is SMG's key ``(load, processed, index)``: fewest in flight, then fewest
requests routed there so far by this policy, then the first in order (here: the sorted worker
id), deterministic. Every routed prompt is inserted into its worker's tree at once, before the
engine has computed it (no KV events). Costs: on the cache path 0 for the chosen worker and 1
for the others; otherwise ``load + rank / n``, ``rank`` the worker's place by
``(processed, id)``, so the lowest cost is SMG's choice.

Simplifications: SMG's HTTP router matches the request's characters; ours is a prefix tree of
the request's block keys (``RequestInfo.block_keys``: whole blocks of the worker's block size,
so a partial last block never matches); a request without keys (several block sizes in the
cluster) is matched in our exact prefix index, its owner the holder with the longest match.
SMG evicts each worker's tree to 2^26 characters every 60 s; ours keeps the newest
``max_tree_blocks`` block keys. When the owner cannot take the request now (our capacity filter,
which SMG lacks) the least-loaded worker gets it instead of SMG's first healthy worker. The
token-usage imbalance triggers (``balance_token_usage_threshold``,
``overload_token_usage_threshold``) are off by default in SMG and not modelled.

Invariant: state is ``extra["sglang_tree"]`` (a
:class:`~services.core.policy.routed_tree.RoutedTree`) and ``extra["sglang_processed"]``
(requests routed per worker), both updated in :meth:`pick` from the decision's own inputs.
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
        "baseline: sglang-router / SMG cache_aware (balance 64 / 1.5x, cache threshold, least load)"
    )
    PARAMS = {
        "cache_threshold": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": 0.3,
            "description": "the match must cover more than this fraction of the prompt",
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

    def _least_loaded(self, cands: list[WorkerState], state: PolicyState) -> dict[str, float]:
        processed = state.extra.setdefault("sglang_processed", {})
        order = sorted(cands, key=lambda w: (processed.get(w.worker_id, 0), w.worker_id))
        n = len(order)
        return {w.worker_id: w.inflight + i / n for i, w in enumerate(order)}

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
        state.extra["sglang_req"] = req.block_keys
        if hi - lo > p["balance_abs_threshold"] and hi > p["balance_rel_threshold"] * lo:
            return self._least_loaded(cands, state)
        bs = cands[0].capacity.block_size
        if req.block_keys:
            depth, owner = self._tree(state).deepest(req.block_keys)
        else:
            held = {w.worker_id: overlaps.get(w.worker_id, 0) for w in cands}
            owner = max(sorted(held), key=held.__getitem__)
            depth = held[owner]
        prompt = max(1, req.prompt_tokens)
        matched = min(depth * bs, prompt)
        ids = {w.worker_id for w in cands}
        if matched / prompt > p["cache_threshold"] and owner in ids:
            return {wid: 0.0 if wid == owner else 1.0 for wid in ids}
        return self._least_loaded(cands, state)

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = pick_min(costs, state.rng)  # costs have no ties: SMG's choice is deterministic
        block_keys = state.extra.pop("sglang_req")
        processed = state.extra.setdefault("sglang_processed", {})
        processed[wid] = processed.get(wid, 0) + 1
        # no tree size is kept: SMG no longer routes by it (a cold prompt goes to least load)
        self._tree(state).insert(wid, block_keys)
        return wid

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        processed = state.extra.get("sglang_processed")
        if processed:
            for wid in [w for w in processed if w not in live]:
                del processed[wid]
