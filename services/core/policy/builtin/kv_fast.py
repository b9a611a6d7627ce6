"""``kv_aware``'s decision over a large fleet without a pass over every worker.

From ``KvAware.FAST_MIN_WORKERS`` (128) workers on, over a tracked snapshot, when every routable
worker passes the filters for the request (checked on aggregates kept by
:class:`~services.core.policy.fleet.FleetView`: fewest free blocks, most requests in flight,
smallest capacity): a worker that holds nothing of the prompt costs its own load terms plus
request constants; each worker's lower bound of those (queued prefill at least what other
routers queued, or the clock's exact figure while no speed is learned; minus the 0.1 tie-break
of queue age) is kept in a heap, refreshed when the worker changes or is sent a request. The
holders (index, routed memory, replicas) and then the others in bound order are scored with the
loop's own expression until the bound passes the lowest cost + the tie margin, so the pick and
its tie set are those of the full loop; the loop's bookkeeping (busy-since ticks, prefill-clock
observations, in snapshot order) runs for the changed workers only, where it is not a no-op.

:func:`fast_admit`, :func:`fast_prelude` and :func:`fast_dispatch` are shared with
``slo_aware``'s large-fleet path (:mod:`services.core.policy.builtin.slo_fast`). Invariant: the
pick, its tie set and every state change equal the full path's (property-tested in
tests/test_policy_fleet.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.core.keys import blocks_needed
from services.core.policy import filters
from services.core.policy.base import PolicyState
from services.core.policy.fleet import INF, FleetView, Row, exceeds
from services.core.policy.types import ClusterSnapshot, RequestInfo, WorkerState

if TYPE_CHECKING:
    from services.core.policy.builtin.kv_aware import KvAware


@dataclass(slots=True)
class FastPrelude:
    """What the large-fleet path's shared part (:func:`fast_prelude`) hands a policy's cost
    search: the view, the overlaps (index; with routed memory and replicas), the spread
    credit, replica compute, block size, tick, and the rows changed since the last decision
    (their busy-since ticks and prefill-clock observations done, in snapshot order; the
    clock's speed at each position in ``spt_at``, starting from ``start_spt``)."""

    fv: FleetView
    idx: dict[str, int]
    ov_of: dict[str, int]
    spread_to: int
    extra: dict[str, int]
    bs: int
    tick: int
    dirty: list[Row]
    spt_at: list[tuple[int, float | None]]
    start_spt: float | None


def fast_admit(
    self: KvAware,
    req: RequestInfo,
    snapshot: ClusterSnapshot,
    state: PolicyState,
    filtered: dict[str, str],
) -> FleetView | None:
    """The policy's synced view of a tracked snapshot of ``FAST_MIN_WORKERS`` or more workers
    when every routable worker serves the request's model and passes the fit filters for it
    (``filtered`` then holds the unroutable ones' verdicts), else None; changes no policy
    state but the view."""
    if len(snapshot.workers) < self.FAST_MIN_WORKERS:
        return None
    fv = state.extra.get("kv_aware_fleet")
    if fv is None or not fv.live(snapshot):
        fv = state.extra["kv_aware_fleet"] = FleetView(snapshot)
    fv.sync()
    n = fv.n
    if not n or len(fv.block_sizes) != 1:
        return None
    model = req.model
    if model and fv.models.get(model, 0) != n:
        return None
    bs = next(iter(fv.block_sizes))
    prompt = req.prompt_tokens
    need = blocks_needed(prompt, req.max_tokens, bs)
    if need > fv.min_blocks or prompt + req.max_tokens > fv.min_mml:
        return None
    if fv.min_seq_room() <= 0 or need > fv.min_free():
        return None
    if self.max_inflight is not None and fv.max_inflight() >= self.max_inflight:
        return None
    # every routable worker is a candidate: the filters' verdicts are the unroutable ones'
    if len(fv.rows) > n:
        filters.routable_for_model(fv.unroutable_states(), model, filtered)
    return fv


def fast_prelude(
    self: KvAware,
    req: RequestInfo,
    fv: FleetView,
    overlaps: dict[str, int],
    state: PolicyState,
) -> FastPrelude:
    """:meth:`KvAware._prelude` with every routable worker as a candidate, in O(holders),
    then the cost loop's per-worker bookkeeping for the changed workers (where it is not a
    no-op)."""
    p = self.p
    now = state.now
    n = fv.n
    prompt = req.prompt_tokens
    bs = next(iter(fv.block_sizes))
    rows = fv.rows
    routable = fv.routable
    idx = {w: o for w, o in overlaps.items() if o > 0 and w in routable}
    tick = state.extra["kv_aware_tick"] = state.extra.get("kv_aware_tick", 0) + 1
    keys = req.block_keys
    ov_of = idx
    routed: dict[str, int] = {}
    if keys and p["routed_ttl"] > 0:
        routed = _routed_fast(self, req.request_id, keys, routable, state, tick)
        if routed:
            ov_of = dict(idx)
            for w, d in routed.items():
                if d > ov_of.get(w, 0):
                    ov_of[w] = d
    best = max(idx.values(), default=0)
    spread_to = 0
    replicas: tuple[str, ...] = ()
    extra: dict[str, int] = {}
    if best >= p["hot_min_blocks"]:

        def plan(want: float) -> tuple[str, ...]:
            # _plan_replicas names nobody (and reads nothing) unless the prefix wants more
            # workers than hold it or were sent it
            have = sum(1 for o in ov_of.values() if o >= best)
            if math.ceil(want) - have <= 0:
                return ()
            cands = fv.routable_states()
            ovs = [ov_of.get(w.worker_id, 0) for w in cands]
            return self._plan_replicas(want, best, cands, ovs, state)

        holders = sorted((rows[w] for w, o in idx.items() if o >= best), key=lambda x: x.pos)
        spread_to, replicas = self._hot_prefix(
            state, keys, best, [x.obj for x in holders], n, fv.min_inflight, plan
        )
    else:
        self._cold(state, keys)
    if replicas:
        state.replicate_to = replicas
        extra = {w: max(0, prompt - ov_of.get(w, 0) * bs) for w in replicas}
        ov_of = dict(ov_of)
        for w in replicas:
            ov_of[w] = best
    clock = self._clock(state)
    fifo = clock.fifo
    busy: dict[str, int] = state.extra.setdefault("kv_aware_busy", {})
    # the per-worker bookkeeping of the cost loop (busy-since ticks, prefill-clock
    # observations), due only for the workers changed since it last ran there, in snapshot
    # order (observations teach the clock's speed in that order); the speed each position saw
    dirty = sorted((rows[w] for w in fv.dirty if w in routable), key=lambda x: x.pos)
    spt_at: list[tuple[int, float | None]] = []
    start_spt = clock.spt
    for x in dirty:
        w = x.obj
        wid = w.worker_id
        if w.pending_prefill_tokens > 0:
            busy.setdefault(wid, tick)
        else:
            busy.pop(wid, None)
        if fifo.get(wid):
            before = clock.spt
            clock.observe(w, now)
            if clock.spt != before:
                spt_at.append((x.pos, clock.spt))
        fv.dirty.discard(wid)
    return FastPrelude(fv, idx, ov_of, spread_to, extra, bs, tick, dirty, spt_at, start_spt)


def fast_dispatch(state: PolicyState, fp: FastPrelude, out: dict[str, float], prompt: int) -> None:
    """What :meth:`KvAware.pick` reads: the evaluated workers and the replicas, in snapshot
    order."""
    rows, idx, ov_of, extra = fp.fv.rows, fp.idx, fp.ov_of, fp.extra
    order = sorted(out.keys() | extra.keys(), key=lambda w: rows[w].pos)
    state.extra["kv_aware_dispatch"] = (
        [rows[w].obj for w in order],
        [idx.get(w, 0) for w in order],
        [ov_of.get(w, 0) for w in order],
        prompt,
        extra,
    )


def fast_costs(
    self: KvAware,
    req: RequestInfo,
    snapshot: ClusterSnapshot,
    overlaps: dict[str, int],
    state: PolicyState,
    filtered: dict[str, str],
) -> dict[str, float] | None:
    """:meth:`KvAware.costs` (and the filters before it) over a tracked snapshot, scoring the
    holders of the prompt and the other workers in order of a lower bound of their cost
    (:class:`~services.core.policy.fleet.FleetView`) until the bound passes the lowest cost +
    the tie margin: the same pick, the same state changes, O(holders + changes) per decision.
    None (nothing changed) unless every routable worker serves the model and passes the fit
    filters for this request (then :func:`decide` runs the full path). Only for
    ``kv_aware``'s own cost (:meth:`KvAware.fast_costs` checks)."""
    fv = fast_admit(self, req, snapshot, state, filtered)
    if fv is None:
        return None
    fp = fast_prelude(self, req, fv, overlaps, state)
    p = self.p
    now = state.now
    prompt = req.prompt_tokens
    rows = fv.rows
    ov_of, spread_to, extra, bs, tick = fp.ov_of, fp.spread_to, fp.extra, fp.bs, fp.tick
    dirty, spt_at, start_spt = fp.dirty, fp.spt_at, fp.start_spt
    clock = self._clock(state)
    fifo = clock.fifo
    own = clock.own
    busy: dict[str, int] = state.extra["kv_aware_busy"]
    # the cost is the policy's _worker_cost; it grows by uncached_weight per uncached token
    # (tests/test_policy_kv_aware.py pins that), which the bounds below rely on
    worker_cost = self._worker_cost
    uw = p["uncached_weight"]
    aw, age_cap = self.AGE_WEIGHT, self.AGE_CAP
    spt_now = clock.spt
    # the conversation term (KvAware._conversation): >= 0, added to the workers scored below,
    # so the bounds (without it) stay lower bounds
    conv = None
    if p.get("conversation_weight", 0.0) > 0.0:
        conv = self._conversation(list(ov_of.items()), prompt, bs, state)
    conv_w, conv_work = conv if conv is not None else (0.0, {})
    # bounds: the queued prefill is at least what other routers queued (the clock only adds);
    # without a learned speed the clock counts every entry in full (no time dependence), so
    # the bound is the value itself; once the speed is learned (it never unlearns) every
    # bound made without it is redone
    if spt_now is not None and state.extra.get("kv_aware_fleet_nospt", True):
        state.extra["kv_aware_fleet_nospt"] = False
        dirty = [x for x in rows.values() if x.routable]
    for x in dirty:
        w = x.obj
        wid = w.worker_id
        if spt_now is None:
            q = clock.queued(w, now)
        else:
            q = w.pending_prefill_tokens
            if fifo.get(wid):
                q = q - own[wid]
                q = float(q) if q > 0 else 0.0
        # the cost with nothing uncached (the policy's one formula, THE cost)
        fv.set_bound(wid, worker_cost(req, w, q, 0, state))

    def cost_of(w: WorkerState, ov: int, pos: int) -> float:
        # the cost loop's queue accounting in :meth:`KvAware.costs` (its bookkeeping done
        # above), then the policy's cost
        wid = w.worker_id
        queued = w.pending_prefill_tokens
        if queued > 0:
            since = busy.get(wid, tick)
            age = tick - since if tick - since < age_cap else age_cap
            if fifo.get(wid):
                if spt_at:
                    clock.spt = _spt_at(spt_at, pos, start_spt)
                queued = clock.queued(w, now)
                clock.spt = spt_now
        else:
            age = 0
        if ov < spread_to:
            ov = spread_to
        if extra:
            queued += extra.get(wid, 0)
        cached = ov * w.capacity.block_size
        uncached = prompt - cached if cached < prompt else 0
        c = worker_cost(req, w, queued, uncached, state) - aw * age
        if conv_w:
            load = conv_work.get(wid)
            if load:
                c += conv_w * load
        return c

    out: dict[str, float] = {}
    # the holders (by the index or routed memory) and replicas first, in order of their own
    # bound (the same bound with their uncached part and replica compute)
    bound = fv.bound
    lowest = INF
    names = ov_of.keys() | extra.keys()
    # per matched depth, the uncached part of the bound minus the age tie-break (the margin
    # below covers the rounding of the bound)
    terms: dict[int, float] = {}
    for o in {*ov_of.values(), 0}:
        o = o if o > spread_to else spread_to
        c = o * bs
        terms[o] = uw * (prompt - c if c < prompt else 0) - aw * age_cap
    get_ov = ov_of.get
    special = sorted(
        [(bound[w] + terms[o if (o := get_ov(w, 0)) > spread_to else spread_to], w) for w in names]
    )
    if extra:  # a replica's bound counts the prefill it is sent (its queue grows by that)
        special = sorted((lb + extra.get(w, 0), w) for lb, w in special)
    for lb, wid in special:
        if exceeds(lb, lowest):
            break
        x = rows[wid]
        c = out[wid] = cost_of(x.obj, ov_of.get(wid, 0), x.pos)
        if c < lowest:
            lowest = c
    special = names
    # every other worker has overlap spread_to: its cost is at least its bound + the request's
    # uncached term - the age tie-break (at most aw * age_cap)
    cached = spread_to * bs
    rest = uw * (prompt - cached if cached < prompt else 0) - aw * age_cap
    try:
        for bound, x in fv.by_bound():
            lb = bound + rest
            if exceeds(lb, lowest):
                break
            wid = x.obj.worker_id
            if wid in out or wid in special:
                continue
            c = out[wid] = cost_of(x.obj, 0, x.pos)
            if c < lowest:
                lowest = c
    finally:
        fv.restore()
    fast_dispatch(state, fp, out, prompt)
    return out


def _spt_at(spt_at: list[tuple[int, float | None]], pos: int, start: float | None):
    s = start
    for p, v in spt_at:
        if p > pos:
            break
        s = v
    return s


def _routed_fast(
    self: KvAware,
    rid: str,
    keys: tuple[int, ...],
    routable: set[str],
    state: PolicyState,
    tick: int,
) -> dict[str, int]:
    """:meth:`KvAware._with_routed` for every routable worker as a candidate: per worker in
    the memory's entries, the deepest depth with a fresh entry (and its leader); O(entries)."""
    held, leaders = self._routed_entries(rid, keys, state, tick)
    done_n = self._clock(state).done_n
    ttl = self.p["routed_ttl"]
    routed: dict[str, int] = {}
    n = len(routable)
    for d, e in held:
        if len(routed) == n:
            break
        for wid in e.keys() - routed.keys():  # in C
            if wid not in routable:
                continue
            at, lead, nth = e[wid]
            if tick - at <= ttl or done_n.get(wid, 0) < nth:  # as in _with_routed
                routed[wid] = d
                leaders[wid] = lead
            else:
                del e[wid]
    return routed
