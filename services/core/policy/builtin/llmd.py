"""``llmd_default`` and ``llmd_kv_util``: llm-d's inference scheduler scorers, as baselines.

Follows llm-d's documented default scheduling profile (llm-d "Request Scheduler" docs,
https://llm-d.ai/docs/architecture/core/router/epp/scheduling; the default profile as Red Hat
OpenShift AI documents it: queue scorer weight 2, prefix-cache scorer weight 3, highest score
wins): per worker, every scorer gives 0..1 (higher is better) and

    score = 3 x prefix_cache + 2 x queue            (llmd_default)
    score = 3 x prefix_cache + 2 x queue + 2 x kv_utilisation    (llmd_kv_util)

- ``prefix_cache``: fraction of the prompt's blocks the worker holds;
- ``queue``: min-max normalised waiting-queue length, ``(max - q) / (max - min)`` over the
  candidates, 1 for all when every queue is equal;
- ``kv_utilisation``: ``1 - KV cache usage``;
- max-score picker: the highest total; ties at random (the policy's seeded RNG).

The prefix-cache scorer's view (``prefix_mode``): ``approximate`` (default, like llm-d's default
``prefix-cache-scorer``) remembers the prompts it routed, per pod, in block keys
(:class:`~services.core.policy.routed_tree.RoutedTree`, inserted at routing time, newest
``max_prefix_blocks`` kept); ``precise`` (like its KV-event-fed "precise prefix cache" scorer)
reads our exact prefix index. Without block keys on the request both read the index.

Simplifications: the queue is the engines' ``waiting`` as telemetry last reported it (llm-d
scrapes the same vLLM gauge), 0 when unknown; KV usage is the snapshot's free-block estimate,
else telemetry. No filters beyond ours (llm-d's default profile has none that apply to one
model on identical pods).
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.routed_tree import RoutedTree
from services.core.policy.scorers import kv_usage
from services.core.policy.types import RequestInfo, WorkerState


def _weight(desc: str, default: float) -> dict:
    return {"type": "number", "minimum": 0, "default": default, "description": desc}


class _LlmdScorers(PolicyImpl):
    """Weighted sum of llm-d's scorers; costs are the negated scores (lower is better)."""

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        p = self.p
        wp, wq, wk = p["prefix_weight"], p["queue_weight"], p.get("kv_util_weight", 0.0)
        if req.block_keys and p["prefix_mode"] == "approximate":
            tree = state.extra.get("llmd_tree")
            if tree is None:
                tree = state.extra["llmd_tree"] = RoutedTree(p["max_prefix_blocks"])
            overlaps = tree.match(req.block_keys, {w.worker_id for w in cands})
            state.extra["llmd_req"] = req
        queues = [w.waiting or 0 for w in cands]
        qmax, qmin = max(queues), min(queues)
        span = qmax - qmin
        out: dict[str, float] = {}
        for w, q in zip(cands, queues, strict=True):
            bs = w.capacity.block_size
            total = -(-req.prompt_tokens // bs)  # the prompt's blocks, the last one partial
            prefix = min(overlaps.get(w.worker_id, 0), total) / total if total else 0.0
            queue = (qmax - q) / span if span else 1.0
            score = wp * prefix + wq * queue
            if wk:
                score += wk * (1.0 - kv_usage(req, w, 0, 0))
            out[w.worker_id] = -score
        return out

    def wants_block_keys(self) -> bool:
        return self.p["prefix_mode"] == "approximate"

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = pick_min(costs, state.rng)
        req = state.extra.pop("llmd_req", None)
        if req is not None:
            state.extra["llmd_tree"].insert(wid, req.block_keys, 0)
        return wid


PREFIX_PARAMS = {
    "prefix_mode": {
        "type": "string",
        "enum": ["approximate", "precise"],
        "default": "approximate",
        "description": "prefix-cache scorer's view: prompts routed per pod (approximate) or "
        "the KV-event index (precise)",
    },
    "max_prefix_blocks": {
        "type": "integer",
        "minimum": 1,
        "default": 4_000_000,
        "description": "block keys the approximate prefix view keeps (oldest go first)",
    },
}


@register
class LlmdDefault(_LlmdScorers):
    name = "llmd_default"
    description = "baseline: llm-d default profile (prefix-cache scorer x3 + queue scorer x2)"
    PARAMS = {
        "prefix_weight": _weight("weight of the prefix-cache scorer", 3.0),
        "queue_weight": _weight("weight of the queue scorer", 2.0),
        **PREFIX_PARAMS,
    }


@register
class LlmdKvUtil(_LlmdScorers):
    name = "llmd_kv_util"
    description = "baseline: llm-d prefix x3 + queue x2 + KV-cache-utilisation x2 scorers"
    PARAMS = {
        "prefix_weight": _weight("weight of the prefix-cache scorer", 3.0),
        "queue_weight": _weight("weight of the queue scorer", 2.0),
        "kv_util_weight": _weight("weight of the KV-cache-utilisation scorer", 2.0),
        **PREFIX_PARAMS,
    }
