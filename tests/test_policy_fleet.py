"""The incremental fleet view and kv_aware's shortcut over it (services/core/policy/fleet.py).

The shortcut must pick exactly what the full evaluation picks: two policies built from one spec
decide the same random request sequence over one cluster, one through the cluster's tracked
snapshot (the shortcut) and one through an untracked snapshot of the same workers (filters and
every worker's cost), while loads, telemetry, cordons, breakers and the clock change at random.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.schemas import WorkerCapacity, WorkerControl, WorkerHeartbeat, WorkerLoad
from services.core.cluster import ClusterState
from services.core.keys import block_keys
from services.core.lifecycle import RequestLifecycle
from services.core.policy import ClusterSnapshot, RequestInfo, build_policy, decide
from services.core.policy.builtin.kv_aware import KvAware
from services.core.policy.fleet import INF, FleetView

BS = 16


@pytest.fixture(autouse=True)
def _small_fleets_take_the_shortcut(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_aware takes the shortcut from FAST_MIN_WORKERS workers on; these tests use small
    clusters, so from any size."""
    monkeypatch.setattr(KvAware, "FAST_MIN_WORKERS", 0)


def _cluster(n: int, now: float, seqs: int = 6, blocks: int = 96) -> ClusterState:
    cs = ClusterState(worker_timeout=1e9, telemetry_stale_s=1e9)
    cap = WorkerCapacity(
        block_size=BS, num_gpu_blocks=blocks, max_num_seqs=seqs, max_model_len=2048
    )
    for i in range(n):
        cs.on_heartbeat(
            WorkerHeartbeat(
                worker_id=f"w{i:02d}", instance_id="i", url=f"http://w{i}", model="m", capacity=cap
            ),
            now,
        )
    return cs


def _brute(snapshot: ClusterSnapshot) -> dict:
    r = [w for w in snapshot.workers.values() if w.routable]
    free = [w.kv_blocks_free for w in r if w.kv_blocks_free is not None]
    return {
        "n": len(r),
        "min_inflight": min((w.inflight for w in r), default=INF),
        "max_inflight": max((w.inflight for w in r), default=-INF),
        "min_room": min((w.capacity.max_num_seqs - w.inflight for w in r), default=INF),
        "min_free": min(free, default=INF),
        "routable": {w.worker_id for w in r},
    }


def _view(fv: FleetView) -> dict:
    return {
        "n": fv.n,
        "min_inflight": fv.min_inflight(),
        "max_inflight": fv.max_inflight(),
        "min_room": fv.min_seq_room(),
        "min_free": fv.min_free(),
        "routable": set(fv.routable),
    }


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["decide", "decide", "decide", "first", "end", "load", "ctl", "brk", "t", "itl"]
        ),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=120,
)


