"""The prefill room (services/core/flow/prefill_room.py), worked out by hand, and in the
simulator: a protected request passes a best-effort one the room holds; without protected
traffic every decision is the policy's own."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.simcore import SimOptions, simulate
from bench.workloads import BenchRequest, random_text
from services.common.tenancy import Priority, RequestTenancy
from services.core.flow import (
    FlowQueue,
    PrefillRoom,
    VirtualCounters,
    decide_in_room,
    is_protected,
    poisson_room,
)
from services.core.flow.prefill_room import place
from services.core.policy.types import Capacity, Decision, WorkerState


def test_room_is_the_poisson_quantile() -> None:
    # mean 0.5: P[N >= 1] = 1 - e^-.5 = 0.393; P[N >= 2] = 1 - 1.5 e^-.5 = 0.090;
    # P[N >= 3] = 1 - 1.625 e^-.5 = 0.0144; P[N >= 4] = 1 - (1.625 + 1/48) e^-.5 = 0.00175
    assert poisson_room(0.5, 0.5) == 1
    assert poisson_room(0.5, 0.9) == 2  # 0.090 <= 0.1
    assert poisson_room(0.5, 0.98) == 3  # 0.0144 <= 0.02
    assert poisson_room(0.5, 0.99) == 4  # 0.0144 > 0.01 >= 0.00175
    # mean 0.1: P[N >= 1] = 0.0952 <= 0.1
    assert poisson_room(0.1, 0.9) == 1
    assert poisson_room(0.0, 0.99) == 0  # no protected load: nothing held
    for q in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError):
            poisson_room(1.0, q)


def test_measured_load_decays_over_the_window() -> None:
    room = PrefillRoom(window_s=10.0, quantile=0.9)
    assert room.room(0.0) == 0  # nothing arrived: work-conserving
    for _ in range(10):
        room.arrived(0.0, 0.5)  # 10 x 0.5 s / 10 s = 0.5 Erlang
    assert room.load(0.0) == pytest.approx(0.5)
    assert room.room(0.0) == 2
    assert room.load(10.0) == pytest.approx(0.5 / math.e)  # 0.184: P[N >= 1] = 0.168
    assert room.room(10.0) == 2
    # 10 e^-10 = 4.5e-4 arrivals per window: none recently, the policy's own decisions
    assert room.room(100.0) == 0
    lone = PrefillRoom(window_s=10.0, quantile=0.9)
    lone.arrived(0.0, 0.5)
    assert lone.room(0.0) == 1 and lone.room(0.1) == 0  # one arrival is not a stream


def test_who_is_protected() -> None:
    C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
    assert is_protected(C, True) and is_protected(C, False)
    assert is_protected(S, False) and not is_protected(S, True)
    assert not is_protected(X, False)


Q = {"a": 0, "b": 900, "c": 0, "d": 300}  # queued prompt tokens per worker


def test_protected_placement_keeps_a_prompt_free_choice_else_first_free_in_policy_order() -> None:
    # the policy's choice computes no prompt: kept (its cache-aware choice stands)
    assert place("c", ["b", "a", "c", "d"], Q, True, 2, 2) == "c"
    # the choice computes a prompt: the first prompt-free candidate in the policy's order
    assert place("b", ["b", "c", "a", "d"], Q, True, 2, 2) == "c"
    # none computes no prompt: the fewest queued tokens (ties: the policy's order)
    busy = {"b": 900, "d": 300, "e": 300}
    assert place("b", ["b", "e", "d"], busy, True, 2, 0) == "e"


def test_best_effort_keeps_the_room() -> None:
    assert place("b", ["b", "a"], Q, False, 0, 2) == "b"  # room 0: the policy's choice
    assert place("a", ["a", "c"], Q, False, 1, 2) == "a"  # 1 prompt-free left after it
    assert place("a", ["a", "c"], Q, False, 2, 2) is None  # would leave 1 < 2: held
    # the choice computes a prompt: the first prompt-free candidate in the policy's order
    # (never stacked onto a prompt: measured worse, docs/router.md)
    assert place("b", ["b", "d", "c", "a"], Q, False, 1, 2) == "c"
    assert place("b", ["b", "d", "c", "a"], Q, False, 2, 2) is None


def _workers(queued: dict[str, int]) -> dict[str, WorkerState]:
    return {
        w: WorkerState(w, capacity=Capacity(block_size=16), pending_prefill_tokens=q)
        for w, q in queued.items()
    }


def test_decisions_in_the_room() -> None:
    ws = _workers(Q)
    d = Decision("b", scores={"b": 1.0, "a": 2.0, "c": 3.0}, overlap_blocks=5, cached_tokens=80)
    # best-effort with no room: the very same decision (work-conserving)
    assert decide_in_room(d, ws, {"b": 5}, 200, False, 0) is d
    # protected: moved to the first prompt-free candidate; its own cached tokens
    moved = decide_in_room(d, ws, {"b": 5, "a": 2}, 200, True, 1)
    assert moved is not None and moved.worker_id == "a"
    assert moved.overlap_blocks == 2 and moved.cached_tokens == 32 and moved.after is None
    # a prompt-free choice stands for a protected request
    d2 = Decision("c", scores={"b": 1.0, "c": 2.0})
    assert decide_in_room(d2, ws, {}, 200, True, 3) is d2
    # best-effort, room 2 over the candidates {b, c} (one prompt-free): held
    assert decide_in_room(d2, ws, {}, 200, False, 2) is None


def test_the_room_never_takes_the_whole_fleet() -> None:
    """A room at or above the model's routable workers is capped one below them, so best-effort
    prompts keep a worker; a cordoned worker or another model's does not count."""
    ws = _workers({"a": 0, "b": 0, "c": 0})
    d = Decision("a", scores={"a": 1.0, "b": 2.0, "c": 3.0})
    # room 3 = the whole fleet: capped at 2; all three prompt-free, 2 stay free after it
    assert decide_in_room(d, ws, {}, 200, False, 3) is d
    assert decide_in_room(d, ws, {}, 200, False, 2) is d
    # one of the three computes a prompt: 1 < 2 stays free after it: held
    busy = {**ws, "c": dataclasses.replace(ws["c"], pending_prefill_tokens=50)}
    assert decide_in_room(d, busy, {}, 200, False, 3) is None
    # c cordoned: the fleet is a and b, the room at most 1: a best-effort request goes
    cordoned = {**busy, "c": dataclasses.replace(busy["c"], cordoned=True)}
    assert decide_in_room(d, cordoned, {}, 200, False, 3) is d
    # another model's workers do not count: a fleet of one keeps no room
    other = {**busy, "b": dataclasses.replace(ws["b"], model="other")}
    solo = {"a": busy["a"], "b": other["b"], "c": cordoned["c"]}
    one = Decision("a", scores={"a": 1.0})
    assert decide_in_room(one, solo, {}, 200, False, 5) is one


