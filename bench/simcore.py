"""The cluster simulator's core: N engine cores on one virtual clock, routed by the router's own
request-lifecycle code. Pure: no I/O, no wall clock; the same inputs give the same results.

Pieces (all shared with the live system):
- ``services.core.lifecycle.RequestLifecycle`` over ``services.core.cluster.ClusterState``:
  the code the live router runs per request (decide, dispatch with its ticket, follower holds,
  hot-prefix replicas, first token, end), here with the virtual clock passed in;
- ``services.core.flow``: the router's flow control (``FlowQueue``: priority bands, fair
  queueing across tenants by virtual token counters, shedding; ``QuotaBook``: per-tenant
  quotas) for requests whose decision names no worker. Without tenants and priorities it is
  the router's FIFO, timed admission queue.
- ``services.core.engine.Engine``: the simulated worker's engine model (paged KV cache
  with prefix caching, continuous batching, step-time model). The live sim-worker runs the
  same class on the wall clock.
- ``services.core.index.PrefixIndex``: fed the engines' KV events, like the indexer.

What the simulator owns is what happens between the lifecycle's steps: the engine calls (a
request is handed to its engine instead of POSTed), telemetry (every engine's load fed to
``ClusterState.on_load`` every ``telemetry_interval_s``, like the telemetry agent), and when
a queued request is retried (whenever a request finishes, head of the queue first, like the
live router).

Event loop: a heap of (time, seq, kind, payload). An engine is either idle or inside one step;
``Engine.step(now)`` returns the step's outputs and its duration, and the outputs (tokens,
finished requests, KV events) take effect at ``now + duration``, when the next step starts.
A request is rejected after ``queue_timeout_s`` in the queue (the router's 429), when it is
shed (a sheddable one while the fleet is saturated; the router's 429) or over its tenant's
quota (the router's 429).

Disaggregated fleets (``prefill_workers`` / ``decode_workers`` > 0: xPyD): engines have roles,
routed by a P/D policy. A decision with a ``prefill_worker`` sends the prompt there first (one
token, ``hold_blocks``: its blocks stay held for the decoder, at most ``kv_hold_s``); when it
finishes, the request joins the decoder's queue (``kv_from_remote``); when the decoder admits
it, its blocks are reserved and the KV moves for
:func:`~services.core.pd.transfer.transfer_seconds` of the tokens the decoder lacks (one transfer
at a time into each decoder: its link); then the decoder computes the last prompt token,
streams the answer, and the prefiller's blocks are released (when the lease ran out first, the
pull fails and the decoder computes the prompt itself). Both pools' KV events feed the index.

Invariants: every request ends with exactly one :class:`RequestResult`; every ticket the
lifecycle hands out is released once (at the request's end, or when its engine refuses it);
virtual time never goes backwards; an engine runs at most one step at a time.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.metrics import ERROR, OK, REJECTED, TIMEOUT, CacheCounters, RequestResult
from bench.workloads import BenchRequest
from services.common import schemas
from services.common.tenancy import NO_TENANT, Priority, RequestTenancy, Tenant
from services.core import engine as eng_mod
from services.core import latency
from services.core.cluster import ClusterState, Ticket
from services.core.flow import (
    FlowQueue,
    Holdings,
    PrefillRoom,
    QuotaBook,
    Verdict,
    VirtualCounters,
    decide_in_room,
    engine_priority,
    is_protected,
    on_arrival,
    protected_prompt_s,
    verdict,
)
from services.core.index import PrefixIndex
from services.core.keys import block_keys, block_seed
from services.core.lifecycle import RequestLifecycle
from services.core.pd.transfer import LINK_PROFILES, ModelShape, transfer_seconds
from services.core.policy import RequestInfo, build_policy

_ARRIVE, _STEP, _EXPIRE, _RELEASE, _XFER, _UNHOLD = 0, 1, 2, 3, 4, 5
PREFILL_SUFFIX = "~prefill"  # the engine request id of a request's remote prefill


@dataclass
class SimOptions:
    """Knobs of one simulated run (the engine's own knobs live in ``EngineConfig``)."""

    num_workers: int = 8
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides
    model: str = "sim-llama-8b"
    telemetry_interval_s: float = 0.1  # how stale the router's view of engine load is
    queue_timeout_s: float = 30.0  # router queue: max wait before 429
    request_timeout_s: float = 600.0  # client timeout (completion later than this = timeout)
    closed_loop_concurrency: int = 0  # > 0: closed loop, ignore arrival times
    max_virtual_s: float = 0.0  # > 0: stop the clock here (unfinished = timeout)
    speedup: float = 1.0  # like sim-worker --speedup: steps take duration / speedup
    gpu_gauges: bool | None = None  # simulated GPU gauges in the snapshot (None: gpu_aware only)
    worker_prefix: str = "sim"
    # disaggregated fleet (both 0: ``num_workers`` colocated engines): this many prefill and
    # decode engines (``num_workers`` is then ignored); KV moves over ``link``, sized by
    # ``model_shape``; a prefill's blocks are held at most ``kv_hold_s`` for its decoder
    # (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s)
    prefill_workers: int = 0
    decode_workers: int = 0
    link: str = "rdma"
    model_shape: ModelShape = field(default_factory=ModelShape)
    kv_hold_s: float = 480.0

    def fleet(self) -> list[tuple[str, str]]:
        """(worker id, role) of every engine."""
        pre = self.worker_prefix
        if self.prefill_workers or self.decode_workers:
            return [(f"{pre}-p{i}", "prefill") for i in range(self.prefill_workers)] + [
                (f"{pre}-d{i}", "decode") for i in range(self.decode_workers)
            ]
        return [(f"{pre}-{i}", "both") for i in range(self.num_workers)]

    # flow control (services.core.flow): "kvgate" (priority bands + fair queueing across
    # tenants + shedding) or "fcfs" (one FIFO line: tenants and priorities ignored)
    flow: str = "kvgate"
    tenants: dict[str, Tenant] = field(default_factory=dict)  # weights and quotas by id
    queue_size: float = math.inf  # router queue bound (the router's --queue-size)
    # the router's --engine-priority: each request carries its flow-control order to its
    # engine as ``priority`` (services.core.flow.engine_priority); the engines use it with
    # ``engine={"scheduling": "priority"}``
    engine_priority: bool = False
    # the router sends each worker up to this many requests beyond its running slots
    # (``max_num_seqs``); they wait in the engine's own queue (with engine priority: in the
    # router's order, and may preempt running ones where the engine does that)
    engine_queue: int = 0
    # the router's --protect-prefill (services.core.flow.prefill_room): workers kept free of
    # best-effort prompt work for protected requests, sized by the measured protected load
    protect_prefill: bool = False
    protect_quantile: float = 0.8
    protect_window_s: float = 10.0


@dataclass
class SimRun:
    """What one simulated run produced."""

    results: list[RequestResult]
    workers: list[str]
    cache: CacheCounters
    duration_s: float
    steps: int
    decisions: int
    replicas: int = 0  # one-token copies the policy sent (hot-prefix replication)
    held: int = 0  # requests the policy held until their prefix's first request had a token
    transfers: int = 0  # disaggregated: requests whose prompt KV moved prefiller -> decoder
    transfer_s: float = 0.0  # their total transfer time (link time, not waits)
    local_prefills: int = 0  # disaggregated: requests a P/D policy let the decoder prefill
    hold_timeouts: int = 0  # prefills whose held blocks no decoder pulled within kv_hold_s
    roles: dict[str, str] = field(default_factory=dict)  # worker -> role
    dispatched_at: dict[str, float] = field(default_factory=dict)  # request id -> when sent
    # request id -> the router's view when it was sent: (times the prefill room held it, prompt
    # tokens its worker had still to compute, workers computing a prompt); recorded only in
    # runs with tenants or the prefill room
    sent_into: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Live:
    req: BenchRequest
    result: RequestResult
    keys: tuple[int, ...]
    rid: str  # the request id the router and the engine know it by (a replica's own)
    worker: str | None = None
    ticket: Ticket | None = None  # its claim on ``worker`` (services.core.lifecycle)
    first: float | None = None
    last: float | None = None
    replica: bool = False  # a router-made one-token copy (hot-prefix replication), not a user's
    sreq: Any = None  # the engine request while held (follower hold), else None
    prefill_worker: str | None = None  # disaggregated: the engine computing its prompt
    pticket: Ticket | None = None  # the claim there (released when the prefill is done)
    dispatched: float = 0.0
    tenancy: RequestTenancy = NO_TENANT
    waited: bool = False  # joined the queue (its quota is checked again when dispatched)
    engine_priority: int = 0  # the ``priority`` its engine requests carry
    held_work: int | None = None  # its work in the router's holdings until it ends
    room_held: bool = False  # its last decision was held by the prefill room
    room_holds: int = 0  # how many of its decisions the prefill room held


def for_policy(opts: SimOptions, spec: dict[str, Any]) -> SimOptions:
    """The fleet ``spec``'s policy runs on: a P/D policy the xPyD fleet of ``opts``, a
    colocated policy that many colocated engines (the same engine count), so one comparison
    puts every policy on the same hardware."""
    from services.core.policy.base import REGISTRY  # noqa: PLC0415

    cls = REGISTRY.get(spec.get("name", ""))
    pd_fleet = bool(opts.prefill_workers or opts.decode_workers)
    if pd_fleet and cls is not None and not cls.disaggregated:
        n = opts.prefill_workers + opts.decode_workers
        return replace(opts, num_workers=n, prefill_workers=0, decode_workers=0)
    return opts


def parse_split(text: str) -> tuple[int, int]:
    """``"P:D"`` -> (prefill engines, decode engines); ValueError unless P >= 0, D >= 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"a P:D split is two integers like 2:6, got {text!r}") from None
    if p < 0 or d < 1:
        raise ValueError(f"a P:D split needs P >= 0 and D >= 1, got {text!r}")
    return p, d


def make_engine_config(overrides: dict[str, Any]):
    cfg = eng_mod.EngineConfig()
    unknown = set(overrides) - set(cfg.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown engine setting(s) {sorted(unknown)}; valid: {', '.join(cfg.__dataclass_fields__)}"
        )
    return replace(cfg, **overrides)


def request_keys(
    requests: Sequence[BenchRequest], block_size: int, hash_seed: int
) -> list[tuple[int, ...]]:
    """Canonical block keys of every prompt (what the router computes from the prompt)."""
    seed = block_seed(hash_seed)
    return [tuple(block_keys(r.token_ids(), block_size, seed)) for r in requests]


def simulate(
    requests: Sequence[BenchRequest],
    policy_spec: dict[str, Any],
    opts: SimOptions,
    keys: Sequence[tuple[int, ...]] | None = None,
    progress=None,
) -> SimRun:
    """Run ``requests`` through ``opts.num_workers`` engines routed by ``policy_spec``.

    ``keys`` (from :func:`request_keys`) may be passed to share the hashing between runs.
    ``progress`` is called with the number of newly completed requests (e.g. tqdm.update).
    """
    cfg = make_engine_config(opts.engine)
    bs = cfg.block_size
    if keys is None:
        keys = request_keys(requests, bs, getattr(cfg, "hash_seed", 0))
    policy = build_policy(policy_spec)
    with_keys = RequestLifecycle.wants_block_keys(policy)  # like the live router
    fleet = opts.fleet()
    names = [w for w, _ in fleet]
    roles = dict(fleet)
    engines = {w: eng_mod.Engine(replace(cfg, seed=cfg.seed + i), w) for i, w in enumerate(names)}
    link = LINK_PROFILES[opts.link]
    link_free: dict[str, float] = dict.fromkeys(names, 0.0)  # each decoder's inbound link
    pre_by_id: dict[str, _Live] = {}  # remote prefills in flight, by engine request id
    # the router's own state and lifecycle; workers never time out on the virtual clock (they
    # heartbeat once) and telemetry is as fresh as its sampling interval
    state = ClusterState(worker_timeout=math.inf, telemetry_stale_s=math.inf, remote_ttl_s=math.inf)
    life: RequestLifecycle[_Live] = RequestLifecycle(state)
    capacity = schemas.WorkerCapacity(
        block_size=bs,
        num_gpu_blocks=cfg.num_gpu_blocks,
        max_num_seqs=cfg.max_num_seqs + opts.engine_queue,
        max_model_len=cfg.max_model_len,
    )
    for w in names:
        hb = schemas.WorkerHeartbeat(
            worker_id=w,
            instance_id=w,
            url=f"sim://{w}",
            model=opts.model,
            capacity=capacity,
            role=roles[w],
        )
        state.on_heartbeat(hb, 0.0)
        state.states[w].role = roles[w]
    index = PrefixIndex()
    busy: dict[str, bool] = dict.fromkeys(names, False)
    telemetry = opts.telemetry_interval_s > 0
    sampled_at = -1e18
    use_gpu = opts.gpu_gauges
    if use_gpu is None:
        use_gpu = policy_spec.get("name") == "gpu_aware"
    gpus = {}
    if use_gpu:  # the sim worker's own GPU model, sampled like the telemetry agent samples it
        from services.worker_sim.gpu import GpuModel  # noqa: PLC0415

        gpus = {w: GpuModel(engines[w].config) for w in names}

    heap: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    lives = [
        _Live(r, RequestResult(r.request_id, prompt_tokens=r.prompt_tokens), keys[i], r.request_id)
        for i, r in enumerate(requests)
    ]
    if opts.flow == "kvgate":
        for lv in lives:
            tenant = opts.tenants.get(lv.req.tenant or "")
            lv.tenancy = RequestTenancy(
                lv.req.tenant, Priority(lv.req.priority), tenant.weight if tenant else 1.0
            )
    elif opts.flow != "fcfs":
        raise ValueError(f"unknown flow control {opts.flow!r}: kvgate or fcfs")
    by_id = {lv.rid: lv for lv in lives}
    # session chains: a turn becomes ready when its predecessor finished
    prev_turn: dict[str, _Live] = {}
    waiting_on: dict[str, _Live] = {}  # predecessor request id -> next turn
    for lv in lives:
        sid = lv.req.session_id
        if sid is not None:
            if sid in prev_turn:
                waiting_on[prev_turn[sid].rid] = lv
            prev_turn[sid] = lv
    blocked = {id(lv) for lv in waiting_on.values()}

    closed = opts.closed_loop_concurrency > 0
    order = deque(lv for lv in lives if id(lv) not in blocked)
    if closed:
        for _ in range(min(opts.closed_loop_concurrency, len(order))):
            push(0.0, _ARRIVE, order.popleft())
    else:
        for lv in order:
            push(lv.req.arrival_s, _ARRIVE, lv)
        order.clear()

    counters = VirtualCounters()
    holdings = (
        Holdings(window_s=opts.protect_window_s)
        if opts.engine_priority or opts.protect_prefill
        else None
    )
    room = (
        PrefillRoom(opts.protect_window_s, opts.protect_quantile) if opts.protect_prefill else None
    )
    coef = latency.StepCoefficients.from_engine(cfg).as_list()
    budget = cfg.max_num_batched_tokens
    queue: FlowQueue[_Live] = FlowQueue(counters, opts.queue_size, opts.queue_timeout_s)
    quotas = (
        QuotaBook() if any(t.quota != Tenant("").quota for t in opts.tenants.values()) else None
    )
    dispatched_at: dict[str, float] = {}
    sent_into: dict[str, tuple[int, int, int]] = {}
    counts = {"replicas": 0, "held": 0, "transfers": 0, "local": 0, "hold_timeouts": 0}
    xfer_total = 0.0
    done = 0
    steps = decisions = 0
    now = 0.0

    def refresh(t: float) -> None:
        """Telemetry: every engine's load as the router sees it, every sampling interval."""
        nonlocal sampled_at
        if not telemetry or t - sampled_at < opts.telemetry_interval_s:
            return
        sampled_at = t
        for w, e in engines.items():
            samples = []
            if gpus:
                g = gpus[w].sample(t, e)
                samples.append(
                    schemas.GpuSample(
                        index=0,
                        sm_util_pct=g.sm_util_percent,
                        mem_bw_util_pct=g.mem_bw_util_percent,
                        mem_used_bytes=g.mem_used_bytes,
                        mem_total_bytes=g.mem_total_bytes,
                    )
                )
            load = schemas.WorkerLoad(
                worker_id=w,
                ts=t,
                running=e.num_running,
                waiting=e.num_waiting,
                kv_usage=e.kv_usage,
                kv_blocks_free=e.num_free_blocks,
                gpus=samples,
            )
            state.on_load(load, t)

    def finish(lv: _Live, status: str, t: float, error: str = "") -> None:
        nonlocal done
        r = lv.result
        r.status = status
        r.error = error
        if r.e2e_s is None:
            r.e2e_s = t - r.send_s
        done += 1
        if progress is not None:
            progress(1)
        nxt = waiting_on.pop(lv.rid, None)
        if nxt is not None:
            push(max(t, nxt.req.arrival_s) if not closed else t, _ARRIVE, nxt)
        elif closed and order:
            push(t, _ARRIVE, order.popleft())

    def start_engine(w: str, t: float) -> None:
        nonlocal steps
        out = engines[w].step(t)
        if out is None:
            busy[w] = False
            return
        steps += 1
        busy[w] = True
        end = t + out.duration_s / opts.speedup
        if gpus:
            gpus[w].record_step(t, end, out)
        push(end, _STEP, (w, out))

    def end(lv: _Live, t: float) -> None:
        """``lv`` ended on its worker (finished or refused): the lifecycle releases its claim;
        followers still held on it go now."""
        assert lv.ticket is not None
        if lv.held_work is not None and holdings is not None:
            holdings.remove(lv.tenancy.flow, lv.held_work)
            lv.held_work = None
        followers = life.end(lv.rid, lv.ticket)
        if followers:
            push(t, _RELEASE, (None, followers))

    def engine_request(lv: _Live, max_tokens: int, t: float):
        return eng_mod.SimRequest(
            request_id=lv.rid,
            prompt_token_ids=lv.req.token_ids(),
            max_tokens=max_tokens,
            arrival_time=t,
            prompt_block_keys=lv.keys,  # hashed once above; the engine checks they fit
            priority=lv.engine_priority,
        )

    def send(lv: _Live, sreq: Any, t: float) -> bool:
        """Hand ``lv`` to its worker's engine; False (its claim released and, unless a replica,
        the request finished as rejected) when the engine refuses it."""
        w = lv.worker
        assert w is not None
        try:
            engines[w].add_request(sreq, t)
        except eng_mod.AdmissionError as exc:
            end(lv, t)
            if not lv.replica:
                finish(lv, REJECTED, t, str(exc))
            return False
        if not busy[w]:
            start_engine(w, t)
        return True

    def over_quota(lv: _Live, t: float) -> bool:
        """Over its tenant's quota: finished as rejected (the router's 429)."""
        tenant = lv.req.tenant
        if quotas is None or tenant is None or tenant not in opts.tenants:
            return False
        refusal = quotas.check(tenant, opts.tenants[tenant].quota, lv.req.prompt_tokens, t)
        if refusal is None:
            return False
        finish(lv, REJECTED, t, f"quota: {refusal.message}")
        return True

    def enqueue(lv: _Live, t: float) -> None:
        """Wait in the flow queue (or be refused: it is full)."""
        joined = queue.join(lv, lv.tenancy, t)
        if not joined.ok:
            finish(lv, REJECTED, t, "router queue full (429)")
            return
        if joined.bumped is not None:
            finish(joined.bumped, REJECTED, t, "router queue full, bumped (429)")
        lv.waited = True
        push(t + opts.queue_timeout_s + 1e-9, _EXPIRE, lv)

    def try_route(lv: _Live, t: float) -> bool:
        """True when handled (dispatched or failed); False when it must wait."""
        nonlocal decisions
        refresh(t)
        req = lv.req
        info = RequestInfo(
            request_id=lv.rid,
            model=opts.model,
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            block_keys=lv.keys if with_keys else (),
            session_id=req.session_id,
        )
        overlaps = index.find_matches(lv.keys) if lv.keys else {}
        decisions += 1
        d = life.decide(policy, info, overlaps, t)
        if room is not None and d.worker_id is not None and not policy.impl.disaggregated:
            held = decide_in_room(
                d, state.states, overlaps, req.prompt_tokens, protected(lv), room.room(t)
            )
            lv.room_held = held is None
            lv.room_holds += held is None
            if held is None:  # as if every worker were full: wait, or shed (sheddable)
                if verdict(lv.tenancy.priority, False) is Verdict.QUEUE:
                    return False
                finish(lv, REJECTED, t, "shed (429): the prefill room is held")
                return True
            d = held
        if d.worker_id is None:
            if d.wait or d.shed:
                if verdict(lv.tenancy.priority, d.shed) is Verdict.QUEUE:
                    return False
                finish(lv, REJECTED, t, f"shed (429): {d.reason}")
                return True
            finish(lv, REJECTED, t, d.never_fits or d.reason)
            return True
        w = d.worker_id
        ten = lv.tenancy
        counters.dispatched(ten.flow, ten.weight, req.prompt_tokens)
        if holdings is not None:
            if opts.engine_priority:
                lv.engine_priority = engine_priority(
                    ten.priority.rank,
                    holdings.over_share(ten.flow, ten.weight, req.prompt_tokens),
                )
            holdings.add(ten.flow, ten.weight, req.prompt_tokens)
            lv.held_work = req.prompt_tokens
        if quotas is not None and req.tenant is not None:
            quotas.admitted(req.tenant, req.prompt_tokens, t)
        dispatched_at[lv.rid] = t
        if opts.tenants or room is not None:  # a pass over the workers: for the tenant benches
            sts = state.states
            computing = sum(1 for ws in sts.values() if ws.pending_prefill_tokens > 0)
            sent_into[lv.rid] = (lv.room_holds, sts[w].pending_prefill_tokens, computing)
        lv.dispatched = lv.result.dispatch_s = t
        if policy.impl.disaggregated:
            return dispatch_pd(lv, d, t)
        hold = life.must_hold(d)
        lv.ticket = life.dispatch(lv.rid, w, req.prompt_tokens, req.max_tokens, d.cached_tokens, t)
        lv.worker = w
        sreq = engine_request(lv, req.max_tokens, t)
        if hold:  # sent when the leader has its first token (or ended, or hold_s passed)
            assert d.after is not None
            lv.sreq = sreq
            life.holds.hold(d.after, lv)
            counts["held"] += 1
            push(t + d.hold_s, _RELEASE, (d.after, lv))
        elif not send(lv, sreq, t):
            return True
        lv.result.worker = w
        lv.result.available_tokens = d.available_tokens
        lv.result.captured_tokens = d.cached_tokens
        lv.result.lost_reason = d.lost_reason
        for rep in life.replicas(lv.rid, d, req.prompt_tokens, overlaps, t):
            # hot-prefix replication: a one-token copy, like the router
            rl = _Live(
                req,
                RequestResult(rep.request_id, prompt_tokens=req.prompt_tokens),
                lv.keys,
                rep.request_id,
                rep.worker_id,
                rep.ticket,
                replica=True,
            )
            if send(rl, engine_request(rl, 1, t), t):
                by_id[rl.rid] = rl
                counts["replicas"] += 1
        return True

    def dispatch_pd(lv: _Live, d: Any, t: float) -> bool:
        """A P/D policy's decision: the decoder prefills itself, or the prompt goes to the
        prefiller first (its KV then moves to the decoder: :func:`start_transfer`)."""
        req = lv.req
        lv.ticket, lv.pticket = life.dispatch_pd(lv.rid, d, req.prompt_tokens, req.max_tokens, t)
        lv.worker = d.worker_id
        lv.result.worker = d.worker_id
        if d.prefill_worker is None:
            counts["local"] += 1
            send(lv, engine_request(lv, req.max_tokens, t), t)
            return True
        lv.prefill_worker = lv.result.prefill_worker = d.prefill_worker
        sreq = engine_request(lv, 1, t)
        sreq.request_id = lv.rid + PREFILL_SUFFIX
        sreq.hold_blocks = True
        p = d.prefill_worker
        try:
            engines[p].add_request(sreq, t)
        except eng_mod.AdmissionError as exc:
            assert lv.pticket is not None
            life.state.release(lv.pticket)
            end(lv, t)
            finish(lv, REJECTED, t, str(exc))
            return True
        pre_by_id[sreq.request_id] = lv
        if not busy[p]:
            start_engine(p, t)
        return True

    def to_decoder(lv: _Live, t: float) -> None:
        """The prompt's KV is ready on the prefiller: the request joins the decoder's queue
        (its KV moves once the decoder admits it and reserves its blocks)."""
        w = lv.worker
        assert w is not None
        sreq = engine_request(lv, lv.req.max_tokens, t)
        sreq.kv_from_remote = True
        try:
            engines[w].add_request(sreq, t)
        except eng_mod.AdmissionError as exc:
            engines[lv.prefill_worker or ""].release_held(lv.rid + PREFILL_SUFFIX)
            end(lv, t)
            finish(lv, REJECTED, t, str(exc))
            return
        push(t + opts.kv_hold_s, _UNHOLD, lv)  # the prefiller's lease on its blocks
        if not busy[w]:
            start_engine(w, t)

    def start_transfer(w: str, rid: str, t: float) -> None:
        """Decoder ``w`` reserved ``rid``'s blocks: move the prompt tokens it lacks."""
        nonlocal xfer_total
        s = engines[w].receiving.get(rid)
        lv = by_id.get(rid)
        if s is None or lv is None:
            return
        dur = transfer_seconds(len(s.tokens) - s.num_computed, opts.model_shape, link)
        at = max(t, link_free[w]) + dur
        link_free[w] = at
        xfer_total += dur
        counts["transfers"] += 1
        push(at, _XFER, lv)

    def release(group: list[_Live], t: float) -> None:
        """Send held requests (their leader's first token came, or their hold_s passed)."""
        for lv in group:
            if lv.sreq is None:  # already sent
                continue
            sreq, lv.sreq = lv.sreq, None
            sreq.arrival_time = t
            send(lv, sreq, t)

    def drain_queue(t: float) -> None:
        while queue:
            lv = queue.head()
            assert lv is not None
            if queue.expired(lv, t):
                queue.leave(lv)
                finish(lv, REJECTED, t, "router queue timeout (429)")
                continue
            if over_quota(lv, t):
                queue.leave(lv)
                continue
            if not try_route(lv, t):
                if lv.room_held:
                    pass_held(t)
                return
            queue.leave(lv)

    def protected(lv: _Live) -> bool:
        ten = lv.tenancy
        return is_protected(
            ten.priority,
            holdings is None or holdings.over_share(ten.flow, ten.weight, lv.req.prompt_tokens),
        )

    def pass_held(t: float) -> None:
        """The head is held by the prefill room: protected waiters pass it (each flow's oldest,
        by band then first come, until none can go)."""
        moved = True
        while moved:
            moved = False
            for e in queue.flow_heads():
                if e.room_held or not protected(e) or queue.expired(e, t):
                    continue
                if not try_route(e, t):
                    if not e.room_held:
                        return  # no capacity for it: none for those behind it either
                    continue
                queue.leave(e)
                moved = True

    total = len(lives)
    while heap and done < total:
        t, _, kind, payload = heapq.heappop(heap)
        if opts.max_virtual_s and t > opts.max_virtual_s:
            now = opts.max_virtual_s
            break
        now = t
        if kind == _ARRIVE:
            lv = payload
            lv.result.send_s = t
            if holdings is not None:  # its tenant is active in the share test
                holdings.arrived(lv.tenancy.flow, lv.tenancy.weight, t)
            if over_quota(lv, t):
                continue
            if room is not None and protected(lv):
                room.arrived(t, protected_prompt_s(coef, lv.req.prompt_tokens, budget))
            v = on_arrival(lv.tenancy.priority, queue)
            if v is Verdict.SHED:
                finish(lv, REJECTED, t, "shed (429): requests wait for capacity")
            elif v is Verdict.QUEUE:
                enqueue(lv, t)
                head = queue.head()
                if head is lv:  # ahead of every waiter (its flow is owed): its turn
                    drain_queue(t)
                elif head is not None and head.room_held and lv in queue:
                    pass_held(t)
            elif not try_route(lv, t):
                enqueue(lv, t)
        elif kind == _EXPIRE:
            lv = payload
            if lv in queue and queue.expired(lv, t):
                queue.leave(lv)
                finish(lv, REJECTED, t, "router queue timeout (429)")
            drain_queue(t)
        elif kind == _XFER:  # the KV arrived: the decoder runs it, the prefiller frees it
            lv = payload
            w = lv.worker
            if engines[lv.prefill_worker].release_held(lv.rid + PREFILL_SUFFIX):
                engines[w].kv_received(lv.rid)
            else:  # the prefiller's lease ran out first: the decoder computes the prompt
                engines[w].kv_failed(lv.rid)
            if not busy[w]:
                start_engine(w, t)
        elif kind == _UNHOLD:  # no decoder pulled the blocks in time: the prefiller frees them
            lv = payload
            if engines[lv.prefill_worker].release_held(lv.rid + PREFILL_SUFFIX):
                counts["hold_timeouts"] += 1
        elif kind == _RELEASE:
            lead_id, who = payload
            if lead_id is None:  # the leader's first token or end released them all
                release(who, t)
            elif who.sreq is not None:  # this follower's hold_s passed
                life.holds.drop(lead_id, who)
                release([who], t)
        else:
            w, out = payload
            for ev in out.kv_events:
                if isinstance(ev, schemas.BlockStored):
                    index.apply_stored(w, ev.keys, ev.tier)
                elif isinstance(ev, schemas.BlockRemoved):
                    index.apply_removed(w, ev.keys, ev.tier)
                elif isinstance(ev, schemas.AllBlocksCleared):
                    index.clear_worker(w)
            prompt_done = False
            for rid, toks in out.tokens.items():
                if not toks or rid in pre_by_id:  # a remote prefill's token is not streamed
                    continue
                lv = by_id.get(rid)
                if lv is None:
                    continue
                if lv.first is None:
                    lv.first = t
                    prompt_done = True
                    assert lv.ticket is not None
                    # followers go after this engine's next step has started: the live router
                    # learns of the token from the stream, and the engine does not wait for it
                    followers = life.first_token(rid, lv.ticket, t)
                    if followers:
                        push(t, _RELEASE, (None, followers))
                    if not lv.replica:
                        lv.result.ttft_s = t - lv.result.send_s
                        if policy.impl.disaggregated and lv.prefill_worker is None:
                            life.prefill_observed(policy, rid, w, t - lv.dispatched)
                elif lv.last is not None:
                    lv.result.itl_s.append(t - lv.last)
                lv.last = t
            freed = room is not None and prompt_done  # a prompt ended: the room may reopen
            for fin in out.finished:
                lv = pre_by_id.pop(fin.request_id, None)
                if lv is not None:  # a remote prefill is done: its KV goes to the decoder
                    assert lv.pticket is not None
                    life.prefilled(policy, lv.rid, lv.pticket, t - lv.dispatched, t)
                    to_decoder(lv, t)
                    continue
                lv = by_id.get(fin.request_id)
                if lv is None:
                    continue
                if not lv.replica and lv.first is not None and lv.worker is not None:
                    # the mean inter-token gap, as the live router observes a stream's
                    life.decoded(policy, lv.worker, fin.completion_tokens, lv.first, t)
                end(lv, t)
                if lv.replica:
                    del by_id[fin.request_id]
                    continue
                r = lv.result
                counters.completed(lv.tenancy.flow, lv.tenancy.weight, fin.completion_tokens)
                if quotas is not None and lv.req.tenant is not None:
                    quotas.ended(lv.req.tenant, fin.completion_tokens, t)
                r.prompt_tokens = fin.prompt_tokens
                r.cached_tokens = fin.cached_tokens
                r.completion_tokens = fin.completion_tokens
                r.e2e_s = t - r.send_s
                if fin.finish_reason not in ("stop", "length"):
                    finish(lv, ERROR, t, f"finish_reason={fin.finish_reason}")
                elif r.e2e_s > opts.request_timeout_s:
                    finish(lv, TIMEOUT, t, "client timeout")
                else:
                    finish(lv, OK, t)
                freed = True
            for rid in out.kv_transfers:
                start_transfer(w, rid, t)
            start_engine(w, t)
            if freed and queue:
                drain_queue(t)

    for lv in lives:  # whatever the clock limit cut off
        if lv.result.e2e_s is None and lv.result.status == OK and done < total:
            lv.result.e2e_s = max(0.0, now - lv.result.send_s)
            lv.result.status = TIMEOUT
            lv.result.error = "simulation ended before completion"
    cache = CacheCounters()
    for w, e in engines.items():
        q, h = float(e.prefix_cache_queries), float(e.prefix_cache_hits)
        cache.queries += q
        cache.hits += h
        cache.per_worker[w] = (q, h)
    return SimRun(
        results=[lv.result for lv in lives],
        workers=names,
        cache=cache,
        duration_s=now,
        steps=steps,
        decisions=decisions,
        replicas=counts["replicas"],
        held=counts["held"],
        transfers=counts["transfers"],
        transfer_s=xfer_total,
        local_prefills=counts["local"],
        hold_timeouts=counts["hold_timeouts"],
        roles=roles,
        dispatched_at=dispatched_at,
        sent_into=sent_into,
    )
