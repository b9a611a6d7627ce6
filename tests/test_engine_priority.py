"""The simulated engine's priority scheduling (vLLM's ``--scheduling-policy priority``;
SGLang's preemption threshold), worked out by hand on tiny engines (pure, virtual clock)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.engine import Engine, EngineConfig, SimRequest
from services.core.flow import BAND_STEP, Holdings, engine_priority


def prompt(tag: int, n: int = 16) -> list[int]:
    return [(tag * 131 + i * 7) % 251 + 1 for i in range(n)]


def cfg(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, max_num_seqs=1, max_num_batched_tokens=512, max_model_len=2048)
    base.update(kw)
    return EngineConfig(**base)


def drain(e: Engine, now: float = 0.0) -> tuple[list[str], list[list[str]]]:
    """Step until idle: (ids in the order they finished, the running ids after each step)."""
    order: list[str] = []
    running: list[list[str]] = []
    while (out := e.step(now)) is not None:
        now += out.duration_s
        order += [f.request_id for f in out.finished]
        running.append([s.req.request_id for s in e.running])
    return order, running


@pytest.mark.parametrize(
    "scheduling, expected",
    [
        ("fcfs", ["first", "b", "c", "d", "e"]),  # arrival order; priorities ignored
        # (priority, arrival): c (1, 2.0), d (1, 3.0), e (2, 0.5), b (2, 1.0)
        ("priority", ["first", "c", "d", "e", "b"]),
    ],
)
def test_the_queue_is_ordered_by_priority_then_arrival(scheduling, expected):
    e = Engine(cfg(scheduling=scheduling))  # one sequence slot: the queue's order is visible
    e.add_request(SimRequest("first", prompt(0), 3, arrival_time=0.1, priority=5))
    out = e.step(0.0)  # "first" takes the slot; the others queue behind it
    assert out is not None and [s.req.request_id for s in e.running] == ["first"]
    for rid, prio, at in (("b", 2, 1.0), ("c", 1, 2.0), ("d", 1, 3.0), ("e", 2, 0.5)):
        e.add_request(SimRequest(rid, prompt(ord(rid)), 1, arrival_time=at, priority=prio))
    order, _ = drain(e, out.duration_s)
    assert order == expected


@pytest.mark.parametrize(
    "scheduling, victim, first_done", [("fcfs", "hi", "lo"), ("priority", "lo", "hi")]
)
def test_out_of_blocks_the_lowest_priority_running_request_is_preempted(
    scheduling, victim, first_done
):
    """4 blocks of 16 tokens, vLLM admission. "lo" (priority 9) is admitted first, "hi"
    (priority 0) one step later; each has a 16-token prompt (1 block) and grows a block every
    16 tokens. After step 3 both hold 2 blocks (lo: 18 tokens computed, hi: 17): the pool is
    empty. In step 18 lo (32 computed) needs its third block: FCFS preempts the most recently
    admitted request (hi, vLLM's running[-1]); priority preempts the greatest (priority,
    arrival), lo itself, and schedules hi in the same step (vLLM's ``continue``)."""
    e = Engine(cfg(num_gpu_blocks=4, max_num_seqs=8, admission="vllm", scheduling=scheduling))
    e.add_request(SimRequest("lo", prompt(1), 40, arrival_time=0.0, priority=9))
    out = e.step(0.0)
    assert out is not None
    e.add_request(SimRequest("hi", prompt(2), 40, arrival_time=out.duration_s, priority=0))
    order, running = drain(e, out.duration_s)
    assert running[15] == ["lo", "hi"]  # the 17th step: nobody preempted yet
    assert running[16] == [r for r in ("lo", "hi") if r != victim]  # the 18th
    assert [s.req.request_id for s in e.waiting] == [] and e.num_preemptions >= 1
    assert order[0] == first_done


@pytest.mark.parametrize(
    "threshold, preempted",
    [(None, False), (20, False), (19, True), (0, True)],
)
def test_a_waiting_request_preempts_only_past_the_threshold(threshold, preempted):
    """SGLang's rule: a request that finds no free slot preempts a running one whose priority
    value is more than ``preempt_threshold`` above its own (20 - 0 = 20 here); None (vLLM):
    never. The victim goes back to the queue and resumes after the urgent one."""
    e = Engine(cfg(scheduling="priority", preempt_threshold=threshold))
    e.add_request(SimRequest("bulk", prompt(1), 8, arrival_time=0.0, priority=20))
    out = e.step(0.0)
    assert out is not None
    e.add_request(SimRequest("urgent", prompt(2), 2, arrival_time=1.0, priority=0))
    out = e.step(out.duration_s)
    assert out is not None
    assert [s.req.request_id for s in e.running] == (["urgent"] if preempted else ["bulk"])
    assert e.num_preemptions == int(preempted)
    order, _ = drain(e, out.duration_s)
    assert order == (["urgent", "bulk"] if preempted else ["bulk", "urgent"])


def test_scheduling_settings_are_validated():
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="lifo")
    with pytest.raises(ValueError, match="preempt_threshold"):
        EngineConfig(scheduling="priority", preempt_threshold=-1)


