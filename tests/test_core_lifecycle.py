"""``services.core.lifecycle``: the request lifecycle the live router and the simulator share,
on a hand-driven clock (no I/O, no event loop)."""

from __future__ import annotations

import random

import pytest

from services.common.schemas import WorkerCapacity, WorkerHeartbeat, WorkerLoad
from services.common.tenancy import NO_TENANT
from services.core.cluster import ClusterState
from services.core.flow import FlowQueue, VirtualCounters
from services.core.lifecycle import FirstTokenHolds, RequestLifecycle
from services.core.policy import Decision, RequestInfo, build_policy
from services.core.policy.types import replica_id

CAP = WorkerCapacity(block_size=16, num_gpu_blocks=100, max_num_seqs=8, max_model_len=4096)
CAP_BIG = WorkerCapacity(block_size=16, num_gpu_blocks=10_000, max_num_seqs=64, max_model_len=8192)


def _lifecycle(n: int = 2) -> RequestLifecycle[str]:
    state = ClusterState()
    for i in range(n):
        hb = WorkerHeartbeat(
            worker_id=f"w{i}", instance_id="i", url=f"http://w{i}", model="m", capacity=CAP
        )
        state.on_heartbeat(hb, now=0.0)
    return RequestLifecycle(state)


def test_a_claim_counts_until_its_end_and_its_prefill_until_its_first_token() -> None:
    life = _lifecycle()
    w0 = life.state.states["w0"]
    t = life.dispatch("a", "w0", prompt_tokens=320, max_tokens=32, cached_tokens=160, wall=1.0)
    # 352 tokens = 22 blocks, 10 of them cached; 160 uncached prompt tokens to compute
    assert (w0.inflight, w0.pending_prefill_tokens, w0.kv_blocks_free) == (1, 160, 88)
    assert life.holds.pending("a")
    life.first_token("a", t, now=2.0)
    assert (w0.inflight, w0.pending_prefill_tokens, w0.first_token_at) == (1, 0, 2.0)
    assert not life.holds.pending("a")
    life.end("a", t)
    life.end("a", t)  # a second end changes nothing
    assert (w0.inflight, w0.pending_prefill_tokens, w0.kv_blocks_free) == (0, 0, 100)


def test_followers_are_handed_back_once_by_the_first_token_or_the_end() -> None:
    life = _lifecycle()
    lead = life.dispatch("lead", "w0", 64, 8, 0, wall=0.0)
    d = Decision("w0", after="lead", hold_s=5.0)
    assert life.must_hold(d)
    assert life.holds.hold("lead", "f1") and life.holds.hold("lead", "f2")
    life.holds.drop("lead", "f2")  # f2's hold timed out: it went on its own
    assert life.first_token("lead", lead, now=1.0) == ["f1"]
    assert not life.must_hold(d)  # the prefix is computed: nothing to wait for
    assert life.end("lead", lead) == []
    # a leader that ends before any token hands its followers back at its end
    other = life.dispatch("other", "w1", 64, 8, 0, wall=0.0)
    assert life.holds.hold("other", "f3")
    assert life.end("other", other) == ["f3"]
    assert len(life.holds) == 0


def test_replicas_claim_one_token_copies_on_known_workers_only() -> None:
    life = _lifecycle(3)
    d = Decision("w0", replicate_to=("w1", "w2", "gone"))
    reps = life.replicas("r", d, prompt_tokens=64, overlaps={"w1": 2}, wall=0.0)
    assert [(x.request_id, x.worker_id) for x in reps] == [
        (replica_id("r", "w1"), "w1"),
        (replica_id("r", "w2"), "w2"),
    ]
    s = life.state.states
    assert s["w1"].pending_prefill_tokens == 32 and s["w2"].pending_prefill_tokens == 64
    assert all(life.holds.pending(x.request_id) for x in reps)
    for x in reps:
        life.end(x.request_id, x.ticket)
    assert s["w1"].inflight == s["w2"].inflight == 0


def test_a_reservation_counts_against_a_sample_taken_at_or_before_its_dispatch() -> None:
    life = _lifecycle(1)
    life.state.on_load(WorkerLoad(worker_id="w0", ts=5.0, kv_blocks_free=60), now=5.0)
    w0 = life.state.states["w0"]
    before = life.dispatch("old", "w0", 160, 0, 0, wall=4.0)  # in the sample already
    at = life.dispatch("at", "w0", 160, 0, 0, wall=5.0)  # sampled, then dispatched
    assert w0.kv_blocks_free == 60 - 10
    life.end("at", at)
    life.end("old", before)
    assert w0.kv_blocks_free == 60