def _run(seq, spec: dict, n: int = 8, check_view: bool = False, roomy: bool = False) -> int:
    """Drive the cluster with ``seq``; assert both policies decide alike. Returns how many
    decisions chose a worker. ``roomy``: capacity and free blocks large enough that every
    routable worker mostly passes the fit filters (the shortcut applies); else workers are
    often at capacity or short of blocks (it does not, or only now and then)."""
    now = 100.0
    cs = _cluster(n, now, *((64, 4096) if roomy else (6, 96)))
    life = RequestLifecycle(cs)
    fast, slow = build_policy(spec), build_policy(spec)
    prompts = [[(g * 7919 + i) % 251 for i in range(16 * (4 + 5 * g))] for g in range(6)]
    holders: dict[int, dict[str, int]] = {g: {} for g in range(6)}
    tickets: list = []
    wids = list(cs.states)
    chosen = 0
    for k, (op, a, b) in enumerate(seq):
        if op == "decide":
            g = a % 6
            toks = prompts[g][: 16 * (1 + b % (len(prompts[g]) // 16))] + [k % 251] * (a % 3)
            keys = tuple(block_keys(toks, BS))
            req = RequestInfo(f"r{k}", "m", len(toks), 1 + b % 300, block_keys=keys)
            ov = {w: min(c, len(keys)) for w, c in holders[g].items() if c}
            cs.snapshot.now = now
            da = decide(fast, req, cs.snapshot, ov)
            db = decide(slow, req, ClusterSnapshot(cs.states, now), ov)
            assert (da.worker_id, da.replicate_to, da.after, da.hold_s, da.wait) == (
                db.worker_id,
                db.replicate_to,
                db.after,
                db.hold_s,
                db.wait,
            )
            assert (da.never_fits, da.filtered, da.overlap_blocks, da.reason) == (
                db.never_fits,
                db.filtered,
                db.overlap_blocks,
                db.reason,
            )
            # and so the same reuse attribution (services/core/policy/attribution.py)
            assert (da.available_tokens, da.lost_reason) == (db.available_tokens, db.lost_reason)
            # the shortcut's costs are the full evaluation's, for the workers it scored
            assert set(da.scores) <= set(db.scores)
            assert all(da.scores[w] == db.scores[w] for w in da.scores)
            if db.scores:
                assert min(da.scores.values()) == min(db.scores.values())
            if da.worker_id is not None:
                chosen += 1
                t = life.dispatch(req.request_id, da.worker_id, len(toks), 8, da.cached_tokens, now)
                tickets.append(t)
                for r in life.replicas(req.request_id, da, len(toks), ov, now):
                    tickets.append(r.ticket)
                if b % 2:  # the prefix reaches the index (KV events) for this worker
                    holders[g][da.worker_id] = max(holders[g].get(da.worker_id, 0), len(keys))
        elif op == "first" and tickets:
            now += 0.001 * (1 + b % 50)
            cs.first_token(tickets[a % len(tickets)], now)
        elif op == "end" and tickets:
            cs.release(tickets.pop(a % len(tickets)))
        elif op == "load":
            w = wids[a % n]
            free = None if b % 5 == 0 else (b % 4000 + 96 if roomy else b % 120)
            cs.on_load(WorkerLoad(worker_id=w, ts=now, kv_blocks_free=free, kv_usage=0.5), now)
        elif op == "ctl":
            w = wids[a % n]
            cs.on_control(
                WorkerControl(worker_id=w, action=["cordon", "drain", "uncordon"][b % 3]), now
            )
        elif op == "brk":
            cs.set_breaker_open(wids[a % n], bool(b % 2))
        elif op == "t":
            now += 0.01 * (b % 100)
        elif op == "itl":  # a streamed answer's inter-token gap (slo_aware recalibrates)
            w = wids[a % n]
            for pol in (fast, slow):
                pol.impl.observe_decode(w, 0.001 * (1 + b % 90), b % 7, pol.state)
        if check_view:
            fv = fast.state.extra.get("kv_aware_fleet")
            if fv is not None:
                fv.sync()
                assert _view(fv) == _brute(cs.snapshot)
                fresh = FleetView(ClusterSnapshot(cs.states, watchers=[]))
                assert {w: (x.routable, x.inflight, x.free) for w, x in fv.rows.items()} == {
                    w: (x.routable, x.inflight, x.free) for w, x in fresh.rows.items()
                }
    return chosen


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_fast_path_decides_as_the_full_evaluation(seq) -> None:
    _run(seq, {"name": "kv_aware", "params": {}}, check_view=True)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_fast_path_decides_as_the_full_evaluation_roomy(seq) -> None:
    _run(seq, {"name": "kv_aware", "params": {}}, check_view=True, roomy=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_fast_path_with_a_policy_cap(seq) -> None:
    _run(seq, {"name": "kv_aware", "params": {"max_inflight": 3, "routed_ttl": 16}})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans())
def test_fast_path_with_the_prefill_stall(seq, roomy) -> None:
    # the stall term is >= 0 and 0 without uncached tokens: the bounds stay lower bounds
    _run(seq, {"name": "kv_aware", "params": {"imposed_weight": 1.0}}, roomy=roomy)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans())
def test_fast_path_with_the_tpot_the_stall_adds(seq, roomy) -> None:
    # the same for the TPOT term: >= 0, 0 without uncached tokens; decode_gaps changes on
    # first tokens and ends, which the watchers see
    _run(seq, {"name": "kv_aware", "params": {"stall_tpot_weight": 25.0}}, roomy=roomy)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans())
def test_fast_path_with_the_conversation_term(seq, roomy) -> None:
    # the conversation term: >= 0, added to the workers scored (a request that starts a
    # prefix); a short window so that the clock's steps expire some of it
    params = {"conversation_weight": 0.15, "conversation_window_s": 0.5}
    _run(seq, {"name": "kv_aware", "params": params}, roomy=roomy)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("kv_aware", {}),
        ("kv_aware", {"imposed_weight": 1.0}),
        ("kv_aware", {"stall_tpot_weight": 25.0}),
        ("kv_aware", {"conversation_weight": 0.15, "conversation_window_s": 0.5}),
        ("slo_aware", {}),
    ],
)
def test_long_random_sequence_same_decisions(name: str, params: dict) -> None:
    rng = random.Random(7)
    names = ["decide"] * 5 + ["first", "first", "end", "end", "load", "ctl", "brk", "t", "itl"]
    seq = [(rng.choice(names), rng.randrange(10_000), rng.randrange(10_000)) for _ in range(4000)]
    for roomy in (False, True):
        chosen = _run(seq, {"name": name, "params": params}, n=24, roomy=roomy)
        assert chosen > 500  # the comparison covered real picks, not only waits


