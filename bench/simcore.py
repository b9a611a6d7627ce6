"""The cluster simulator's core: N engine cores on one virtual clock, routed by the router's own
policy code. Pure: no I/O, no wall clock; the same inputs give the same results.

Pieces (all shared with the live system):
- ``services.core.engine.Engine``: the simulated worker's engine model (paged KV cache
  with prefix caching, continuous batching, step-time model). The live sim-worker runs the
  same class on the wall clock.
- ``services.core.policy.decide``: the function the live router calls per request, on a
  :class:`ClusterSnapshot` built like the router builds it (in-flight counts it tracks itself,
  engine load sampled every ``telemetry_interval_s`` like heartbeats/telemetry).
- ``services.core.index.PrefixIndex``: fed the engines' KV events, like the indexer.

Event loop: a heap of (time, seq, kind, payload). An engine is either idle or inside one step;
``Engine.step(now)`` returns the step's outputs and its duration, and the outputs (tokens,
finished requests, KV events) take effect at ``now + duration``, when the next step starts.
A request whose decision is ``wait`` joins a FIFO router queue that is retried whenever a
request finishes; it is rejected after ``queue_timeout_s`` (the router's 429).

Invariants: every request ends with exactly one :class:`RequestResult`; virtual time never
goes backwards; an engine runs at most one step at a time.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.metrics import ERROR, OK, REJECTED, TIMEOUT, CacheCounters, RequestResult
from bench.workloads import BenchRequest
from services.common import schemas
from services.core.index import PrefixIndex
from services.core.keys import block_keys, block_seed, blocks_needed

_ARRIVE, _STEP, _EXPIRE, _RELEASE = 0, 1, 2, 3


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


@dataclass(slots=True)
class _Live:
    req: BenchRequest
    result: RequestResult
    keys: tuple[int, ...]
    worker: str | None = None
    first: float | None = None
    last: float | None = None
    enqueued: float = 0.0
    prefill_tokens: int = 0
    blocks: int = 0  # KV blocks reserved by the router for this request
    dispatched: float = 0.0
    replica: bool = False  # a router-made one-token copy (hot-prefix replication), not a user's
    ended: bool = False  # finished (or failed) on its worker
    sreq: Any = None  # the engine request while held (follower hold), else None


def engine_api():
    """The engine module, or a clear error naming what is missing."""
    try:
        from services.core import engine  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - only before the engine lands
        raise RuntimeError(
            f"the simulator needs services.core.engine (Engine, EngineConfig, SimRequest): {exc}"
        ) from exc
    return engine


def policy_api():
    """(build_policy, decide, types module) of the router's policy core."""
    try:
        import services.core.policy.builtin  # noqa: F401, PLC0415 - registers the built-ins
        from services.core.policy import types  # noqa: PLC0415
        from services.core.policy.base import build_policy, decide  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - only before the policies land
        raise RuntimeError(f"the simulator needs services.core.policy: {exc}") from exc
    return build_policy, decide, types


