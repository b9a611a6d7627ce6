"""Alerts you can trust on the router: the breaker closes only on evidence from after it
opened (its model is tested in tests/test_router_breaker.py), latency outliers are ejected (with an alert), circuit_open is critical, a migrated
stream reports the usage of one whole answer."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from services.common.bus import Bus
from services.common.schemas import Alert
from services.common.streams import require_alert_streams
from services.router.outlier import OutlierConfig, OutlierDetector
from services.router.usage import continued_usage
from tests.test_router_failures import _cluster, _sse_text, _teardown
from tests.test_router_support import post, wait_until

# ----------------------------------------------------------------------------- outliers (pure)


def _feed(d: OutlierDetector, lat: dict[str, float], now: float, n: int = 6) -> None:
    for i in range(n):
        for wid, s_per_token in lat.items():
            d.record(wid, now - n + i, s_per_token * 10, 10)


def test_outlier_ejects_a_worker_five_times_slower_than_the_fleet_then_returns_it() -> None:
    d = OutlierDetector(OutlierConfig(ratio=3.0, window_s=30, eject_s=10, min_requests=5))
    _feed(d, {"w0": 0.05, "w1": 0.01, "w2": 0.011, "w3": 0.009}, now=100.0)
    changes = d.evaluate(100.0)
    assert [(c.worker_id, c.ejected) for c in changes] == [("w0", True)]
    assert changes[0].latency == pytest.approx(0.05) and changes[0].fleet == pytest.approx(0.01)
    assert d.is_ejected("w0") and changes[0].until == 110.0
    d.record("w0", 101.0, 9.0, 1)  # ignored while ejected
    assert d.evaluate(105.0) == []
    back = d.evaluate(110.0)
    assert [(c.worker_id, c.ejected) for c in back] == [("w0", False)]
    assert not d.is_ejected("w0") and "w0" not in d.latencies(110.0)  # fresh evidence needed


def test_outlier_leaves_a_fleet_wide_slowdown_and_thin_evidence_alone() -> None:
    d = OutlierDetector(OutlierConfig(ratio=3.0, min_requests=5))
    _feed(d, {"w0": 0.5, "w1": 0.5, "w2": 0.45, "w3": 0.55}, now=100.0)  # all slow
    assert d.evaluate(100.0) == []
    thin = OutlierDetector(OutlierConfig(ratio=3.0, min_requests=5))
    _feed(thin, {"w0": 0.5, "w1": 0.01, "w2": 0.01}, now=100.0, n=4)  # 4 < min_requests
    assert thin.evaluate(100.0) == []
    two = OutlierDetector(OutlierConfig(ratio=3.0, min_requests=5))
    _feed(two, {"w0": 0.5, "w1": 0.01}, now=100.0)  # one other worker is no fleet
    assert two.evaluate(100.0) == []


def test_outlier_ejects_at_most_a_third_of_the_fleet() -> None:
    d = OutlierDetector(OutlierConfig(ratio=3.0, min_requests=5))
    lat = {"a": 0.5, "b": 0.4, "c": 0.01, "d": 0.01, "e": 0.01, "f": 0.012}
    _feed(d, lat, now=100.0)
    ejected = [c.worker_id for c in d.evaluate(100.0) if c.ejected]
    assert ejected == ["a", "b"]  # 6 workers: at most 2, the slowest first


def test_outlier_config_is_validated() -> None:
    with pytest.raises(ValueError):
        OutlierConfig(ratio=1.0)


# ----------------------------------------------------------------------------- usage (pure)


def test_continued_usage_reads_as_one_answer() -> None:
    # 300-token answer cut after 92: the continuation was asked for 208 on prompt + 92
    worker = {
        "prompt_tokens": 50 + 92,
        "completion_tokens": 208,
        "total_tokens": 350,
        "prompt_tokens_details": {"cached_tokens": 140},
    }
    u = continued_usage(worker, 92)
    assert u["prompt_tokens"] == 50 and u["completion_tokens"] == 300
    assert u["total_tokens"] == 350 and u["prompt_tokens_details"]["cached_tokens"] == 50
    assert continued_usage(worker, 0) == worker


# ----------------------------------------------------------------------------- live router


async def _alerts(bus: Bus) -> asyncio.Queue[Alert]:
    sig_stream, _ = await require_alert_streams(bus)
    q: asyncio.Queue[Alert] = asyncio.Queue()

    async def on(a: Alert, _raw) -> None:
        await q.put(a)

    await bus.consume(sig_stream, bus.subjects.alert_signals_all, "t_ops", Alert, on)
    return q


async def test_in_flight_success_does_not_close_an_open_circuit(
    nats_url, subjects, bus: Bus
) -> None:
    alerts = await _alerts(bus)
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=2,
        policy='{"name":"weighted","params":{"weights":{"session":1}}}',
        breaker_threshold=3,
        breaker_open_s=30.0,  # no half-open probe during the test
        max_retries=0,
    )
    r = router.router
    w0 = workers[0]
    try:
        async with aiohttp.ClientSession() as s:
            sid = ""
            for i in range(100):
                async with s.get(
                    router.url + "/debug/route",
                    json={"model": "m", "prompt": "x"},
                    headers={"x-session-id": f"s{i}"},
                ) as resp:
                    if (await resp.json())["worker"] == "w0":
                        sid = f"s{i}"
                        break
            assert sid
            # a stream goes to w0 and stays in flight
            w0.hold = asyncio.Event()
            w0.started.clear()
            in_flight = asyncio.create_task(
                post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "x", "stream": True, "max_tokens": 4},
                    {"x-session-id": sid},
                )
            )
            await asyncio.wait_for(w0.started.wait(), 10)
            # then w0 fails three requests: the circuit opens
            w0.mode = "500"
            for _ in range(3):
                st, _, _ = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "x"},
                    {} | {"x-session-id": sid},
                )
                assert st == 500
            assert r.breaker_state("w0") == "open"
            fired = await asyncio.wait_for(alerts.get(), 10)
            assert fired.kind == "circuit_open" and fired.state == "firing"
            assert fired.severity == "critical"  # out of service: critical (docs/api.md)
            # the stream sent before the circuit opened now finishes fine
            w0.mode = "ok"
            w0.hold.set()
            st, h, _ = await asyncio.wait_for(in_flight, 10)
            assert st == 200 and h["x-kvgate-worker"] == "w0"
            assert r.breaker_state("w0") == "open"  # was: closed within a few ms
            assert alerts.empty()
    finally:
        await _teardown(router, workers, beats)


async def test_breaker_resolved_alert_says_resolved(nats_url, subjects, bus: Bus) -> None:
    alerts = await _alerts(bus)
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=2,
        policy="round_robin",
        breaker_threshold=1,
        breaker_trial_requests=1,
        breaker_recovery_s=0.2,
        max_retries=0,
    )
    r = router.router
    try:
        async with aiohttp.ClientSession() as s:
            workers[0].mode = "500"
            workers[1].mode = "500"
            st, h, _ = await post(s, router.url + "/v1/completions", {"model": "m", "prompt": "x"})
            bad = h["x-kvgate-worker"]
            fired = await asyncio.wait_for(alerts.get(), 10)
            assert fired.state == "firing" and fired.worker_id == bad
            workers[0].mode = workers[1].mode = "ok"
            # half-open, a real request is the trial that closes it (round robin reaches it)
            await wait_until(lambda: r.breaker_state(bad) == "half_open", what="half-open")
            for _ in range(2):
                st, _, _ = await post(
                    s, router.url + "/v1/completions", {"model": "m", "prompt": "x"}
                )
                assert st == 200
            assert r.breaker_state(bad) == "closed"
            resolved = await asyncio.wait_for(alerts.get(), 10)
            assert resolved.state == "resolved" and "resolved" in resolved.summary
            assert resolved.summary != fired.summary
    finally:
        await _teardown(router, workers, beats)


async def test_slow_worker_is_ejected_with_an_alert_and_returns(
    nats_url, subjects, bus: Bus
) -> None:
    alerts = await _alerts(bus)
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=4,
        policy="round_robin",
        outlier_min_requests=3,
        outlier_eject_s=1.5,
        outlier_window_s=2.0,  # the incident ends 2 s after its return
    )
    r = router.router
    workers[0].delay_s = 0.3  # each answer ~ 0.3 s; the others answer in milliseconds
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hello", "max_tokens": 4}
            for _ in range(4):  # round robin: 4 requests per worker, concurrently
                res = await asyncio.gather(
                    *[post(s, router.url + "/v1/completions", body) for _ in range(4)]
                )
                assert all(st == 200 for st, _, _ in res)
            fired = await asyncio.wait_for(alerts.get(), 10)
            assert (fired.kind, fired.worker_id, fired.state) == ("latency_outlier", "w0", "firing")
            assert fired.severity == "warning" and "latency outlier" in fired.summary
            # ejected: new requests go elsewhere
            for _ in range(6):
                st, h, _ = await post(s, router.url + "/v1/completions", body)
                assert st == 200 and h["x-kvgate-worker"] != "w0"
            back = await asyncio.wait_for(alerts.get(), 10)
            assert (back.kind, back.state) == ("latency_outlier", "resolved")
            assert "resolved" in back.summary
            await wait_until(lambda: r.state.states["w0"].routable, what="w0 back in rotation")
    finally:
        await _teardown(router, workers, beats)


async def test_migrated_stream_reports_the_whole_answers_usage(
    nats_url, subjects, bus: Bus
) -> None:
    router, workers, beats = await _cluster(nats_url, subjects, bus, n=2, policy="round_robin")
    try:
        for w in workers:
            w.chunks, w.chunk_text = 6, "xy"
        workers[0].mode = "crash_mid"
        workers[0].crash_after = 2
        body = {
            "model": "m",
            "prompt": "tell me",
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kvgate-worker"] == "w0"
                raw = await resp.read()
        text, events = _sse_text(raw, chat=False)
        assert text == "xy" * 6
        usage = [e["usage"] for e in events if e.get("usage")]
        assert len(usage) == 1, json.dumps(events)
        # 7 prompt bytes; 4 tokens from w0 + 8 from w1 (which saw a prompt of 7 + 4)
        assert usage[0]["prompt_tokens"] == 7
        assert usage[0]["completion_tokens"] == 12
        assert usage[0]["total_tokens"] == 19
    finally:
        await _teardown(router, workers, beats)