def test_flow_heads_are_by_band_then_arrival() -> None:
    q: FlowQueue[str] = FlowQueue(VirtualCounters(), 100, 30.0)
    q.join("h1", RequestTenancy("heavy", Priority.STANDARD), 0.0)
    q.join("x1", RequestTenancy("shed", Priority.SHEDDABLE), 0.1)
    q.join("h2", RequestTenancy("heavy", Priority.STANDARD), 0.15)
    q.join("l1", RequestTenancy("light", Priority.STANDARD), 0.2)
    q.join("c1", RequestTenancy("crit", Priority.CRITICAL), 0.3)
    assert q.flow_heads() == ["c1", "h1", "l1", "x1"]
    q.leave("h1")
    assert q.flow_heads() == ["c1", "h2", "l1", "x1"]  # h2 came before l1


def _flood(n_heavy: int, n_light: int, light_prio: str = "standard") -> list[BenchRequest]:
    import random

    rng = random.Random(5)
    reqs = [
        BenchRequest(f"heavy-{i}", random_text(rng, 2048), 16, arrival_s=0.001 * i, tenant="heavy")
        for i in range(n_heavy)
    ]
    reqs += [
        BenchRequest(
            f"light-{i}",
            random_text(rng, 128),
            4,
            arrival_s=0.05 + 0.02 * i,
            tenant="light",
            priority=light_prio,
        )
        for i in range(n_light)
    ]
    return sorted(reqs, key=lambda r: r.arrival_s)


def _opts(protect: bool) -> SimOptions:
    return SimOptions(
        num_workers=2,
        engine={"max_num_batched_tokens": 4096},
        telemetry_interval_s=0.1,
        protect_prefill=protect,
        protect_quantile=0.9,
    )


POLICY = {"name": "least_request", "params": {"max_inflight": 16}}


