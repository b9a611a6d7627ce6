"""``llmd_default`` and ``llmd_kv_util``: llm-d's inference scheduler scorers, as baselines.

Follows llm-d-router's source (github.com/llm-d/llm-d-inference-scheduler, commit 520af47, May
2026; module ``github.com/llm-d/llm-d-router``): per worker, every scorer gives 0..1 (higher is
better) and

    score = 3 x prefix_cache + 2 x queue                         (llmd_default)
    score = 3 x prefix_cache + 2 x queue + 2 x kv_utilisation    (llmd_kv_util)

``llmd_kv_util`` is the profile the EPP builds when no configuration is given
(``pkg/epp/config/loader/defaults.go``: queue-scorer 2, kv-cache-utilization-scorer 2,
prefix-cache-scorer 3); ``llmd_default`` is the same without the KV scorer (the default profile
as Red Hat OpenShift AI documents it).

- ``prefix_cache`` (``scorer/prefix/plugin.go``): matched blocks / the prompt's blocks. The
  approximate view (``requestcontrol/dataproducer/approximateprefix``, the default) hashes at
  most ``maxPrefixBlocksToMatch`` = 256 leading blocks (a longer prompt is cut there, so the
  denominator is at most 256) and keeps, per pod, an LRU of the hashes routed there, sized by
  the pod's KV blocks (``autoTune``): :class:`~services.core.policy.pod_lru_prefix.PodLruPrefixIndex`.
  ``precise`` reads our KV-event index instead (like its ``precise-prefix-cache-scorer``:
  matched / total blocks, at most 1);
- ``queue`` (``scorer/queuedepth/queue.go``): ``(max - q) / (max - min)`` over the candidates'
  waiting queues, 1 for all when every queue is equal;
- ``kv_utilisation`` (``scorer/kvcacheutilization``): ``1 - KV cache usage``;
- max-score picker (``picker/maxscore/picker.go``): shuffle, then a stable sort by score, so
  exact ties go to a uniformly random one of them (here: the policy's seeded RNG, so a
  simulation stays reproducible).

Simplifications: the block hashes are our block keys (token blocks of the worker's block size;
llm-d hashes ``blockSizeTokens x 4`` characters of the request body, the last partial block
included, which a later prompt only matches when its text is identical there); the queue is the
engines' ``waiting`` as telemetry last reported it (llm-d scrapes the same vLLM gauge), 0 when
unknown; KV usage is the snapshot's free-block estimate, else telemetry. No filters beyond ours
(llm-d's default profile has none that apply to one model on identical pods).
"""

from __future__ import annotations

from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.pod_lru_prefix import PodLruPrefixIndex
from services.core.policy.scorers import kv_usage
from services.core.policy.types import RequestInfo, WorkerState


def _weight(desc: str, default: float) -> dict:
    return {"type": "number", "minimum": 0, "default": default, "description": desc}


class _LlmdScorers(PolicyImpl):
    """Weighted sum of llm-d's scorers; costs are the negated scores (lower is better)."""

    def _index(self, state: PolicyState) -> PodLruPrefixIndex:
        idx = state.extra.get("llmd_index")
        if idx is None:
            idx = state.extra["llmd_index"] = PodLruPrefixIndex()
        return idx

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        p = self.p
        wp, wq, wk = p["prefix_weight"], p["queue_weight"], p.get("kv_util_weight", 0.0)
        max_blocks = p["max_prefix_blocks_to_match"]
        if req.block_keys and p["prefix_mode"] == "approximate":
            keys = req.block_keys[:max_blocks]
            overlaps = self._index(state).match(keys)
            state.extra["llmd_req"] = (keys, {w.worker_id: w for w in cands})
        else:
            max_blocks = None  # the precise scorer divides by all the prompt's blocks
        queues = [w.waiting or 0 for w in cands]
        qmax, qmin = max(queues), min(queues)
        span = qmax - qmin
        out: dict[str, float] = {}
        for w, q in zip(cands, queues, strict=True):
            bs = w.capacity.block_size
            total = -(-req.prompt_tokens // bs)  # the prompt's blocks, the last one partial
            if max_blocks is not None:
                total = min(total, max_blocks)
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
        wid = pick_min(costs, state.rng)  # max score; exact ties: uniformly random
        pending = state.extra.pop("llmd_req", None)
        if pending is not None:
            keys, by_id = pending
            cap = self.p["lru_capacity_per_server"] or by_id[wid].capacity.num_gpu_blocks
            self._index(state).add(wid, keys, cap)
        return wid

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        idx = state.extra.get("llmd_index")
        if idx is not None:
            for wid in [w for w in idx.lru if w not in live]:
                idx.remove_pod(wid)


PREFIX_PARAMS = {
    "prefix_mode": {
        "type": "string",
        "enum": ["approximate", "precise"],
        "default": "approximate",
        "description": "prefix-cache scorer's view: prompts routed per pod (approximate) or "
        "the KV-event index (precise)",
    },
    "max_prefix_blocks_to_match": {
        "type": "integer",
        "minimum": 1,
        "default": 256,
        "description": "approximate view: leading blocks hashed and scored (llm-d's "
        "maxPrefixBlocksToMatch)",
    },
    "lru_capacity_per_server": {
        "type": ["integer", "null"],
        "minimum": 1,
        "default": None,
        "description": "approximate view: block hashes remembered per pod, oldest dropped "
        "first (null: the pod's KV blocks, like llm-d's autoTune)",
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
