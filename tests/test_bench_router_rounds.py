"""The proxy bench's throughput phase with --rounds: targets take turns, figures add up."""

from __future__ import annotations

import asyncio

import pytest

from bench import bench_router


def test_targets_take_turns_and_rates_are_over_all_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, float]] = []
    # per target and turn: (answers, seconds measured); A is steady, B slows down
    turns = {"a": [(100, 1.0), (100, 1.0), (100, 1.0)], "b": [(90, 1.0), (60, 1.0), (30, 1.0)]}
    cpu = {"a": 0.0, "b": 0.0}

    async def latency(url: str, requests: int, body: dict) -> list[float]:
        return [0.001] * requests

    async def run(url: str, conns: int, seconds: float, body: dict) -> tuple[int, float, int]:
        name = url.split("//")[1].split("/")[0]
        calls.append((name, seconds))
        cpu[name] += 0.01  # each turn costs the target 10 ms of CPU
        return (*turns[name][sum(1 for c in calls if c[0] == name) - 1], 0)

    monkeypatch.setattr(bench_router, "_latency", latency)
    monkeypatch.setattr(bench_router, "_throughput_run", run)
    monkeypatch.setattr(bench_router, "_tree_cpu_s", lambda pid: cpu["a" if pid == 1 else "b"])
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
        )
    )
    assert calls == [("a", 2.0), ("b", 2.0)] * 3
    assert out["a"]["throughput_rps"] == pytest.approx(100.0)
    assert out["b"]["throughput_rps"] == pytest.approx(60.0)  # 180 answers over 3 s
    assert out["b"]["cpu_us_per_request"] == pytest.approx(0.03 / 180 * 1e6)


def test_rounds_below_one_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_router.main(["proxy", "--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