def test_engine_priority_is_the_band_then_the_share_held():
    """critical < standard < sheddable, 20 apart (above SGLang's default preemption threshold
    of 10); +1 within a band for a flow over its share."""
    assert [engine_priority(r, False) for r in range(3)] == [0, 20, 40]
    assert engine_priority(1, True) == 21 and BAND_STEP == 20
    assert engine_priority(0, True) < engine_priority(1, False)  # bands strictly first


def test_holdings_over_share_worked_by_hand():
    """The share test over work in flight (prompt tokens), requests of equal work: the same
    answers as counting requests."""
    h = Holdings()
    assert not h.over_share("heavy", 1.0, 100)  # nothing in flight: 100/100 is its whole share
    for _ in range(3):
        h.add("heavy", 1.0, 100)
    # alone it holds everything: (300+100)/(300+100) is its whole share (no one else holds any)
    assert not h.over_share("heavy", 1.0, 100)
    h.add("light", 1.0, 100)  # heavy 300, light 100; weights 1 + 1
    assert h.over_share("heavy", 1.0, 100)  # 400/500 > 1/2
    assert not h.over_share("light", 1.0, 100)  # 200/500 <= 1/2
    assert not h.over_share("new", 1.0, 100)  # it holds nothing: never over its share
    h.add("b", 2.0, 100)  # heavy 300, light 100, b 100 (weight 2): total 500, weights 4
    assert not h.over_share("b", 2.0, 100)  # 200/600 <= 2/4
    assert h.over_share("heavy", 1.0, 100)  # 400/600 > 1/4
    for f in ("heavy", "heavy", "heavy", "light", "b"):
        h.remove(f, 100)
    h.remove("absent", 100)  # no-op
    assert h.total_work == 0 and h.work == {} and h.count == {}
    assert h.weight == {} and h.total_weight == 0.0


def test_holdings_few_large_requests_against_many_small_ones():
    """Issue #40's case: a heavy tenant held back to 2 long prompts (1024 tokens) in flight, a
    light tenant with a burst of short ones (256). Counted in requests, the light tenant's 3rd
    would be over its half (3/5); counted in work it holds 768 of 2816: under, so the prefill
    room still protects it and its engine priority is not lowered."""
    h = Holdings()
    h.add("heavy", 1.0, 1024)
    h.add("heavy", 1.0, 1024)
    h.add("light", 1.0, 256)
    h.add("light", 1.0, 256)
    assert not h.over_share("light", 1.0, 256)  # (512+256)/(2560+256) = 0.27 <= 1/2
    assert h.over_share("heavy", 1.0, 1024)  # (2048+1024)/(2560+1024) = 0.86 > 1/2
    # the light tenant is over its half only once its work is: 8 short requests hold 2048,
    # the 9th would make (2048+256)/(4096+256) = 0.53 > 1/2
    for _ in range(6):
        h.add("light", 1.0, 256)
    assert h.count["light"] == 8 and h.work["light"] == 2048 == h.work["heavy"]
    assert h.over_share("light", 1.0, 256)
    # weights: a tenant of weight 3 beside heavy's 1 may hold 3/4 of the work
    h.add("big", 3.0, 6144)  # big 6144 of 10240, weights 5: its share 3/5
    assert not h.over_share("big", 3.0, 0)  # 6144/10240 = 0.6 <= 3/5
    assert h.over_share("big", 3.0, 1)  # 6145/10241 > 3/5
    # a new flow's zero-work request is never over its share
    assert not h.over_share("empty", 1.0, 0)
    assert h.total_work == 2048 + 2048 + 6144
    with pytest.raises(ValueError, match=">= 0"):
        h.add("light", 1.0, -1)


