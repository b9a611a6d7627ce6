"""``kv_aware`` (default): lowest estimated time to first token, in prefill-token equivalents.

    cost(w) = queued_prefill(w)               # prompt tokens still to compute ahead (all routers)
            + uncached_weight * uncached(w)   # this prompt minus the prefix w holds (or will)
            + decode_weight * inflight(w)     # each running sequence slows every step
            + kv_pressure_weight * kv_usage(w)
            + imposed_weight * decoding(w) * prefill(w) / prefill_token_s   # the stall it imposes
            + stall_tpot_weight * gaps(w) * prefill(w) / prefill_token_s    # the TPOT that adds
            + conversation_weight * turns_ahead * recent_work(w)   # a request starting a prefix

``inflight`` is the snapshot's global figure (every router replica).

**Prefill stall** (``imposed_weight``, 0 = off by default). The terms above price the new
request's own time to first token. Its prompt also shares its engine steps with every request
decoding on the worker, and each of those waits its compute time more for its next tokens:
``prefill(w)`` is that time by the latency model (:func:`services.core.latency.prefill_s`:
``prefill_token_s x uncached + prefill_attn_s x uncached x (prompt - uncached / 2)``, the
engine model's default coefficients), ``decoding(w)`` the worker's requests past their first
token (in flight minus what this policy sent there without a first token yet), and dividing
by ``prefill_token_s`` puts the stall in this cost's unit (prefill tokens). It is
``slo_aware``'s ``imposed_weight x decoding x prefill`` term in those units. Where the TPOT SLO
binds on short answers (every worker busy, prompts of thousands of tokens), without it a worker
whose requests all decode looks cheapest, and the prompt sent there stalls them all.

**TPOT the stall adds** (``stall_tpot_weight``, 25 by default). The same stall priced by
what it does to the SLO that it threatens: a decoding request's TPOT is its decode time over
its ``max_tokens - 1`` gaps, so a stall of ``prefill(w)`` seconds adds ``prefill(w) /
(max_tokens - 1)`` to it whenever it comes during its decode (the whole answer, not what is
left of it: the mean counts every gap). Summed over the worker's decoders that is
``gaps(w) x prefill(w)``, with ``gaps(w)`` = :attr:`WorkerState.decode_gaps` (sum of ``1 /
(max_tokens - 1)`` over this router's requests past their first token there). Weighted by
TTFT seconds per second of TPOT (``slo_ttft / slo_tpot`` counts both in fractions of their
SLO) and divided by ``prefill_token_s`` like the stall. A 4 k prompt on a worker of 13-token
answers weighs ~1/12 of the plain stall per decoder, on one of 300-token answers 1/299. The
weight is 25, below the SLOs' ratio (40-125 in the benchmarks): the linear price counts a stall
on a decoder with slack to spare in full, and 100 lost goodput steps on Mooncake and Azure
(docs/benchmarks.md). ``max_tokens`` stands for the answer's length; requests that leave it
unset count as the router assumes them.

**Conversations** (``conversation_weight``, off by default, 0.15 measured best;
``conversation_window_s``, 10 s). Every term above prices the request at hand. A request that
starts a new prefix (no candidate holds ``hot_min_blocks`` of it) also decides where that
prefix's later requests go: a chat's next turns follow it, and the worker's load then is its
conversations' turns, which the queue and in-flight counts do not show while those
conversations are between turns (a worker whose conversations all just finished a turn looks
idle, and new ones pile onto it, their turns arriving together). With the weight > 0 such a
request also pays, per worker, ``conversation_weight x turns_ahead x recent_work(w)``
(:class:`~services.core.policy.recent_work.RecentWork`): ``recent_work(w)`` is the uncached
prompt tokens this policy sent there within the last ``conversation_window_s``, a request that
continued a prefix only that worker holds counted in full and one that started a prefix x the
window's share ``s`` of continuations; ``turns_ahead = s / (1 - s)`` is how many later requests
the new prefix can be expected to bring (each continued with probability ``s``). A fleet
without reuse (``s`` = 0) carries none; on chat traffic (``s`` ~ 7/8) a new conversation weighs
its seven turns, on a trace whose prompts come back less often it weighs little
(docs/benchmarks.md: the multi-turn TTFT p99 falls 7-22 %, Mooncake's rises up to 9 %). It
prices prefill work, not requests: prefix groups whose followers are short (tens of tokens) can
end up less even by request count. It needs the clock (without one, ``now`` always 0, it is
off). The large-fleet path adds it to the workers it scores (it is >= 0, so their bounds stay
lower bounds). ``slo_aware`` does not take it (its cost is in seconds).

**Prefill clock.** ``pending_prefill_tokens`` (the router's count of uncached prompt tokens of
requests without a first token) drops only at the first token, so a worker that is 90% through
a 2 s cold prefill looks as busy as one that just started it. With a clock (``snapshot.now``,
which the live router fills with its monotonic time and the simulator with virtual time) the
policy keeps, per worker, a FIFO of the prefills *it* sent (:class:`PrefillClock`), learns the
engines' prefill speed (seconds per computed token) from their first tokens
(``WorkerState.first_token_at``), and counts as ``queued_prefill`` only what is left to compute
(each queued prefill starts when the one before it ends and takes ``progress_slack`` x the
learned time), plus other routers' queued tokens as they are. It also counts a request that
follows a prefix this policy just sent to that worker as its real (short) compute, not the
whole prompt the index did not yet know there. Without a clock nothing is learned and the
queue counts in full.

Seed 000 (one shared system prompt): pure prefix affinity sends everything to the first holder.
Here the holder wins only while its extra queue is smaller than the prefill it saves, and the
**hot-prefix rule** spreads a prefix whose holders are the bottleneck. A request is *hot* when
it matches at least ``hot_min_blocks`` blocks; its *holders* are the candidates with the longest
match (in the index). Over the last ``demand_window`` decisions the policy counts

- per prefix (identified by its deepest matched block key, when requests carry keys) the
  fraction of decisions that wanted it: ``fraction x N`` is how many workers' worth of traffic
  it draws. The prefix is spread when that exceeds its holders by more than ``hot_margin`` and
  the least-loaded holder has ``spread_margin`` or more requests in flight than the least-loaded
  candidate: one shared prompt (all the traffic) goes to every worker, a group with 1/32 of the
  traffic stays on its one holder and keeps its hits. The requests that computed a prefix
  before anyone shared it (cold decisions, kept in the window with their keys) count as its
  demand once it is seen shared, and a prefix is hot only when the lower bound of its share
  (``hot_confidence`` standard deviations, Wilson score) says so too: the first hit of a
  system prompt after the request that created it is 2 of 2 (all 7 copies at once), while 4
  requests of one group among a run's first 19 are not a fifth of the traffic;
- per worker, the fraction of decisions that wanted a prefix it holds (``hot_share`` x its fair
  share 1/N = busy holder): with keys, a busy holder's prefix is spread only at
  ``balance_margin`` requests of excess (copies cost hits; balancing pays only then) and only
  while that holder's queued prefill is at least the prefix (a copy computes the prefix: with
  less queued the request gets its first token sooner on the holder, and the copy costs the
  group a prefix of hits); without keys this is the only view of demand and applies at
  ``spread_margin``;
- and any prefix is spread when its least-loaded holder has ``overload_margin`` or more requests
  in flight than the least-loaded candidate.

The last two (balance and overload) also need the holder to have ``overload_ratio`` x the
least-loaded candidate's in-flight requests: at ~100 requests in flight per worker a margin of
16 is noise, and spreading on it copies prefixes for nothing (sglang-router's rule has the
same two parts, 64 and 1.5x).

Spreading credits every non-holder with ``spread_credit`` of the prefix (it will hold it after
this request), so the least-loaded one takes the request at once and becomes a holder. New
prefixes (no match) go to the least-loaded worker by the cost formula.

**Hot-prefix replication** (``replicate``, off by default: the routing-v2 ablation measured no
gain from it on any workload, spreading by user requests did as well; needs ``routed_ttl`` >
0). A prefix
that is hot by its own demand (the first rule) is not spread by user requests: the decision
names the least-loaded non-holders it needs (``ceil(share x N - hot_margin)`` workers in all,
counting the workers already sent it) in ``Decision.replicate_to``, and the caller sends each a
one-token copy of this request beside it. The copies compute the prefix there; no user request
waits for a cold prefill of it, and the user requests go wherever the costs say (a worker still
computing its copy counts that compute as queued). Like spreading, it waits until the holder
is busier than the least loaded by ``spread_margin`` and until the prefix has
``replicate_min_requests`` requests in the window.

**Follower hold** (``hold_followers``, on by default; needs ``routed_ttl`` > 0). When the
chosen worker is credited with the prefix only by routed memory (the index does not show it
yet), the request that computes it there (the *leader*: the first this policy sent there, or
its replica) is still computing it, or waiting to. An engine that starts the leader and this
request in the same step computes the prefix twice (vLLM does; sglang-router's workers have
the same copies in our runs). So the decision says ``after=<leader>``: the caller holds this
request until the leader's first token (at most ``hold_max_s``) and then sends it, to find the
prefix computed. A leader sent to an idle worker started at once, so nothing waits for it.

``uncached_weight`` (default 2) counts this request's uncached prompt tokens twice: leaving a
holder costs the copy's compute *and* splits the prefix's later hits. Ties (e.g. workers all
computing the same cold prefix) go to the worker whose queued prefill is oldest.

``routed_ttl`` (256 decisions; 0 = off): when the request carries its block keys (the live
router and the simulator pass them while this is > 0), the costs also credit every worker this
policy *sent* the same prefix to within the last ``routed_ttl`` decisions, or later while the
prefill that computes it there is still queued (its entry in the prefill clock's FIFO of that
worker is not done: in a burst of G prefix groups a group's next request comes ~G decisions
after its first, and the prefix reaches the index only when that prefill is done), so the
second request of a new prefix group follows the first before the first's KV events reach the
index (what sglang-router's approximate tree does), and requests of a prefix being spread may go to a new
holder still computing it (the clock says when it will be done). The hot-prefix rule itself
looks at the index only. The per-worker cap (``max_inflight``, default max_num_seqs) is enforced
by admission.

Invariant: state lives only in :class:`PolicyState` (``now``, ``replicate_to`` / ``after`` for
the decision in progress, and ``extra["kv_aware_*"]``: demand windows, decision tick,
busy-since ticks, routed-prefix memory with each worker's leader, prefill clock, and
``kv_aware_fleet``, the incremental view below), updated by :meth:`costs` / :meth:`pick`
deterministically from their inputs, so the same inputs give the same decisions.

**Large fleets** (``FAST_MIN_WORKERS``, 128, and more, over a tracked snapshot): the same
decision without a pass over every worker (:mod:`services.core.policy.builtin.kv_fast`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from services.core.latency import PREFILL_TOKEN, StepCoefficients, prefill_s
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.builtin import kv_fast
from services.core.policy.demand import ColdEntry, Demand, HolderDemand
from services.core.policy.prefill_clock import PrefillClock
from services.core.policy.recent_work import RecentWork
from services.core.policy.types import (
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    drop_departed,
    replica_id,
)


def _num(desc: str, default: float, maximum: float | None = None) -> dict:
    s = {"type": "number", "minimum": 0, "default": default, "description": desc}
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _int(desc: str, default: int, minimum: int = 1) -> dict:
    return {"type": "integer", "minimum": minimum, "default": default, "description": desc}


# the latency model's coefficients the prefill stall is priced with: the engine model's defaults
STALL_THETA = StepCoefficients().as_list()
AGE_CAP = 1000  # decisions of queue age the tie-break counts at most (KvAware.AGE_WEIGHT)
ROUTED_STRIDE = 8  # routed-prefix memory: one block key every 8 blocks (128 tokens)
ROUTED_MAX_KEYS = 200_000  # bound on its size (oldest entries go first)


@register
class KvAware(PolicyImpl):
    name = "kv_aware"
    description = "lowest estimated TTFT: queued prefill + uncached prompt + decode load"
    PARAMS = {
        "decode_weight": _num("prefill-token equivalents per in-flight request", 48.0),
        "uncached_weight": _num(
            "weight of this request's uncached prompt tokens (> 1: leaving a prefix's holder "
            "also costs the copy's compute and the later requests' hits)",
            2.0,
        ),
        "kv_pressure_weight": _num("prefill-token equivalents at 100% KV usage", 256.0),
        "imposed_weight": _num(
            "weight of the prefill stall this request imposes on each request decoding on the "
            "worker (decoding x this prompt's compute time by the latency model, in "
            "prefill-token equivalents), against its own TTFT; slo_aware's term of that name; "
            "0 = off (the new request's TTFT alone)",
            0.0,
        ),
        "stall_tpot_weight": _num(
            "weight of the TPOT this request's prefill stall adds to the requests decoding on "
            "the worker (stall / (max_tokens - 1) each, summed: WorkerState.decode_gaps), in "
            "seconds of its own TTFT per second of TPOT; slo_ttft / slo_tpot prices both as "
            "fractions of their SLO, but 25 measured best (docs/benchmarks.md); 0 = off",
            25.0,
        ),
        "conversation_weight": _num(
            "weight, in prefill tokens per token and per expected later turn, of the prompt "
            "work sent to a worker within the last conversation_window_s, added to the cost of "
            "a request that starts a new prefix there (its conversation's later turns follow "
            "it); later turns expected = s / (1 - s) for the recent share s of requests that "
            "continued a prefix, and a request that started one counts x s; 0 = off (the "
            "default); 0.15 measured best on conversations (docs/benchmarks.md)",
            0.0,
        ),
        "conversation_window_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 10.0,
            "description": "seconds of recent work conversation_weight counts",
        },
        "hot_min_blocks": _int("matched blocks from which the hot-prefix rule applies", 2),
        "spread_margin": _int(
            "holders' in-flight excess over the least loaded that spreads a prefix whose "
            "holders carry more than hot_share x their fair share of traffic",
            1,
        ),
        "hot_margin": _num(
            "a prefix (requests with block keys) is hot when its share of recent traffic x N "
            "(the workers its demand fills) exceeds its number of holders by more than this",
            0.5,
        ),
        "hot_confidence": _num(
            "standard deviations of doubt: a prefix is hot only when the lower bound of its "
            "demand share (Wilson score) x N also exceeds its holders + hot_margin, so a few "
            "requests of one group early in a run are not taken for a hot prefix (0 = the "
            "window's share itself)",
            1.0,
        ),
        "hot_share": _num(
            "a prefix's least-loaded holder is hot when the requests for prefixes it holds "
            "exceed hot_share x its fair share (1/N) of recent traffic",
            1.5,
        ),
        "balance_margin": _int(
            "with block keys: holders' in-flight excess over the least loaded that spreads a "
            "prefix whose holder is hot (hot_share) though the prefix itself is not, while "
            "that holder's queued prefill is at least the prefix",
            8,
        ),
        "overload_margin": _int(
            "holders' in-flight excess over the least loaded that spreads any prefix", 16
        ),
        "overload_ratio": _num(
            "overload_margin and balance_margin apply only when the least-loaded holder also "
            "has at least this x the least-loaded candidate's in-flight requests",
            1.5,
        ),
        "demand_window": _int("decisions over which a prefix's demand share is measured", 128),
        "routed_ttl": _int(
            "decisions for which a prefix counts as held by the worker it was routed to "
            "(before its KV events arrive); 0 = off; needs the request's block keys "
            "(RequestInfo.block_keys; the live router passes them when this is > 0)",
            256,
            minimum=0,
        ),
        "spread_credit": _num("fraction of the hot prefix credited to non-holders", 1.0, 1.0),
        "progress_min_tokens": _int(
            "prefill batches of at least this many computed tokens teach the prefill speed "
            "(seconds per token) that discounts a worker's queued prefill by the time elapsed",
            256,
        ),
        "replicate": {
            "type": "boolean",
            "default": False,
            "description": "a hot prefix (more workers' worth of demand than holders) is copied "
            "to the workers it needs by one-token copies of the request, sent beside it, "
            "instead of by spreading user requests to workers that must first compute it",
        },
        "replicate_min_requests": _int(
            "requests for a prefix in the demand window before it may be replicated (raise it "
            "if a router restart, with an empty window, copies prefixes for nothing)",
            1,
        ),
        "hold_followers": {
            "type": "boolean",
            "default": True,
            "description": "hold a request that follows a prefix this policy just sent to the "
            "chosen worker (not yet in the index) until that prefix's first request there has "
            "its first token (engines compute a prefix twice when two requests for it start "
            "in the same step)",
        },
        "hold_max_s": _num("longest a follower is held (seconds)", 5.0),
        "progress_slack": {
            "type": "number",
            "minimum": 1,
            "default": 1.5,
            "description": "a queued prefill is expected to take this x the learned speed "
            "(the engine's steps and batching make it slower than its tokens alone)",
        },
    }

    # the queue-age tie-break: a worker's cost is lowered by this much per decision since its
    # queued prefill started (up to AGE_CAP decisions), so ties go to the oldest queue, which
    # finishes first; in the cost's own unit (here prefill tokens: 0.1 at most, a tie-break)
    AGE_WEIGHT = 1e-4
    AGE_CAP = AGE_CAP  # (the module's constant, for the large-fleet path's self.AGE_CAP)

    # fleets from this size on are decided through the incremental view (kv_fast); below
    # it the full loop is faster (at 64 workers all holding the prompt: 93 vs 106 us)
    FAST_MIN_WORKERS = 128

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        """Workers left: their prefill queues and busy-since ticks go (the routed-prefix
        memory's entries for them age out with the memory; the large-fleet view drops them
        through the snapshot's watchers)."""
        clock = state.extra.get("kv_aware_clock")
        if clock is not None:
            clock.forget(live)
        drop_departed(state.extra.get("kv_aware_busy", {}), live)

    def _demand(self, state: PolicyState) -> tuple[Demand, HolderDemand]:
        d = state.extra.get("kv_aware_demand")
        if d is None or d[0].size != self.p["demand_window"]:
            size = self.p["demand_window"]
            d = state.extra["kv_aware_demand"] = (Demand(size), HolderDemand(size))
        return d

    def _clock(self, state: PolicyState) -> PrefillClock:
        c = state.extra.get("kv_aware_clock")
        if c is None:
            c = state.extra["kv_aware_clock"] = PrefillClock(
                self.p["progress_min_tokens"], self.p["progress_slack"]
            )
        return c

    def _routed_entries(
        self, rid: str, keys: tuple[int, ...], state: PolicyState, tick: int
    ) -> tuple[list[tuple[int, dict[str, tuple[int, str, int]]]], dict[str, str]]:
        """The routed memory's entries for this prompt, deepest first, from ``hot_min_blocks``
        on: (depth, {worker: (tick, leader, nth)}) at every ``ROUTED_STRIDE``-th block and the
        last; and the (empty) leaders dict the caller fills. Leaves ``kv_aware_last`` (every
        depth's entry or None, looked up once: :meth:`pick` writes there) and
        ``kv_aware_leaders`` for :meth:`pick`."""
        extra = state.extra
        mem: dict[int, dict[str, tuple[int, str, int]]] = extra.setdefault("kv_aware_routed", {})
        n = len(keys)
        below = range(n - n % ROUTED_STRIDE, 0, -ROUTED_STRIDE)
        depths = [n, *below] if n % ROUTED_STRIDE else below
        found = [mem.get(keys[d - 1]) for d in depths]
        extra["kv_aware_last"] = (keys, depths, found, tick, rid)
        leaders: dict[str, str] = {}
        extra["kv_aware_leaders"] = leaders
        floor = self.p["hot_min_blocks"]
        held = [(d, e) for d, e in zip(depths, found, strict=True) if e and d >= floor]
        return held, leaders

    def _with_routed(
        self,
        rid: str,
        keys: tuple[int, ...],
        cands: list[WorkerState],
        ovs: list[int],
        state: PolicyState,
        tick: int,
    ) -> list[int]:
        """Overlaps raised by where this router recently *sent* the same prefix (its KV events
        may not have reached the index yet: the first request of a group is still computing
        it). Remembers the block key at every ``ROUTED_STRIDE``-th block and the last one."""
        held, leaders = self._routed_entries(rid, keys, state, tick)
        if not held:
            return ovs
        ttl = self.p["routed_ttl"]
        routed: dict[str, int] = {}
        # per candidate, the deepest depth with a fresh entry (and its leader): deepest first,
        # looking only for the candidates not found yet, until every candidate is found. Other
        # workers' entries could change nothing this decision reads (the overlaps are the
        # candidates'; the leader read is the chosen one's). A stale entry (older than ``ttl``
        # ticks) while the prefill that computes it there is done never counts again (ticks only
        # grow, the clock's queue only moves on): it is dropped when met, so it is not looked at
        # again. Fresh = within ``ttl`` decisions, or beyond while that prefill (the leader's
        # entry in the prefill clock) is still queued: in a burst of G groups a group's next
        # request comes ~G decisions later, and its prefix reaches the index only when that
        # prefill is done.
        done_n = self._clock(state).done_n
        missing = {w.worker_id for w in cands}
        for j, (d, e) in enumerate(held):
            if len(missing) <= 2:
                # a few left: each looks down the remaining depths by itself (cheaper than a
                # set intersection per depth)
                rest = held[j:]
                for wid in list(missing):
                    for d2, e2 in rest:
                        ent = e2.get(wid)
                        if ent is not None:
                            if tick - ent[0] <= ttl or done_n.get(wid, 0) < ent[2]:
                                routed[wid] = d2
                                leaders[wid] = ent[1]
                                break
                            del e2[wid]
                break
            for wid in e.keys() & missing:  # in C
                at, lead, nth = e[wid]
                if tick - at <= ttl or done_n.get(wid, 0) < nth:
                    routed[wid] = d
                    leaders[wid] = lead
                    missing.discard(wid)
                else:
                    del e[wid]
            if not missing:
                break
        if not routed:
            return ovs
        get = routed.get
        return [r if (r := get(w.worker_id, 0)) > o else o for w, o in zip(cands, ovs, strict=True)]

    def _queued(self, w: WorkerState, state: PolicyState) -> float:
        """The worker's queued prefill in tokens, as :meth:`costs` counts it (the prefill
        clock's estimate when this policy sent it work, else ``pending_prefill_tokens``)."""
        clock = self._clock(state)
        if clock.fifo.get(w.worker_id):
            clock.observe(w, state.now)
            return clock.queued(w, state.now)
        return w.pending_prefill_tokens

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        wid = super().pick(costs, state)
        conv = state.extra.pop("kv_aware_conv", None)
        if conv is not None and conv[0] in (None, wid):
            state.extra["kv_aware_recent"].record(state.now, wid, conv[1], conv[0] == wid)
        last = state.extra.pop("kv_aware_last", None)
        leaders = state.extra.pop("kv_aware_leaders", None)
        disp = state.extra.pop("kv_aware_dispatch", None)
        cands: list[WorkerState] = disp[0] if disp is not None else []
        ids = [w.worker_id for w in cands]
        chosen = ids.index(wid) if cands else None  # its position among the candidates
        if last is not None:
            keys, depths, found, tick, rid = last
            ttl = self.p["routed_ttl"]
            mem: dict[int, dict[str, tuple[int, str, int]]] = state.extra["kv_aware_routed"]
            clock = self._clock(state)
            done_n, sent_n = clock.done_n, clock.sent_n
            # (worker, its leader) for the chosen worker and the replicas: a request sent to an
            # idle worker starts its prefill at once, nobody need wait for it ("" = no leader)
            sent = [(wid, "" if chosen is not None and cands[chosen].inflight == 0 else rid)]
            for rw in state.replicate_to:
                if rw != wid:
                    idle = cands and cands[ids.index(rw)].inflight == 0
                    sent.append((rw, "" if idle else replica_id(rid, rw)))
            fresh = [(w, (tick, r, sent_n.get(w, 0) + 1)) for w, r in sent]
            for d, e in zip(depths, found, strict=True):
                if e is None:
                    k = keys[d - 1]
                    e = mem.get(k)
                    if e is None:
                        e = mem[k] = {}
                for w, new in fresh:
                    old = e.get(w)
                    # the leader (the request that computes the prefix there) stays the leader
                    # while the entry holds (see _with_routed)
                    if old is None:
                        e[w] = new
                    else:
                        live = tick - old[0] <= ttl or done_n.get(w, 0) < old[2]
                        e[w] = (tick, old[1], old[2]) if live else new
            # oldest-inserted keys go first (a prefix still in use is re-added at its next pick)
            while len(mem) > ROUTED_MAX_KEYS:
                del mem[next(iter(mem))]
        if disp is not None:
            cands, idx, ovs, prompt, extra = disp
            clock = self._clock(state)
            # the chosen worker and the replicas, in candidate order
            assert chosen is not None
            at = [chosen]
            if extra:
                at = sorted(at + [ids.index(x) for x in extra if x != wid])
            for j in at:
                w, i, o = cands[j], idx[j], ovs[j]
                bs = w.capacity.block_size
                if w.worker_id == wid:
                    lead = leaders.get(wid) if leaders and self.p["hold_followers"] else None
                    # a follower of a prefix this policy sent here that the index does not show
                    # yet: its leader is computing it or waiting to; sent now, it may start in
                    # the leader's step and compute the prefix a second time
                    if lead and o > i:
                        state.after = lead
                        state.hold_s = self.p["hold_max_s"]
                    clock.dispatched(
                        wid, state.now, max(0, prompt - i * bs), max(0, prompt - o * bs)
                    )
                elif w.worker_id in extra:  # a replica: it computes what it does not hold
                    clock.dispatched(
                        w.worker_id, state.now, max(0, prompt - i * bs), extra[w.worker_id]
                    )
            fleet = state.extra.get("kv_aware_fleet")
            if fleet is not None:  # their queued prefill changed: due for bookkeeping
                fleet.dirty.add(wid)
                fleet.dirty.update(extra)
        return wid

    def _plan_replicas(
        self,
        want: float,
        best: int,
        cands: list[WorkerState],
        ovs: list[int],
        state: PolicyState,
    ) -> tuple[str, ...]:
        """The non-holders a hot prefix is copied to now: as many as its demand (``want``
        workers' worth) exceeds the workers that hold it or were just sent it (``ovs``, with
        routed memory), the least loaded first."""
        have = sum(1 for o in ovs if o >= best)
        need = math.ceil(want) - have
        if need <= 0:
            return ()
        dw = self.p["decode_weight"]
        others = [
            (self._queued(w, state) + dw * w.inflight, w.worker_id)
            for w, o in zip(cands, ovs, strict=True)
            if o < best
        ]
        others.sort()
        return tuple(wid for _, wid in others[:need])

    def _hot_prefix(
        self,
        state: PolicyState,
        keys: tuple[int, ...],
        best: int,
        holders: list[WorkerState],
        n: int,
        least: Callable[[], int],
        plan: Callable[[float], tuple[str, ...]],
    ) -> tuple[int, tuple[str, ...]]:
        """The hot-prefix rule (module docstring) for a prompt matched ``best`` >=
        ``hot_min_blocks`` blocks deep by ``holders`` (in candidate order) among ``n``
        candidates: records the decision in the demand windows and returns (the spread credit
        for non-holders, the workers to copy the prefix to). ``least`` gives the fewest requests
        in flight on a candidate and ``plan`` the replicas for a demand of ``want`` workers'
        worth; both are called only when needed. Shared by the full and the large-fleet path."""
        p = self.p
        demand, hdemand = self._demand(state)
        hdemand.add(tuple(w.worker_id for w in holders))
        # the prefix's identity: its deepest matched block key (none without keys)
        pid = keys[best - 1] if best <= len(keys) else None
        if pid is not None:
            demand.claim(pid, best)
        demand.add(pid)
        if len(holders) >= n:
            return 0, ()
        replicas: tuple[str, ...] = ()
        lead = min(holders, key=lambda w: (w.inflight, w.worker_id))
        low = least()
        excess = lead.inflight - low
        # under heavy load an absolute excess is noise: balancing and overload also need the
        # holder busier by a ratio (what sglang-router checks too)
        lopsided = lead.inflight >= p["overload_ratio"] * low
        busy_holder = hdemand.fraction(lead.worker_id) * n > p["hot_share"]
        if pid is not None:
            # a prefix wanted by more workers' worth of traffic than it has holders: hot when
            # even a low estimate of its demand says so (a few decisions say little); how many
            # workers it wants is the window's own fraction
            sure = demand.fraction_low(pid, p["hot_confidence"]) * n - p["hot_margin"]
            want = demand.fraction(pid) * n - p["hot_margin"]
            hot = sure > len(holders)
            if hot and p["replicate"] and p["routed_ttl"] > 0:
                # like spreading, only once the holders are busier than the least loaded (an
                # idle cluster, e.g. after a restart, copies nothing)
                if (
                    excess >= p["spread_margin"]
                    and demand.count.get(pid, 0) >= p["replicate_min_requests"]
                ):
                    replicas = plan(want)
                # it spreads by copies (or is about to), never by this request
                hot = False
            spread = (hot and excess >= p["spread_margin"]) or (
                busy_holder
                and excess >= p["balance_margin"]
                and lopsided
                # a copy pays only when the holder's queue is longer than the prefix
                and self._queued(lead, state) >= best * lead.capacity.block_size
            )
        else:  # without keys prefixes are told apart only by their holders
            spread = busy_holder and excess >= p["spread_margin"]
        if spread or (excess >= p["overload_margin"] and lopsided):
            return int(best * p["spread_credit"]), replicas
        return 0, replicas

    def _cold(self, state: PolicyState, keys: tuple[int, ...]) -> None:
        """A decision that matched no shared prefix, in the demand windows (with its keys, so
        a prefix it turns out to have created can claim it)."""
        demand, hdemand = self._demand(state)
        demand.add(ColdEntry(keys) if keys else None)
        hdemand.add(())

    def _prelude(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> tuple[list[int], int, dict[str, int], int]:
        """The part of :meth:`costs` before the per-worker loop: the tick, routed-prefix
        memory, the hot-prefix rule and replicas. Returns (overlaps per candidate with routed
        memory and replicas, the spread credit, replica compute per worker, the tick); sets
        ``kv_aware_dispatch`` for :meth:`pick`."""
        p = self.p
        prompt = req.prompt_tokens
        # the hot-prefix rule looks at the index (workers that hold the prefix *now*); the costs
        # also credit where the prefix was just routed (it will be there before this request runs)
        idx = [overlaps.get(w.worker_id, 0) for w in cands]
        tick = state.extra["kv_aware_tick"] = state.extra.get("kv_aware_tick", 0) + 1
        keys = req.block_keys
        ovs = idx
        if keys and p["routed_ttl"] > 0:
            ovs = self._with_routed(req.request_id, keys, cands, idx, state, tick)
        best = max(idx)
        spread_to = 0
        replicas: tuple[str, ...] = ()
        extra: dict[str, int] = {}
        if best >= p["hot_min_blocks"]:
            spread_to, replicas = self._hot_prefix(
                state,
                keys,
                best,
                [w for w, o in zip(cands, idx, strict=True) if o >= best],
                len(cands),
                lambda: min([w.inflight for w in cands]),
                lambda want: self._plan_replicas(want, best, cands, ovs, state),
            )
        else:
            self._cold(state, keys)
        if replicas:
            state.replicate_to = replicas
            # the copies go out with this request: those workers will hold the prefix, after
            # computing it (not yet in the clock: the caller adds them after this decision)
            rep = set(replicas)
            extra = {
                w.worker_id: max(0, prompt - o * w.capacity.block_size)
                for w, o in zip(cands, ovs, strict=True)
                if w.worker_id in rep
            }
            ovs = [best if w.worker_id in rep else o for w, o in zip(cands, ovs, strict=True)]
        state.extra["kv_aware_dispatch"] = (cands, idx, ovs, prompt, extra)
        return ovs, spread_to, extra, tick

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        ovs, spread_to, extra, tick = self._prelude(req, cands, overlaps, state)
        prompt = req.prompt_tokens
        now = state.now
        clock = self._clock(state)
        own_of = clock.own
        fifo = clock.fifo
        # ties (e.g. workers each computing the same cold prefix) go to the worker whose queued
        # prefill is oldest: it started first, so it finishes first
        busy: dict[str, int] = state.extra.setdefault("kv_aware_busy", {})
        out: dict[str, float] = {}
        worker_cost = self._worker_cost
        aw = self.AGE_WEIGHT
        for w, ov in zip(cands, ovs, strict=True):
            wid = w.worker_id
            queued = w.pending_prefill_tokens
            if queued > 0:
                since = busy.setdefault(wid, tick)
                age = tick - since if tick - since < AGE_CAP else AGE_CAP
                # what is left to compute of the queue, by the time since it was sent
                # (:meth:`_queued`, inline)
                if fifo.get(wid):
                    if own_of.get(wid, 0) > queued:  # observe's own test: some are done
                        clock.observe(w, now)
                    queued = clock.queued(w, now)
            else:
                busy.pop(wid, None)
                age = 0
                if fifo.get(wid) and own_of.get(wid, 0) > queued:
                    clock.observe(w, now)
            if ov < spread_to:
                ov = spread_to
            if extra:
                queued += extra.get(wid, 0)
            cached = ov * w.capacity.block_size
            out[wid] = (
                worker_cost(req, w, queued, prompt - cached if cached < prompt else 0, state)
                - aw * age
            )
        if self.p.get("conversation_weight", 0.0) > 0.0:  # (slo_aware has no such term)
            matched = [(w.worker_id, o) for w, o in zip(cands, ovs, strict=True)]
            conv = self._conversation(matched, prompt, cands[0].capacity.block_size, state)
            if conv is not None:
                cw, work = conv
                for wid, load in work.items():
                    if wid in out:
                        out[wid] += cw * load
        return out

    def _conversation(
        self, matched: list[tuple[str, int]], prompt: int, bs: int, state: PolicyState
    ) -> tuple[float, dict[str, float]] | None:
        """The conversation term (module docstring) for a request whose candidates match
        ``matched`` (worker, blocks of ``bs`` tokens; those matching nothing may be left out):
        for one that starts a new prefix, (the price per token of recent work, each worker's
        recent work); None for one that follows a prefix, or when no later turn is expected.
        Leaves for :meth:`pick` what to record (a start, or a continuation when exactly one
        worker holds the prefix). The full loop and the large-fleet path both call it."""
        state.extra.pop("kv_aware_conv", None)  # (a decision that was never picked)
        if state.now <= 0.0:  # no clock (now always 0): no window to count recent work in
            return None
        recent = state.extra.get("kv_aware_recent")
        if recent is None or recent.window_s != self.p["conversation_window_s"]:
            recent = state.extra["kv_aware_recent"] = RecentWork(self.p["conversation_window_s"])
        recent.expire(state.now)
        best = max((o for _, o in matched), default=0)
        if best >= self.p["hot_min_blocks"]:
            holders = [wid for wid, o in matched if o == best]
            if len(holders) == 1:
                state.extra["kv_aware_conv"] = (holders[0], max(0, prompt - best * bs))
            return None
        state.extra["kv_aware_conv"] = (None, max(0, prompt - best * bs))
        # the price of the worker's conversations, per turn this new one is expected to bring
        cw = self.p["conversation_weight"] * recent.turns_ahead()
        return (cw, recent.work) if cw > 0.0 else None

    def fast_costs(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
        filtered: dict[str, str],
    ) -> dict[str, float] | None:
        """Large fleets: :func:`services.core.policy.builtin.kv_fast.fast_costs` (its bounds
        are this class's :meth:`_worker_cost`'s: a subclass with its own :meth:`costs` or
        :meth:`_worker_cost` brings its own large-fleet path, or none)."""
        if (
            type(self).costs is not KvAware.costs
            or type(self)._worker_cost is not KvAware._worker_cost
        ):
            return None
        return kv_fast.fast_costs(self, req, snapshot, overlaps, state, filtered)

    def _worker_cost(
        self,
        req: RequestInfo,
        w: WorkerState,
        queued: float,
        uncached: int,
        state: PolicyState,
    ) -> float:
        """THE cost of sending ``req`` to ``w`` (before the tie-break by queue age), given
        its queued prefill and this prompt's uncached tokens there as the rules above count
        them: the module docstring's formula, the one place it is written (the full loop
        and the large-fleet path both call it). ``slo_aware`` replaces it with its latency
        model."""
        p = self.p
        cost = (
            queued
            + p["uncached_weight"] * uncached
            + p["decode_weight"] * w.inflight
            + p["kv_pressure_weight"] * kv_usage(w)
        )
        if uncached > 0:
            # the prefill stall (module docstring), priced per decoder by the plain stall
            # (imposed_weight, decoding = in flight past the first token) and by the TPOT it
            # adds (stall_tpot_weight), in prefill tokens
            per_stall = 0.0
            iw = p["imposed_weight"]
            if iw > 0.0:
                fifo = self._clock(state).fifo.get(w.worker_id)
                d = w.inflight - len(fifo) if fifo else w.inflight
                if d > 0:
                    per_stall += iw * d
            sw = p["stall_tpot_weight"]
            if sw > 0.0 and w.decode_gaps > 0.0:
                per_stall += sw * w.decode_gaps
            if per_stall > 0.0:
                th = STALL_THETA
                cost += per_stall * prefill_s(th, uncached, req.prompt_tokens) / th[PREFILL_TOKEN]
        return cost


def kv_usage(w: WorkerState) -> float:
    """The worker's KV usage in [0, 1]: from its free blocks when known, else its reported
    usage (0 when unknown)."""
    free = w.kv_blocks_free
    if free is None:
        return w.kv_usage or 0.0
    blocks = w.capacity.num_gpu_blocks
    return 1.0 - free / blocks if free < blocks else 0.0
