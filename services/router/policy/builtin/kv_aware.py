"""``kv_aware`` (default): lowest estimated time to first token, in prefill-token equivalents.

    cost(w) = pending_prefill(w)              # uncached prompt tokens queued ahead (all routers)
            + uncached_weight * uncached(w)   # this prompt minus the prefix w already holds
            + decode_weight * inflight(w)     # each running sequence slows every step
            + kv_pressure_weight * kv_usage(w)

``inflight`` and ``pending_prefill`` are the snapshot's global figures (every router replica).

Seed 000 (one shared system prompt): pure prefix affinity sends everything to the first holder.
Here the holder wins only while its extra queue is smaller than the prefill it saves, and the
**hot-prefix rule** spreads a prefix whose holders are the bottleneck. A request is *hot* when
it matches at least ``hot_min_blocks`` blocks; its *holders* are the candidates with the longest
match. Every decision attributes one unit of demand to the holders of its prefix (split evenly)
over the last ``demand_window`` decisions, so a holder's *demand share* is the fraction of
recent traffic that wanted a prefix it holds (no block keys needed). The prefix is spread when

- the least-loaded holder's demand share exceeds ``hot_share`` x its fair share (1 / number of
  candidates) **and** it has ``spread_margin`` or more requests in flight than the least-loaded
  candidate (the holders carry more than their share of traffic *and* are busier), or
- the least-loaded holder has ``overload_margin`` or more requests in flight than the least-loaded
  candidate, whatever the demand (absolute overload).

Spreading credits every non-holder with ``spread_credit`` of the prefix (it will hold it after
this request), so the least-loaded one takes the request at once and becomes a holder; the
number of holders therefore grows until each carries about ``hot_share`` / N of the traffic:
one shared system prompt ends up on every worker within a few requests, while with many
prefix groups (each a small share of traffic) a group stays on its worker and keeps its hits.
New prefixes (no match) go to the least-loaded worker by the cost formula.

``uncached_weight`` (default 2) counts this request's uncached prompt tokens twice: leaving a
holder costs the copy's compute *and* splits the prefix's later hits, so a holder keeps its
prefix until its extra queue exceeds twice the prefill the prefix saves. Ties (e.g. workers all
computing the same cold prefix) go to the worker whose queued prefill is oldest.

``routed_ttl`` (256 decisions; 0 = off): when the request carries its block keys (the live
router and the simulator pass them while this is > 0), the costs also credit where this policy
*sent* the same prefix within the last ``routed_ttl`` decisions, so the second request of a
new prefix group follows the first before the first's KV events reach the index (what
sglang-router's approximate tree does). The hot-prefix rule itself looks at the index only.
The per-worker cap (``max_inflight``, default max_num_seqs) is enforced by admission.

Invariant: state lives only in :class:`PolicyState` (``extra["kv_aware_*"]``: demand window,
decision tick, busy-since ticks, routed-prefix memory), updated by :meth:`costs` / :meth:`pick`
deterministically from their inputs, so the same inputs give the same decisions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.router.policy.base import PolicyImpl, PolicyState, register
from services.router.policy.types import RequestInfo, WorkerState


def _num(desc: str, default: float, maximum: float | None = None) -> dict:
    s = {"type": "number", "minimum": 0, "default": default, "description": desc}
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _int(desc: str, default: int, minimum: int = 1) -> dict:
    return {"type": "integer", "minimum": minimum, "default": default, "description": desc}


ROUTED_STRIDE = 8  # routed-prefix memory: one block key every 8 blocks (128 tokens)
ROUTED_MAX_KEYS = 200_000  # bound on its size (oldest entries go first)


@dataclass
class Demand:
    """Sliding window of the last ``size`` hot decisions' holder sets; ``share[w]`` is the sum
    over the window of 1/len(holders) for every entry holding ``w`` (invariant: equals the
    window's contents; ``total`` = number of entries, cold decisions included as empty)."""

    size: int
    window: deque = field(default_factory=deque)
    share: dict[str, float] = field(default_factory=dict)

    def add(self, holders: tuple[str, ...]) -> None:
        self.window.append(holders)
        if holders:
            unit = 1.0 / len(holders)
            for h in holders:
                self.share[h] = self.share.get(h, 0.0) + unit
        while len(self.window) > self.size:
            old = self.window.popleft()
            if old:
                unit = 1.0 / len(old)
                for h in old:
                    v = self.share[h] - unit
                    if v <= 1e-9:
                        del self.share[h]
                    else:
                        self.share[h] = v

    def fraction(self, worker: str) -> float:
        n = len(self.window)
        return self.share.get(worker, 0.0) / n if n else 0.0


@register
class KvAware(PolicyImpl):
    name = "kv_aware"
    description = "lowest estimated TTFT: queued prefill + uncached prompt + decode load"
    PARAMS = {
        "decode_weight": _num("prefill-token equivalents per in-flight request", 64.0),
        "uncached_weight": _num(
            "weight of this request's uncached prompt tokens (> 1: leaving a prefix's holder "
            "also costs the copy's compute and the later requests' hits)",
            2.0,
        ),
        "kv_pressure_weight": _num("prefill-token equivalents at 100% KV usage", 256.0),
        "hot_min_blocks": _int("matched blocks from which the hot-prefix rule applies", 2),
        "spread_margin": _int(
            "holders' in-flight excess over the least loaded that spreads a prefix whose "
            "holders carry more than hot_share x their fair share of traffic",
            2,
        ),
        "hot_share": _num(
            "demand share (x fair share 1/N) above which a prefix's holders are hot", 1.5
        ),
        "overload_margin": _int(
            "holders' in-flight excess over the least loaded that spreads any prefix", 16
        ),
        "demand_window": _int("decisions over which holders' demand share is measured", 128),
        "routed_ttl": _int(
            "decisions for which a prefix counts as held by the worker it was routed to "
            "(before its KV events arrive); 0 = off; needs the request's block keys "
            "(RequestInfo.block_keys; the live router passes them when this is > 0)",
            256,
            minimum=0,
        ),
        "spread_credit": _num("fraction of the hot prefix credited to non-holders", 1.0, 1.0),
    }

    def _demand(self, state: PolicyState) -> Demand:
        d = state.extra.get("kv_aware_demand")
        if d is None or d.size != self.p["demand_window"]:
            d = state.extra["kv_aware_demand"] = Demand(self.p["demand_window"])
        return d

    def _with_routed(
        self,
        keys: tuple[int, ...],
        cands: list[WorkerState],
        ovs: list[int],
        state: PolicyState,
        tick: int,
    ) -> list[int]:
        """Overlaps raised by where this router recently *sent* the same prefix (its KV events
        may not have reached the index yet: the first request of a group is still computing
        it). Remembers the block key at every ``ROUTED_STRIDE``-th block and the last one."""
        mem: dict[int, tuple[str, int]] = state.extra.setdefault("kv_aware_routed", {})
        n = len(keys)
        depths = list(range(n - n % ROUTED_STRIDE, 0, -ROUTED_STRIDE))
        if n % ROUTED_STRIDE:
            depths.insert(0, n)
        state.extra["kv_aware_last"] = (keys, depths, tick)
        ttl = self.p["routed_ttl"]
        floor = self.p["hot_min_blocks"]
        routed: dict[str, int] = {}
        for d in depths:
            if d < floor:
                break
            e = mem.get(keys[d - 1])
            if e is not None and tick - e[1] <= ttl and e[0] not in routed:
                routed[e[0]] = d
        if not routed:
            return ovs
        return [max(o, routed.get(w.worker_id, 0)) for w, o in zip(cands, ovs, strict=True)]

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = super().pick(costs, state)
        last = state.extra.pop("kv_aware_last", None)
        if last is not None:
            keys, depths, tick = last
            mem: dict[int, tuple[str, int]] = state.extra["kv_aware_routed"]
            for d in depths:
                k = keys[d - 1]
                mem.pop(k, None)
                mem[k] = (wid, tick)
            while len(mem) > ROUTED_MAX_KEYS:
                del mem[next(iter(mem))]
        return wid

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        p = self.p
        dw = p["decode_weight"]
        kw = p["kv_pressure_weight"]
        uw = p["uncached_weight"]
        prompt = req.prompt_tokens
        # the hot-prefix rule looks at the index (workers that hold the prefix *now*); the costs
        # also credit where the prefix was just routed (it will be there before this request runs)
        idx = [overlaps.get(w.worker_id, 0) for w in cands]
        tick = state.extra["kv_aware_tick"] = state.extra.get("kv_aware_tick", 0) + 1
        keys = req.block_keys
        ovs = idx
        if keys and p["routed_ttl"] > 0:
            ovs = self._with_routed(keys, cands, idx, state, tick)
        best = max(idx)
        demand = self._demand(state)
        spread_to = 0
        if best >= p["hot_min_blocks"]:
            holders = [w for w, o in zip(cands, idx, strict=True) if o >= best]
            demand.add(tuple(w.worker_id for w in holders))
            if len(holders) < len(cands):
                lead = min(holders, key=lambda w: (w.inflight, w.worker_id))
                excess = lead.inflight - min(w.inflight for w in cands)
                hot = demand.fraction(lead.worker_id) * len(cands) > p["hot_share"]
                if excess >= p["overload_margin"] or (hot and excess >= p["spread_margin"]):
                    spread_to = int(best * p["spread_credit"])
        else:
            demand.add(())
        # ties (e.g. workers each computing the same cold prefix) go to the worker whose queued
        # prefill is oldest: it started first, so it finishes first
        busy: dict[str, int] = state.extra.setdefault("kv_aware_busy", {})
        out: dict[str, float] = {}
        for w, ov in zip(cands, ovs, strict=True):
            wid = w.worker_id
            if w.pending_prefill_tokens > 0:
                since = busy.setdefault(wid, tick)
                age = tick - since if tick - since < 1000 else 1000
            else:
                busy.pop(wid, None)
                age = 0
            if ov < spread_to:
                ov = spread_to
            cap = w.capacity
            cached = ov * cap.block_size
            uncached = prompt - cached if cached < prompt else 0
            free = w.kv_blocks_free
            if free is not None:
                usage = 1.0 - free / cap.num_gpu_blocks if free < cap.num_gpu_blocks else 0.0
            else:
                usage = w.kv_usage or 0.0
            out[wid] = (
                w.pending_prefill_tokens + uw * uncached + dw * w.inflight + kw * usage - 1e-4 * age
            )
        return out