@pytest.mark.parametrize("seed", range(5))
def test_free_blocks_follow_their_definition_through_samples_dispatches_and_releases(
    seed: int,
) -> None:
    """Random telemetry samples (some stale, some without free blocks, some repeating a ts),
    dispatches at wall times around them and releases in any order: after every step each
    worker's ``kv_blocks_free`` is the sample's free blocks minus the blocks of the tickets
    dispatched at or after its ts (the state keeps that sum as it goes)."""
    rng = random.Random(seed)
    life = _lifecycle(2)
    st = life.state
    live: list[tuple[str, object]] = []
    samples: dict[str, WorkerLoad] = {}
    wall = 10.0
    for step in range(600):
        wid = rng.choice(["w0", "w1"])
        r = rng.random()
        if r < 0.45:
            wall += rng.choice([0.0, rng.random()])
            rid = f"r{step}"
            live.append(
                (rid, life.dispatch(rid, wid, rng.randint(1, 400), rng.randint(0, 64), 0, wall))
            )
        elif r < 0.8 and live:
            rid, t = live.pop(rng.randrange(len(live)))
            life.end(rid, t)
        else:
            ts = rng.choice(
                [wall, wall - rng.random(), samples[wid].ts if wid in samples else wall]
            )
            free = rng.choice([None, rng.randint(0, 100)])
            samples[wid] = WorkerLoad(worker_id=wid, ts=ts, kv_blocks_free=free)
            st.on_load(samples[wid], now=wall)
        for w, s in st.states.items():
            load = samples.get(w)
            if load is not None and load.kv_blocks_free is not None and not s.telemetry_stale:
                reserved = sum(
                    t.blocks for rid, t in live if t.worker_id == w and t.wall >= load.ts
                )
                assert s.kv_blocks_free == max(0, load.kv_blocks_free - reserved)
            else:
                held = sum(t.blocks for rid, t in live if t.worker_id == w)
                assert s.kv_blocks_free == max(0, CAP.num_gpu_blocks - held)


def test_decide_excludes_workers_without_touching_the_state() -> None:
    life = _lifecycle(2)
    policy = build_policy({"name": "least_request", "params": {}})
    req = RequestInfo("q", "m", 64, 8)
    life.dispatch("busy", "w1", 64, 8, 0, wall=0.0)
    assert life.decide(policy, req, {}, now=1.0).worker_id == "w0"
    assert life.decide(policy, req, {}, now=1.0, excluded={"w0"}).worker_id == "w1"
    assert set(life.state.snapshot.workers) == {"w0", "w1"}


def test_the_admission_queue_is_bounded_timed_and_first_in_first_out() -> None:
    # without tenants or priorities flow control's queue is the router's FIFO queue
    q: FlowQueue[str] = FlowQueue(VirtualCounters(), size=2, timeout_s=30.0)
    join = lambda e, t: q.join(e, NO_TENANT, t).ok  # noqa: E731
    assert join("a", 0.0) and join("b", 1.0) and not join("c", 1.0)
    assert q.head() == "a" and len(q) == 2
    assert q.left_s("a", 10.0) == 20.0 and not q.expired("a", 30.0) and q.expired("a", 30.5)
    q.leave("a")
    assert q.head() == "b" and join("c", 2.0)


def test_holds_on_a_request_that_is_not_pending_are_refused() -> None:
    h: FirstTokenHolds[str] = FirstTokenHolds()
    assert not h.hold("nobody", "f")
    h.sent("x")
    assert h.done("x") == [] and not h.hold("x", "f")


def test_a_streams_mean_gap_is_one_decode_observation_for_the_policys_latency_model() -> None:
    from services.core.latency import LatencyModel, step_features

    life = _lifecycle()
    slo = build_policy({"name": "slo_aware", "params": {}})
    req = RequestInfo("a", "m", prompt_tokens=320, max_tokens=32)
    assert life.decide(slo, req, {}, now=1.0).worker_id is not None  # models exist now
    model = slo.state.extra["slo_models"]["w0"]
    ref = LatencyModel(prior=model.prior)  # the same model fed by hand
    t = life.dispatch("a", "w0", prompt_tokens=320, max_tokens=32, cached_tokens=0, wall=1.0)
    life.dispatch("b", "w0", prompt_tokens=320, max_tokens=32, cached_tokens=0, wall=1.0)
    life.first_token("a", t, now=2.0)
    # 33 tokens from 2.0 s to 2.64 s: 20 ms apart; two requests in flight there
    life.decoded(slo, "w0", tokens=33, first_at=2.0, end_at=2.64)
    ctx = slo.state.extra["slo_ctx"]
    ref.observe(step_features(0.0, 0.0, 2, 2 * ctx), (2.64 - 2.0) / 32)
    assert model.observations == 1
    assert model.theta == ref.theta
    # nothing to learn from: one token, no time, an unknown worker, a policy without models
    life.decoded(slo, "w0", tokens=1, first_at=2.0, end_at=3.0)
    life.decoded(slo, "w0", tokens=9, first_at=2.0, end_at=2.0)
    life.decoded(slo, "w9", tokens=9, first_at=2.0, end_at=3.0)
    assert model.observations == 1
    kv = build_policy({"name": "kv_aware", "params": {}})
    life.decoded(kv, "w0", tokens=9, first_at=2.0, end_at=3.0)
    assert "slo_models" not in kv.state.extra