def make_engine_config(overrides: dict[str, Any]):
    eng = engine_api()
    cfg = eng.EngineConfig()
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
    eng_mod = engine_api()
    build_policy, decide, T = policy_api()
    cfg = make_engine_config(opts.engine)
    bs = cfg.block_size
    if keys is None:
        keys = request_keys(requests, bs, getattr(cfg, "hash_seed", 0))
    policy = build_policy(policy_spec)
    names = [f"{opts.worker_prefix}-{i}" for i in range(opts.num_workers)]
    engines = {w: eng_mod.Engine(replace(cfg, seed=cfg.seed + i), w) for i, w in enumerate(names)}
    cap = T.Capacity(
        block_size=bs,
        num_gpu_blocks=cfg.num_gpu_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
    )
    states = {w: T.WorkerState(worker_id=w, model=opts.model, capacity=cap) for w in names}
    snapshot = T.ClusterSnapshot(workers=states, now=0.0)
    index = PrefixIndex()
    busy: dict[str, bool] = dict.fromkeys(names, False)
    telemetry = opts.telemetry_interval_s > 0
    sampled_at = -1e18
    sample_free: dict[str, int] = dict.fromkeys(names, cfg.num_gpu_blocks)
    # blocks of in-flight requests: all of them, and those dispatched since the last sample
    reserved: dict[str, int] = dict.fromkeys(names, 0)
    reserved_since: dict[str, int] = dict.fromkeys(names, 0)

    def update_free(w: str) -> None:
        """What the live router estimates (services/router/state.py): telemetry's free blocks
        minus blocks reserved since that sample; without telemetry, capacity minus reserved."""
        if telemetry:
            states[w].kv_blocks_free = max(0, sample_free[w] - reserved_since[w])
        else:
            states[w].kv_blocks_free = max(0, cfg.num_gpu_blocks - reserved[w])

    for w in names:
        update_free(w)
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
        _Live(r, RequestResult(r.request_id, prompt_tokens=r.prompt_tokens), keys[i])
        for i, r in enumerate(requests)
    ]
    by_id = {lv.req.request_id: lv for lv in lives}
    # session chains: a turn becomes ready when its predecessor finished
    prev_turn: dict[str, _Live] = {}
    waiting_on: dict[str, _Live] = {}  # predecessor request id -> next turn
    for lv in lives:
        sid = lv.req.session_id
        if sid is not None:
            if sid in prev_turn:
                waiting_on[prev_turn[sid].req.request_id] = lv
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

    queue: deque[_Live] = deque()
    counts = {"replicas": 0, "held": 0}
    held: dict[str, list[_Live]] = {}  # leader request id -> requests held until its 1st token
    done = 0
    steps = decisions = 0
    now = 0.0

    def refresh(t: float) -> None:
        nonlocal sampled_at
        if not telemetry or t - sampled_at < opts.telemetry_interval_s:
            return
        sampled_at = t
        for w, e in engines.items():
            st = states[w]
            st.running = e.num_running
            st.waiting = e.num_waiting
            st.kv_usage = e.kv_usage
            sample_free[w] = e.num_free_blocks
            reserved_since[w] = 0
            update_free(w)
            if gpus:
                g = gpus[w].sample(t, e)
                st.gpu_sm_util = g.sm_util_percent / 100.0
                st.gpu_bw_util = g.mem_bw_util_percent / 100.0
                st.gpu_mem_used = g.mem_used_bytes / g.mem_total_bytes

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
        nxt = waiting_on.pop(lv.req.request_id, None)
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

    def try_route(lv: _Live, t: float) -> bool:
        """True when handled (dispatched or failed); False when it must wait."""
        nonlocal decisions
        refresh(t)
        snapshot.now = t
        req = lv.req
        info = T.RequestInfo(
            request_id=req.request_id,
            model=opts.model,
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            block_keys=lv.keys,
            session_id=req.session_id,
        )
        overlaps = index.find_matches(lv.keys) if lv.keys else {}
        decisions += 1
        d = decide(policy, info, snapshot, overlaps)
        if d.worker_id is None:
            if d.wait:
                return False
            finish(lv, REJECTED, t, d.never_fits or d.reason)
            return True
        w = d.worker_id
        lead = by_id.get(d.after) if d.after is not None else None
        hold = lead is not None and lead.worker is not None and lead.first is None
        hold = hold and not lead.ended
        if not dispatch(lv, w, lv.req.max_tokens, lv.req.request_id, overlaps, t, not hold):
            return True
        if hold:  # sent when the leader has its first token (or ended, or hold_s passed)
            held.setdefault(d.after, []).append(lv)
            counts["held"] += 1
            push(t + d.hold_s, _RELEASE, (d.after, lv))
        lv.result.worker = w
        for rw in d.replicate_to:  # hot-prefix replication: a one-token copy, like the router
            rid = T.replica_id(req.request_id, rw)
            rep = _Live(req, RequestResult(rid, prompt_tokens=req.prompt_tokens), lv.keys)
            rep.replica = True
            if dispatch(rep, rw, 1, rid, overlaps, t):
                by_id[rid] = rep
                counts["replicas"] += 1
        return True

    def dispatch(
        lv: _Live,
        w: str,
        max_tokens: int,
        rid: str,
        overlaps: dict[str, int],
        t: float,
        send: bool = True,
    ) -> bool:
        """Hand ``lv`` to engine ``w`` (unless ``send`` is False: held, sent by :func:`release`)
        and count it there like the router does; False (and the request finished as rejected,
        unless a replica) when the engine refuses it."""
        req = lv.req
        sreq = eng_mod.SimRequest(
            request_id=rid,
            prompt_token_ids=req.token_ids(),
            max_tokens=max_tokens,
            arrival_time=t,
            prompt_block_keys=lv.keys,  # hashed once above; the engine checks they fit
        )
        if send:
            try:
                engines[w].add_request(sreq, t)
            except eng_mod.AdmissionError as exc:
                if not lv.replica:
                    finish(lv, REJECTED, t, str(exc))
                return False
        else:
            lv.sreq = sreq
        st = states[w]
        st.inflight += 1
        uncached = max(0, req.prompt_tokens - overlaps.get(w, 0) * bs)
        st.pending_prefill_tokens += uncached
        need = max(0, blocks_needed(req.prompt_tokens, max_tokens, bs) - overlaps.get(w, 0))
        lv.prefill_tokens = uncached
        lv.blocks = need
        lv.dispatched = t
        reserved[w] += need
        reserved_since[w] += need
        update_free(w)
        lv.worker = w
        if send and not busy[w]:
            start_engine(w, t)
        return True

    def uncount(lv: _Live, w: str) -> None:
        """Undo what :func:`dispatch` counted on ``w`` (the request ended or was refused)."""
        st = states[w]
        st.inflight -= 1
        reserved[w] -= lv.blocks
        if lv.dispatched >= sampled_at:
            reserved_since[w] -= lv.blocks
        update_free(w)
        if lv.first is None:  # no first token released its queued prefill
            st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - lv.prefill_tokens)

    def release(lead_id: str, t: float, only: _Live | None = None) -> None:
        """Send the requests held on ``lead_id`` (or just ``only``, at its hold deadline)."""
        group = held.get(lead_id)
        if not group:
            return
        go = group if only is None else [x for x in group if x is only]
        if only is None:
            del held[lead_id]
        else:
            group.remove(only)
            if not group:
                del held[lead_id]
        for lv in go:
            sreq, lv.sreq = lv.sreq, None
            sreq.arrival_time = t
            w = lv.worker
            try:
                engines[w].add_request(sreq, t)
            except eng_mod.AdmissionError as exc:
                uncount(lv, w)
                lv.ended = True
                finish(lv, REJECTED, t, str(exc))
                continue
            if not busy[w]:
                start_engine(w, t)

    def drain_queue(t: float) -> None:
        while queue:
            lv = queue[0]
            if t - lv.enqueued > opts.queue_timeout_s:
                queue.popleft()
                finish(lv, REJECTED, t, "router queue timeout (429)")
                continue
            if not try_route(lv, t):
                return
            queue.popleft()

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
            if queue or not try_route(lv, t):
                lv.enqueued = t
                queue.append(lv)
                push(t + opts.queue_timeout_s + 1e-9, _EXPIRE, None)
        elif kind == _EXPIRE:
            drain_queue(t)
        elif kind == _RELEASE:
            lead_id, lv = payload
            if lv is None or lv.sreq is not None:
                release(lead_id, t, lv)
        else:
            w, out = payload
            for ev in out.kv_events:
                if isinstance(ev, schemas.BlockStored):
                    index.apply_stored(w, ev.keys, ev.tier)
                elif isinstance(ev, schemas.BlockRemoved):
                    index.apply_removed(w, ev.keys, ev.tier)
                elif isinstance(ev, schemas.AllBlocksCleared):
                    index.clear_worker(w)
            st = states[w]
            for rid, toks in out.tokens.items():
                if not toks:
                    continue
                lv = by_id.get(rid)
                if lv is None:
                    continue
                if lv.first is None:
                    lv.first = t
                    if rid in held:
                        # after this engine's next step has started: the live router learns
                        # of the token from the stream, and the engine does not wait for it
                        push(t, _RELEASE, (rid, None))
                    if not lv.replica:
                        lv.result.ttft_s = t - lv.result.send_s
                    st.pending_prefill_tokens = max(
                        0, st.pending_prefill_tokens - lv.prefill_tokens
                    )
                    st.first_token_at = t  # like the live router's state.first_token(now)
                elif lv.last is not None:
                    lv.result.itl_s.append(t - lv.last)
                lv.last = t
            freed = False
            for fin in out.finished:
                lv = by_id.get(fin.request_id)
                if lv is None:
                    continue
                uncount(lv, w)
                lv.ended = True
                if fin.request_id in held:
                    push(t, _RELEASE, (fin.request_id, None))
                if lv.replica:
                    del by_id[fin.request_id]
                    continue
                r = lv.result
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
    )