SLO_PARAMS = [
    {},
    {"slo_ttft_ms": 5.0, "slo_tpot_ms": 8.0},  # often nobody meets it: the infeasible search
    {"slo_ttft_ms": 30.0, "slo_tpot_ms": 9.0, "shed": True},
    {"imposed_weight": 2.0, "compute_weight": 0.0, "routed_ttl": 0},
    {"replicate": True, "hot_min_blocks": 1, "hot_margin": 0.0},
    {"feasible_pick": "headroom"},  # never shortcut: the full path on both sides
]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from(SLO_PARAMS), st.booleans())
def test_slo_aware_fast_path_decides_as_the_full_evaluation(seq, params, roomy) -> None:
    _run(seq, {"name": "slo_aware", "params": params}, check_view=True, roomy=roomy)


@pytest.mark.parametrize("params", SLO_PARAMS[:-1])
def test_slo_aware_long_random_sequences_same_decisions(params: dict) -> None:
    for seed in (1, 2):
        rng = random.Random(seed)
        names = ["decide"] * 5 + ["first", "first", "end", "end", "load", "ctl", "brk", "t"]
        names += ["itl"]
        seq = [
            (rng.choice(names), rng.randrange(10_000), rng.randrange(10_000)) for _ in range(2500)
        ]
        _run(seq, {"name": "slo_aware", "params": params}, n=24, roomy=bool(seed % 2))


def test_slo_aware_long_busy_queues_same_decisions() -> None:
    """Few first tokens: queues stay busy past the age tie-break's cap (1,000 decisions)."""
    rng = random.Random(5)
    names = ["decide"] * 40 + ["first", "end", "load", "t", "itl"]
    seq = [(rng.choice(names), rng.randrange(10_000), rng.randrange(10_000)) for _ in range(6000)]
    for roomy in (True, False):
        _run(seq, {"name": "slo_aware", "params": {}}, n=24, roomy=roomy)