def test_holdings_share_is_among_the_active_tenants():
    """Live, #40: the heavy tenant alone in flight between the light tenants' short requests
    was within "its share" of the holders (1/1). A tenant that arrived within the window
    counts in the division while it holds nothing; it leaves it when its latest arrival is
    older than the window (as of the next arrival)."""
    h = Holdings(window_s=10.0)
    for t, f in enumerate(["heavy", "light0", "light1", "light2"]):
        h.arrived(f, 1.0, float(t))
    # nothing in flight: a lone request is not over its quarter (holding nothing, never)
    assert not h.over_share("heavy", 1.0, 1024)
    h.add("heavy", 1.0, 1024)
    h.add("heavy", 1.0, 1024)  # heavy alone in flight; the light tenants active, idle
    assert h.idle_weight == 3.0
    assert h.over_share("heavy", 1.0, 1024)  # 3072/3072 > 1/4
    assert not h.over_share("light0", 1.0, 256)  # 256/2304 <= 1/4
    h.add("light0", 1.0, 256)  # now a holder: not counted twice
    assert h.idle_weight == 2.0 and h.total_weight == 2.0
    assert not h.over_share("light0", 1.0, 256)  # 512/2560 <= 1/4
    h.remove("light0", 256)  # idle again, still within its window
    assert h.idle_weight == 3.0
    # 20 s later only heavy sends: the light tenants leave the division, heavy is alone
    h.arrived("heavy", 1.0, 23.0)
    assert h.idle_weight == 0.0 and list(h.recent) == ["heavy"]
    assert not h.over_share("heavy", 1.0, 1024)
    # a tenant's new weight replaces its old one in the division
    h.arrived("light0", 1.0, 24.0)
    h.arrived("light0", 3.0, 25.0)
    assert h.idle_weight == 3.0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(min_value=0, max_value=5000),
            st.sampled_from(["add", "end", "arrive"]),
        ),
        max_size=60,
    )
)
def test_holdings_invariant_each_request_releases_what_it_charged(ops):
    """Any interleaving of arrivals, dispatches and ends, each end releasing the amount its
    request was added with: per-flow work and counts are the sums of the requests in flight,
    never negative, the totals their sums, and everything is zero when nothing is in flight;
    the idle weight is the weight of the flows active within the window holding nothing."""
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    h = Holdings(window_s=3.0)
    inflight: list[tuple[str, int]] = []
    last: dict[str, float] = {}
    now = 0.0
    for flow, work, op in ops:
        if op == "end" and inflight:
            f, w = inflight.pop(work % len(inflight))  # not necessarily the oldest
            h.remove(f, w)
        elif op == "arrive":
            now += work % 3  # 0-2 s later
            h.arrived(flow, weights[flow], now)
            last[flow] = now
        else:
            h.add(flow, weights[flow], work)
            inflight.append((flow, work))
        active = {f for f, t in last.items() if now - t <= 3.0}
        assert set(h.recent) == active
        idle = sum(weights[f] for f in active if f not in h.count)
        assert h.idle_weight == pytest.approx(idle)
        for f in weights:
            mine = [w for g, w in inflight if g == f]
            assert h.count.get(f, 0) == len(mine)
            assert h.work.get(f, 0) == sum(mine) >= 0
        assert h.total_work == sum(w for _, w in inflight) >= 0
        assert h.total_weight == pytest.approx(sum(weights[f] for f in h.count))
    for f, w in inflight:
        h.remove(f, w)
    assert h.total_work == 0 and h.work == {} and h.count == {} and h.weight == {}
    assert h.total_weight == 0.0


def test_holdings_release_never_goes_below_zero():
    """A release larger than what the flow holds takes only what it holds; the flow's last
    request releases all of it."""
    h = Holdings()
    h.add("a", 1.0, 10)
    h.add("a", 1.0, 5)
    h.remove("a", 50)  # more than it holds: clamped
    assert h.work["a"] == 0 and h.count["a"] == 1 and h.total_work == 0
    h.remove("a", 5)
    assert h.work == {} and h.count == {} and h.total_work == 0 and h.total_weight == 0.0


def test_the_sim_workers_priority_field_as_vllm_reads_it():
    """vLLM 0.33's protocol: ``priority`` an int64, default 0; the sim worker's FCFS engine
    refuses a non-zero one (as vLLM's V0 engine did), its priority engine takes it."""
    from services.common.tokenizer import ByteTokenizer
    from services.worker_sim.openai_api import ApiError, parse_request

    tok = ByteTokenizer()
    body = {"model": "m", "prompt": "x", "priority": -7}
    assert parse_request("completion", body, tok, "m", priority_scheduling=True).priority == -7
    assert (
        parse_request("completion", {"prompt": "x"}, tok, "m", priority_scheduling=True).priority
        == 0
    )
    assert parse_request("completion", {**body, "priority": 0}, tok, "m").priority == 0
    for bad, sched in (("high", True), (True, True), (1 << 63, True), (-7, False)):
        with pytest.raises(ApiError) as e:
            parse_request(
                "completion", {**body, "priority": bad}, tok, "m", priority_scheduling=sched
            )
        assert e.value.param == "priority"


def test_sim_worker_flags_select_the_policy():
    """``kvgate sim-worker --scheduling-policy priority --priority-preemption-threshold 0``;
    the defaults leave the engine as it was (FCFS, never preempting for a waiting request)."""
    from services.common import settings as S
    from services.common.tokenizer import ByteTokenizer
    from services.worker_sim import cli as sim_cli
    from services.worker_sim.app import engine_config_from

    parser = argparse.ArgumentParser()
    S.add_options(parser, sim_cli.OPTIONS)

    def config(argv: list[str], env: dict[str, str]) -> EngineConfig:
        st = S.resolve(parser.parse_args(argv), sim_cli.OPTIONS, environ=env)
        return engine_config_from(st, ByteTokenizer())

    cfg = config([], {})
    assert (cfg.scheduling, cfg.preempt_threshold) == ("fcfs", None)
    cfg = config(["--scheduling-policy", "priority", "--priority-preemption-threshold", "0"], {})
    assert (cfg.scheduling, cfg.preempt_threshold) == ("priority", 0)
    cfg = config([], {"KVGATE_SIM_SCHEDULING_POLICY": "priority"})
    assert (cfg.scheduling, cfg.preempt_threshold) == ("priority", None)
