"""``slo_aware``'s decision over a large fleet without a pass over every worker.

The same pick as :meth:`SloAware.costs <services.core.policy.builtin.slo_aware.SloAware.costs>`
over every worker, found by scoring workers in order of lower bounds of their cost until no
unscored worker can be chosen. With a worker's coefficients ``ov, pt, pa, ds, dk``, its
queued prefill ``q``, its decoding sequences ``d``, the running mean context ``ctx`` and this
prompt's uncached tokens ``u``, its predicted cost is

    cost >= [ov + ds*d + pt*q] + age term
            + d * (dk_min*ctx + imposed_weight*P(u)) + (1 + compute_weight) * P(u)

(at least one engine step; ``P(u)``, this prompt's prefill time with the fleet's lowest
coefficients, is at most its time on any worker). The age term is the queue-age tie-break
exactly: 0 for an idle worker, ``-AGE_WEIGHT * AGE_CAP`` for a queue at the cap, and
``AGE_WEIGHT * (since - tick)`` below it (the key then holds ``AGE_WEIGHT * since``; a worker
reaching the cap is moved when the tick gets there). The bracket is a per-worker key in
:class:`~services.core.policy.fleet.FleetView`'s heaps, one heap per (``d``, kind of age), so
each group's bound is completed exactly per request; keys are refreshed when the worker
changes, is sent a request or has its model recalibrated (the queue counts in full until each
first token, so ``q`` does not drift with time). The prompt's holders are scored first, then
the groups' heads in order of their bound, until it passes the lowest cost of a worker
predicted to meet the SLO (+ the tie margin); while none is found, a group is passed over
only once its bound also proves its workers miss the SLO (TTFT or TPOT lower bound above the
target), so a fleet where nobody meets it is scored whole.

Applies when ``kv_aware``'s shortcut does (every routable worker passes the filters, a
tracked snapshot of ``FAST_MIN_WORKERS`` or more) and the pick is by cost (``feasible_pick:
"cost"``, the default). Invariant: the pick, its tie set, the shed verdict and every state
change equal the full path's (property-tested in tests/test_policy_fleet.py).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from services.core.policy.base import PolicyState
from services.core.policy.builtin.kv_aware import AGE_CAP
from services.core.policy.builtin.kv_fast import fast_admit, fast_dispatch, fast_prelude
from services.core.policy.fleet import INF, Row, exceeds
from services.core.policy.types import ClusterSnapshot, RequestInfo, WorkerState

if TYPE_CHECKING:
    from services.core.policy.builtin.slo_aware import SloAware

IDLE, CAPPED, YOUNG = 0, 1, 2  # kinds of queue age: none queued, at the cap, below it


def fast_costs(
    self: SloAware,
    req: RequestInfo,
    snapshot: ClusterSnapshot,
    overlaps: dict[str, int],
    state: PolicyState,
    filtered: dict[str, str],
) -> dict[str, float] | None:
    p = self.p
    if p["feasible_pick"] != "cost":
        return None
    fv = fast_admit(self, req, snapshot, state, filtered)
    if fv is None:
        return None
    rows = fv.rows

    def routable_worker(wid: str) -> WorkerState | None:
        x = rows.get(wid)
        return x.obj if x is not None and x.routable else None

    ttft_slo, tpot_slo = self._calibrate(req, state, routable_worker)
    fp = fast_prelude(self, req, fv, overlaps, state)
    now = state.now
    tick = fp.tick
    clock = self._clock(state)
    fifo = clock.fifo
    busy: dict[str, int] = state.extra["kv_aware_busy"]
    models = state.extra.setdefault("slo_models", {})
    prior = self.prior.as_list()
    aw = self.AGE_WEIGHT  # the queue-age tie-break per decision

    def set_key(x: Row) -> None:
        # the worker's key and group (decoding sequences x 3 + its kind of queue age)
        w = x.obj
        wid = w.worker_id
        f = fifo.get(wid)
        d = w.inflight - len(f) if f else w.inflight
        if d < 0:
            d = 0
        m = models.get(wid)
        ov_s, pt, _, ds, _ = m.theta if m is not None else prior
        if w.pending_prefill_tokens > 0:
            core = ov_s + ds * d + pt * clock.queued(w, now)
            since = busy.get(wid, tick)
            if tick - since >= AGE_CAP:
                fv.set_bound(wid, core, 3 * d + CAPPED)
            else:
                fv.set_bound(wid, core + aw * since, 3 * d + YOUNG)
                heapq.heappush(young, (since + AGE_CAP, x.pos, wid))
        else:
            fv.set_bound(wid, ov_s + ds * d, 3 * d + IDLE)

    aging = state.extra.get("slo_aging")
    if aging is None or aging[0] is not fv:
        aging = state.extra["slo_aging"] = (fv, [])
    young: list[tuple[int, int, str]] = aging[1]
    if len(young) > 4 * len(rows) + 64:  # entries replaced since: keep the current ones
        young[:] = [e for e in young if fv.group.get(e[2], 0) % 3 == YOUNG]
        heapq.heapify(young)
    for x in fp.dirty:
        set_key(x)
    # workers whose queue age reached the cap since their key was set: their age term is
    # now the cap's for as long as they stay unchanged
    while young and young[0][0] <= tick:
        _, _, wid = heapq.heappop(young)
        x = rows.get(wid)
        if x is not None and x.routable and fv.group.get(wid, 0) % 3 == YOUNG:
            since = busy.get(wid)
            if since is not None and tick - since >= AGE_CAP:
                set_key(x)

    ctx = state.extra["slo_ctx"]
    prompt = req.prompt_tokens
    out_tokens = req.max_tokens
    iw, cw = p["imposed_weight"], p["compute_weight"]
    inv_ttft, inv_tpot = 1.0 / ttft_slo, 1.0 / tpot_slo
    ov_m, pt_m, pa_m, ds_m, dk_m = self.theta_floor(state)
    ov_of, spread_to, extra, bs = fp.ov_of, fp.spread_to, fp.extra, fp.bs
    # per kind of queue age, its term in the cost: none (idle), the cap, or by age (the key
    # holds aw x since)
    age_term = (0.0, -aw * AGE_CAP, -aw * tick)
    # bounds of the TPOT: the fleet's lowest coefficients, per decoding sequence and fixed
    tpot_per_d = ds_m + dk_m * ctx
    tpot_fixed = ov_m + ds_m + dk_m * (prompt + out_tokens / 2.0)
    decode_kv = dk_m * ctx

    def request_terms(o: int) -> tuple[float, float, float]:
        """At overlap ``o`` (blocks): the cost's fixed request term, its term per decoding
        sequence, and the TTFT's (each a lower bound over the fleet's coefficients)."""
        if o < spread_to:
            o = spread_to
        c = o * bs
        u = prompt - c if c < prompt else 0
        pm = pt_m * u + pa_m * u * (prompt - u / 2.0)
        return (1.0 + cw) * pm, decode_kv + iw * pm, pm

    out: dict[str, float] = {}
    missed: list[str] = []
    lowest = INF  # lowest cost scored
    lowest_ok = INF  # lowest cost scored of a worker predicted to meet the SLO

    # what SloAware._worker_cost reads, as SloAware.costs sets it; it fills the headroom
    headroom: dict[str, float] = {}
    state.extra["slo_x"] = (fifo, models, ctx, out_tokens, iw, cw, inv_ttft, inv_tpot, headroom)

    def score(w: WorkerState, ov: int) -> None:
        # kv_aware's loop's queue accounting (its bookkeeping done by fast_prelude), then the
        # policy's one cost, SloAware._worker_cost
        nonlocal lowest, lowest_ok
        wid = w.worker_id
        queued = w.pending_prefill_tokens
        if queued > 0:
            since = busy.get(wid, tick)
            age = tick - since if tick - since < AGE_CAP else AGE_CAP
            if fifo.get(wid):
                queued = clock.queued(w, now)
        else:
            age = 0
        if ov < spread_to:
            ov = spread_to
        if extra:
            queued += extra.get(wid, 0)
        cached = ov * w.capacity.block_size
        uncached = prompt - cached if cached < prompt else 0
        c = self._worker_cost(req, w, queued, uncached, state) - aw * age
        out[wid] = c
        if headroom[wid] < 0.0:
            missed.append(wid)
        elif c < lowest_ok:
            lowest_ok = c
        if c < lowest:
            lowest = c

    def beyond(lb_cost: float, lb_ttft: float, lb_tpot: float) -> bool:
        """Can no worker with these lower bounds change the pick?"""
        if lowest_ok < INF:
            return exceeds(lb_cost, lowest_ok)
        return exceeds(lb_cost, lowest) and (
            lb_ttft * inv_ttft > 1.0 + 1e-9 or lb_tpot * inv_tpot > 1.0 + 1e-9
        )

    # the holders (by the index or routed memory) and replicas first, in order of their bound
    names = ov_of.keys() | extra.keys()
    terms = {o: request_terms(o) for o in {*ov_of.values(), 0}}
    bound, group = fv.bound, fv.group
    special = []
    for wid in names:
        d, kind = divmod(group[wid], 3)
        a = bound[wid] + age_term[kind]
        r, per_d, t = terms[ov_of.get(wid, 0)]
        special.append((a + d * per_d + r, a + d * decode_kv + t, d, wid))
    special.sort()
    for lb, lb_ttft, d, wid in special:
        if not beyond(lb, lb_ttft, tpot_fixed + d * tpot_per_d):
            score(rows[wid].obj, ov_of.get(wid, 0))
    # the others (overlap spread_to), grouped by decoding sequences d and kind of queue age:
    # a group's next worker has its lowest key a, and costs at least a + its age term +
    # d * per_d + r; the groups' next workers in a heap by that bound
    r, per_d, t = terms[0]
    heads = []
    for key, g, x in fv.heads():
        d, kind = divmod(g, 3)
        a = key + age_term[kind]
        heads.append((a + d * per_d + r, g, a, x))
    heapq.heapify(heads)
    try:
        while heads:
            lb, g, a, x = heads[0]
            d = g // 3
            if beyond(lb, a + d * decode_kv + t, tpot_fixed + d * tpot_per_d):
                if lowest_ok < INF:
                    break  # every group's next worker costs more than the best feasible
                # this group's workers all cost more than the lowest and miss the SLO
                heapq.heappop(heads)
                continue
            wid = x.obj.worker_id
            if wid not in out and wid not in names:
                score(x.obj, 0)
            nxt = fv.advance(g)
            if nxt is None:
                heapq.heappop(heads)
            else:
                a = nxt[0] + age_term[g % 3]
                heapq.heapreplace(heads, (a + d * per_d + r, g, a, nxt[1]))
    finally:
        fv.restore()
    # reuse attribution (services/core/policy/attribution.py) reads the costs of the index's
    # best holders: score those the search passed over (each costs more than the pick, so
    # lowest and lowest_ok stay), as the full path scores every worker
    if overlaps:
        top = min(max(overlaps.values()) * bs, prompt)
        for wid, o in overlaps.items():
            if wid not in out and min(o * bs, prompt) >= top > 0:
                w = routable_worker(wid)
                if w is not None:
                    score(w, ov_of.get(wid, 0))
    fast_dispatch(state, fp, out, prompt)
    if lowest_ok == INF:  # nobody meets the SLO: the best overall, or shed
        if p["shed"]:
            self.shed_for(ttft_slo, tpot_slo, state)
        return out
    for wid in missed:
        out[wid] += self.INFEASIBLE
    return out