def test_slo_aware_fast_path_scores_few_workers_of_a_large_fleet() -> None:
    """The point of the shortcut: over 512 workers with random load, a decision scores a
    small part of the fleet (and still picks what the full evaluation picks), also once the
    queues' age passes the cap of its tie-break (1,000 decisions)."""
    now = 50.0
    cs = _cluster(512, now, 64, 4096)
    rng = random.Random(3)
    for w in cs.states.values():
        w.inflight = rng.randint(0, 40)
        w.pending_prefill_tokens = rng.randint(0, 8000)
    fast = build_policy({"name": "slo_aware", "params": {}})
    slow = build_policy({"name": "slo_aware", "params": {}})
    toks = [rng.randrange(251) for _ in range(1024)]
    keys = tuple(block_keys(toks, BS))
    scored = []
    for i in range(4500):
        req = RequestInfo(f"r{i}", "m", len(toks), 128, block_keys=keys)
        ov = {"w007": len(keys), "w100": 8}
        da = decide(fast, req, cs.snapshot, ov)
        if i < 50:  # the full evaluation beside it (decisions sent nowhere: it may stop)
            db = decide(slow, req, ClusterSnapshot(cs.states, now), ov)
            assert da.worker_id == db.worker_id and len(db.scores) == 512
        scored.append(len(da.scores))
    assert max(scored) <= 8, scored


def test_view_follows_joins_and_departures() -> None:
    now = 10.0
    cs = _cluster(4, now)
    fv = FleetView(cs.snapshot)
    assert fv.n == 4
    cs.on_router_load("other", {"w01": 5}, {}, now)
    cs.on_heartbeat(
        WorkerHeartbeat(
            worker_id="w09",
            instance_id="i",
            url="http://w9",
            model="m",
            capacity=WorkerCapacity(
                block_size=BS, num_gpu_blocks=8, max_num_seqs=2, max_model_len=99
            ),
        ),
        now,
    )
    fv.sync()
    assert _view(fv) == _brute(cs.snapshot) and fv.min_blocks == 8 and fv.min_mml == 99
    assert [x.pos for x in fv.rows.values()] == list(range(5))
    cs.sweep(now + 1e10)  # everyone forgotten (nothing in flight)
    fv.sync()
    assert fv.n == 0 and not fv.rows


def test_a_copied_or_dropped_policy_state_leaves_the_live_view_alone() -> None:
    """The router's explain endpoint decides on a deep copy of a policy's state: the copy
    must not share (and drain) the live view's change set, and a dropped view stops being
    notified, so the live one is never evicted by copies."""
    import copy
    import gc

    now = 5.0
    cs = _cluster(6, now, 64, 4096)
    pol = build_policy({"name": "kv_aware", "params": {}})
    req = RequestInfo("a", "m", 64, 8)
    decide(pol, req, cs.snapshot, {})
    live = pol.state.extra["kv_aware_fleet"]
    assert cs.snapshot.watchers == [live.changed]
    for i in range(20):  # more copies than a snapshot keeps watchers
        twin = copy.copy(pol)
        twin.state = copy.deepcopy(pol.state)
        assert twin.state.extra["kv_aware_fleet"] is None
        decide(twin, RequestInfo(f"c{i}", "m", 64, 8), cs.snapshot, {})
        del twin
        gc.collect()
    assert len(cs.snapshot.watchers) == 1 and live.live(cs.snapshot)
    cs.on_router_load("other", {"w02": 3}, {}, now)
    assert "w02" in live.changed


def test_slo_aware_recalibrated_worker_is_rescored() -> None:
    """A worker whose latency model is recalibrated (here: its inter-token gaps say its steps
    are fast) must be scored again: its stale bound would prune it."""
    now = 5.0
    cs = _cluster(3, now, 64, 4096)
    fast = build_policy({"name": "slo_aware", "params": {}})
    slow = build_policy({"name": "slo_aware", "params": {}})

    def both(i: int):
        req = RequestInfo(f"r{i}", "m", 512, 32)
        da = decide(fast, req, cs.snapshot, {})
        db = decide(slow, req, ClusterSnapshot(cs.states, now), {})
        assert da.worker_id == db.worker_id
        return da

    both(0)  # every worker scored once: models at the prior, bounds set
    for pol in (fast, slow):
        for _ in range(40):
            pol.impl.observe_decode("w01", 0.003, 0, pol.state)
            pol.impl.observe_decode("w02", 0.0005, 0, pol.state)
    cs.on_load(WorkerLoad(worker_id="w01", ts=now, kv_blocks_free=4000, kv_usage=0.1), now)
    assert both(1).worker_id == "w02"  # the fastest steps now
