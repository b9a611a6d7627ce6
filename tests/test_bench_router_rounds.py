"""The proxy bench's phases: targets take turns (--rounds) at one connection and under load,
figures add up, and each process's CPU per request (target, worker, load generator)."""

from __future__ import annotations

import asyncio

import pytest

from bench import bench_router


def test_targets_take_turns_and_rates_are_over_all_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, float]] = []
    latency_calls: list[tuple[str, int]] = []
    # per target and turn: (answers, seconds measured); A is steady, B slows down
    turns = {"a": [(100, 1.0), (100, 1.0), (100, 1.0)], "b": [(90, 1.0), (60, 1.0), (30, 1.0)]}
    cpu = {"a": 0.0, "b": 0.0, "worker": 0.0, "client": 0.0}

    async def latency(url: str, requests: int, body: dict) -> list[float]:
        latency_calls.append((url.split("//")[1].split("/")[0], requests))
        return [0.001] * requests

    async def run(url: str, conns: int, seconds: float, body: dict) -> tuple[int, float, int]:
        name = url.split("//")[1].split("/")[0]
        calls.append((name, seconds))
        cpu[name] += 0.01  # each turn costs the target 10 ms of CPU
        # the worker and the load generator: 20 and 30 ms a turn for A, 40 and 60 for B
        cpu["worker"] += 0.02 if name == "a" else 0.04
        cpu["client"] += 0.03 if name == "a" else 0.06
        return (*turns[name][sum(1 for c in calls if c[0] == name) - 1], 0)

    monkeypatch.setattr(bench_router, "_latency", latency)
    monkeypatch.setattr(bench_router, "_throughput_run", run)
    monkeypatch.setattr(
        bench_router, "_tree_cpu_s", lambda pid: cpu[{1: "a", 2: "b", 9: "worker"}[pid]]
    )
    monkeypatch.setattr(bench_router, "_own_cpu_s", lambda: cpu["client"])
    out = asyncio.run(
        bench_router._measure_targets(
            {"a": "http://a", "b": "http://b"},
            {"a": 1, "b": 2},
            bench_router.BODY,
            requests=10,
            conns=4,
            seconds=6.0,
            mode="whole",
            rounds=3,
            worker_pid=9,
        )
    )
    assert calls == [("a", 2.0), ("b", 2.0)] * 3
    # the 10 sequential requests of each target's latency in turns too: 4, 3, 3
    assert latency_calls == [("a", 4), ("b", 4), ("a", 3), ("b", 3), ("a", 3), ("b", 3)]
    assert out["a"]["throughput_rps"] == pytest.approx(100.0)
    assert out["b"]["throughput_rps"] == pytest.approx(60.0)  # 180 answers over 3 s
    assert out["b"]["cpu_us_per_request"] == pytest.approx(0.03 / 180 * 1e6)
    # the worker's and the load generator's CPU while each target was measured, per answer
    assert out["a"]["worker_cpu_us_per_request"] == pytest.approx(0.06 / 300 * 1e6)
    assert out["b"]["worker_cpu_us_per_request"] == pytest.approx(0.12 / 180 * 1e6)
    assert out["b"]["client_cpu_us_per_request"] == pytest.approx(0.18 / 180 * 1e6)
    assert out["b"]["all_cpu_us_per_request"] == pytest.approx(0.33 / 180 * 1e6)


def test_the_direct_target_is_the_worker_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = {"worker": 0.0, "client": 0.0}

    async def latency(url: str, requests: int, body: dict) -> list[float]:
        return [0.001] * requests

    async def run(url: str, conns: int, seconds: float, body: dict) -> tuple[int, float, int]:
        cpu["worker"] += 0.05
        cpu["client"] += 0.07
        return 100, 1.0, 0

    monkeypatch.setattr(bench_router, "_latency", latency)
    monkeypatch.setattr(bench_router, "_throughput_run", run)
    monkeypatch.setattr(bench_router, "_tree_cpu_s", lambda pid: cpu["worker"])
    monkeypatch.setattr(bench_router, "_own_cpu_s", lambda: cpu["client"])
    out = asyncio.run(
        bench_router._measure_targets(
            {"direct": "http://w"},
            {"direct": 9},
            bench_router.BODY,
            10,
            4,
            1.0,
            "whole",
            worker_pid=9,
        )
    )
    assert out["direct"]["cpu_us_per_request"] == pytest.approx(500.0)
    assert out["direct"]["all_cpu_us_per_request"] == pytest.approx(1200.0)  # not 1700


def test_unknown_also_policy_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_router.main(["proxy", "--also-policies", "round_robin,nope"])
    assert exc.value.code == 2
    assert "--also-policies: unknown ['nope']" in capsys.readouterr().err


def test_rounds_below_one_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_router.main(["proxy", "--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