def test_sim_protected_requests_pass_held_best_effort_ones() -> None:
    reqs = _flood(40, 10)
    on = simulate(reqs, POLICY, _opts(True))
    at = on.dispatched_at
    heavy_waiting = [r for r in reqs if r.tenant == "heavy" and at[r.request_id] > 0.06]
    light = [r for r in reqs if r.tenant == "light"]
    # heavy requests that arrived first still wait when light ones are dispatched
    passed = [
        lr
        for lr in light
        if any(
            h.arrival_s < lr.arrival_s and at[h.request_id] > at[lr.request_id]
            for h in reqs
            if h.tenant == "heavy"
        )
    ]
    assert heavy_waiting and passed
    off = simulate(reqs, POLICY, _opts(False))
    ttft = lambda run: sorted(  # noqa: E731
        r.ttft_s for r in run.results if r.request_id.startswith("light") and r.ttft_s
    )
    assert ttft(on)[-1] < ttft(off)[-1]  # and the light tail is shorter for it
    assert all(r.status == "ok" for r in on.results)
    # the run says how each request was sent: the room's holds (heavy ones held, light never),
    # and its worker computed no prompt when a light one was sent there past held heavy ones
    sent = on.sent_into
    assert set(sent) == set(at)
    assert any(sent[h.request_id][0] > 0 for h in heavy_waiting)
    assert all(sent[lr.request_id][0] == 0 for lr in light)
    assert any(sent[lr.request_id][1] == 0 for lr in passed)
    assert all(holds == 0 for holds, _, _ in off.sent_into.values())


def test_sim_without_protected_traffic_decides_as_today() -> None:
    # every request sheddable: none is protected, the room stays 0
    reqs = [
        BenchRequest(
            r.request_id, r.prompt, r.max_tokens, r.arrival_s, tenant=r.tenant, priority="sheddable"
        )
        for r in _flood(12, 0)
    ]
    on, off = simulate(reqs, POLICY, _opts(True)), simulate(reqs, POLICY, _opts(False))
    assert [(r.request_id, r.worker, r.status, r.ttft_s) for r in on.results] == [
        (r.request_id, r.worker, r.status, r.ttft_s) for r in off.results
    ]
    assert on.dispatched_at == off.dispatched_at


def test_protected_prompt_s_is_the_latency_models_ttft_on_an_idle_worker() -> None:
    from services.core.flow import protected_prompt_s
    from services.core.latency import StepCoefficients, predict_fast

    c = StepCoefficients.from_engine().as_list()
    for n in (1, 256, 8192, 8193, 20000):
        assert protected_prompt_s(c, n, 8192) == pytest.approx(
            predict_fast(c, 0.0, 0, 0.0, 8192, n, n, 1)[0], rel=1e-12
        )
    # 256 tokens: 6.5 ms overhead + 256 x 40 µs + 2.5e-9 x 256^2 / 2 = 16.82 ms
    assert protected_prompt_s(c, 256, 8192) == pytest.approx(
        0.0065 + 256 * 4e-5 + 2.5e-9 * 256**2 / 2
    )


def test_router_flow_control_protects_by_work_in_flight_and_releases_it() -> None:
    """The router's FlowControl (services/router/flow_control.py) with the room on: a light
    tenant's burst of short prompts beside a heavy tenant held to two long ones is protected
    while its work is under its half, whatever its request count; every end releases what its
    dispatch charged, so nothing is held when nothing is in flight."""
    from services.router.flow_control import FlowControl

    fc = FlowControl(8, 1.0, 10.0, protect_quantile=0.95)
    heavy, light = RequestTenancy("heavy"), RequestTenancy("light")
    crit = RequestTenancy("ops", Priority.CRITICAL)
    for _ in range(2):
        fc.dispatched(heavy, 1024, 0.0)
    for i in range(8):  # light's (i+1)-th: (256 i + 256) / (2048 + 256 i + 256) <= 1/2
        assert fc.protected(light, 256), i
        fc.dispatched(light, 256, 0.0)
    assert not fc.protected(light, 256)  # 9th: 2304 / 4352 > 1/2
    assert not fc.protected(heavy, 1024)  # (2048 + 1024) / (4096 + 1024) > 1/2
    assert fc.protected(crit, 100_000)  # critical: always
    h = fc.holdings
    assert h is not None and h.work == {"heavy": 2048, "light": 2048}
    assert h.count == {"heavy": 2, "light": 8}
    for _ in range(2):
        fc.ended(heavy, 1024, 128, 1.0)
    for _ in range(8):
        fc.ended(light, 256, 32, 1.0)
    assert h.work == {} and h.count == {} and h.total_work == 0 and h.total_weight == 0.0
