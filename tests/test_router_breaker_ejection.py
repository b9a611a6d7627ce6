"""Latency outlier ejection holds like the breaker (issue 36, "nothing flaps"): the n-th
ejection of an incident lasts n x ``eject_s`` (capped, as Envoy's outlier ejection), and the
``latency_outlier`` alert fires once per incident and resolves once, after the worker was back
a whole window without a new ejection. Pure detector tests, and the real router on the real
NATS with a slow fake worker (an HTTP engine endpoint) among fast ones.
"""

from __future__ import annotations

import asyncio

import aiohttp

from services.common.bus import Bus
from services.router import metrics as M
from services.router.outlier import OutlierConfig, OutlierDetector
from tests.test_router_breaker import RouterAlerts
from tests.test_router_failures import _cluster, _teardown
from tests.test_router_support import post

CFG = OutlierConfig(ratio=3.0, window_s=30.0, eject_s=10.0, min_requests=5, max_eject_s=25.0)
SLOW = {"w0": 0.05, "w1": 0.01, "w2": 0.011, "w3": 0.009}


def _feed(d: OutlierDetector, lat: dict[str, float], now: float, n: int = 6) -> None:
    for i in range(n):
        for wid, s_per_token in lat.items():
            d.record(wid, now - n + i, s_per_token * 10, 10)


def test_each_ejection_of_an_incident_lasts_longer_up_to_the_cap() -> None:
    d = OutlierDetector(CFG)
    now, lengths = 100.0, []
    for _ in range(4):
        _feed(d, SLOW, now)
        (ch,) = [c for c in d.evaluate(now) if c.ejected]
        lengths.append((ch.count, ch.until - now))
        now = ch.until
        back = d.evaluate(now)
        assert [(c.worker_id, c.ejected, c.recovered) for c in back] == [("w0", False, False)]
        now += 1.0
    assert lengths == [(1, 10.0), (2, 20.0), (3, 25.0), (4, 25.0)]


def test_incident_ends_after_a_whole_window_back_without_a_new_ejection() -> None:
    d = OutlierDetector(CFG)
    _feed(d, SLOW, 100.0)
    assert [c.count for c in d.evaluate(100.0)] == [1]
    assert [c.recovered for c in d.evaluate(110.0)] == [False]  # back in rotation
    assert d.evaluate(139.9) == []  # still the same incident
    (over,) = d.evaluate(140.0)
    assert (over.worker_id, over.ejected, over.recovered) == ("w0", False, True)
    _feed(d, SLOW, 150.0)
    (again,) = d.evaluate(150.0)
    assert again.count == 1 and again.until == 160.0  # a new incident starts from eject_s


async def test_a_steadily_slow_worker_is_re_ejected_for_longer_under_one_alert(
    nats_url, subjects, bus: Bus
) -> None:
    alerts = await RouterAlerts("latency_outlier").start(bus)
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=4,
        policy="round_robin",
        outlier_min_requests=3,
        outlier_eject_s=0.5,
        outlier_window_s=3.0,
    )
    workers[0].delay_s = 0.3  # each answer ~0.3 s; the others answer in milliseconds
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as s:

            async def client(i: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    body = {"model": "m", "prompt": f"c{i} r{n}", "max_tokens": 4}
                    st, _, _ = await post(s, router.url + "/v1/completions", body)
                    assert st == 200

            ejections0 = M.OUTLIER_EJECTIONS.labels("w0").value
            load = [asyncio.create_task(client(i)) for i in range(4)]
            fired = await asyncio.wait_for(alerts.queue.get(), 10)
            assert (fired.worker_id, fired.state) == ("w0", "firing")
            await asyncio.sleep(6.0)  # the measurement window, not a synchronisation
            ejections = M.OUTLIER_EJECTIONS.labels("w0").value - ejections0
            # still slow after each return: ejected again, for longer, without new alerts
            # (was: a firing and a resolved alert per ejection)
            assert ejections >= 2, ejections
            assert [a.state for a in alerts.seen] == ["firing"]
            stop.set()
            await asyncio.gather(*load)
            # no more traffic: back a whole window without an ejection ends the incident
            resolved = await asyncio.wait_for(alerts.queue.get(), 20)
            assert (resolved.worker_id, resolved.state) == ("w0", "resolved")
            assert [a.state for a in alerts.seen] == ["firing", "resolved"]
    finally:
        stop.set()
        await _teardown(router, workers, beats)