@pytest.mark.parametrize("policy", ["slo_aware", "kv_aware"])
def test_no_state_is_kept_for_workers_that_left(policy: str) -> None:
    """Workers come and go (a rolling deploy gives every pod a new name): once the cluster
    forgets one (no heartbeat for ``forget_after``), neither the cluster state nor the policy
    keeps anything for it but two counters per worker the routed-prefix memory reads (a few
    kB each otherwise: a latency model, a prefill clock, tickets; every redeploy of a
    1,000-engine fleet left ~3 MB in each router)."""
    state = ClusterState(worker_timeout=5.0, forget_after=10.0)
    life: RequestLifecycle[str] = RequestLifecycle(state)
    pol = build_policy({"name": policy, "params": {}})
    prompt = 4 * 16 * 8  # long enough for the prefill clock and the routed-prefix memory

    def beat(wid: str, now: float) -> None:
        hb = WorkerHeartbeat(
            worker_id=wid, instance_id="i", url=f"http://{wid}", model="m", capacity=CAP_BIG
        )
        state.on_heartbeat(hb, now=now)

    for i in range(60):
        now = float(i * 20)
        beat("stable", now)
        beat(f"pod{i}", now)  # the previous pod got no heartbeat for 20 s: forgotten
        state.sweep(now)
        assert set(state.states) == {"stable", f"pod{i}"}
        for j in range(3):
            rid = f"r{i}-{j}"
            keys = tuple(range(i * 100, i * 100 + prompt // 16))
            req = RequestInfo(
                request_id=rid, model="m", prompt_tokens=prompt, max_tokens=8, block_keys=keys
            )
            d = life.decide(pol, req, {}, now=now + j)
            assert d.worker_id is not None, d.reason
            t = life.dispatch(rid, d.worker_id, prompt, 8, 0, wall=now + j)
            state.states[d.worker_id].first_token_at = now + j + 0.5
            life.first_token(rid, t, now=now + j + 0.5)
            life.end(rid, t)
    live = set(state.states)
    extra = pol.state.extra
    clock = extra["kv_aware_clock"]
    for name, d in (
        ("fifo", clock.fifo),
        ("own", clock.own),
        ("computing", clock.computing),
        ("last_done", clock.last_done),
        ("busy", extra.get("kv_aware_busy", {})),
        ("slo_models", extra.get("slo_models", {})),
        ("cluster _local", state._local),
        ("cluster _tickets", state._tickets),
        ("cluster _reserved", state._reserved),
    ):
        assert set(d) <= live, (name, sorted(set(d) - live)[:5])


def test_decode_gaps_sum_one_over_the_gaps_of_the_requests_past_their_first_token() -> None:
    # max_tokens 11 -> 10 gaps: a stall of 1 s adds 0.1 s to its TPOT; 5 -> 0.25; 1 -> none
    life = _lifecycle()
    w0 = life.state.states["w0"]
    a = life.dispatch("a", "w0", prompt_tokens=64, max_tokens=11, cached_tokens=0, wall=1.0)
    b = life.dispatch("b", "w0", prompt_tokens=64, max_tokens=5, cached_tokens=0, wall=1.0)
    c = life.dispatch("c", "w0", prompt_tokens=64, max_tokens=1, cached_tokens=0, wall=1.0)
    d = life.dispatch("d", "w0", prompt_tokens=64, max_tokens=3, cached_tokens=0, wall=1.0)
    assert w0.decode_gaps == 0.0  # nobody decodes yet
    life.first_token("a", a, now=2.0)
    assert w0.decode_gaps == pytest.approx(0.1)
    life.first_token("b", b, now=2.0)
    life.first_token("c", c, now=2.0)
    assert w0.decode_gaps == pytest.approx(0.35)
    life.end("d", d)  # ended before its first token (an error): never counted
    assert w0.decode_gaps == pytest.approx(0.35)
    life.end("a", a)
    life.end("a", a)  # a second end changes nothing
    assert w0.decode_gaps == pytest.approx(0.25)
    life.end("b", b)
    life.end("c", c)
    assert (w0.inflight, w0.decode_gaps) == (0, 0.0)
