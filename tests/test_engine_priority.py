"""The simulated engine's priority scheduling (vLLM's ``--scheduling-policy priority``;
SGLang's preemption threshold), worked out by hand on tiny engines (pure, virtual clock)."""

from __future__ import annotations

import argparse

import pytest

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
    h = Holdings()
    assert not h.over_share("heavy", 1.0)  # nothing in flight: 1/1 is not above 1/1
    for _ in range(3):
        h.add("heavy", 1.0)
    # alone it holds everything: (3+1)/(3+1) is its whole share (no one else holds any)
    assert not h.over_share("heavy", 1.0)
    h.add("light", 1.0)  # heavy 3, light 1; weights 1 + 1
    assert h.over_share("heavy", 1.0)  # 4/5 > 1/2
    assert not h.over_share("light", 1.0)  # 2/5 <= 1/2
    assert not h.over_share("new", 1.0)  # 1/5 <= 1/3 (its weight joins the sum)
    h.add("b", 2.0)  # heavy 3, light 1, b 1 (weight 2): total 5, weights 4
    assert not h.over_share("b", 2.0)  # 2/6 <= 2/4
    assert h.over_share("heavy", 1.0)  # 4/6 > 1/4
    for f in ("heavy", "heavy", "heavy", "light", "b"):
        h.remove(f)
    h.remove("absent")  # no-op
    assert h.total == 0 and h.count == {} and h.weight == {} and h.total_weight == 0.0


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
