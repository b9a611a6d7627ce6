"""Failures: retry on 503 / connect failure / hang, migration mid-stream, circuit breaker with
half-open trial requests and alerts on the real bus, cordon / drain from workers.control."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from services.common.bus import Bus
from services.common.schemas import Alert, RouterOutcome, WorkerControl
from services.common.streams import require_alert_streams, require_outcomes_stream
from services.router import metrics as M
from tests.test_router_support import Beats, FakeWorker, RouterProc, post, shutdown, wait_until


async def _cluster(nats_url, subjects, bus, n=2, **router_kw):
    workers = [await FakeWorker(f"w{i}").start(bus) for i in range(n)]
    beats = Beats(bus, workers).start()
    router = await RouterProc(nats_url, subjects, **router_kw).start()
    await router.wait_workers(n)
    return router, workers, beats


async def _teardown(router, workers, beats):
    await shutdown(
        ("router", router.stop()),
        ("beats", beats.stop()),
        *[(w.worker_id, w.stop()) for w in workers],
        each_s=5,
    )


def _sse_text(raw: bytes, chat: bool) -> tuple[str, list[dict]]:
    events = []
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if not block.startswith(b"data:") or block == b"data: [DONE]":
            continue
        events.append(json.loads(block[5:]))
    key = (
        (lambda c: (c.get("delta") or {}).get("content") or "")
        if chat
        else (lambda c: c.get("text", ""))
    )
    return "".join(key(c) for e in events for c in e.get("choices", [])), events


async def test_503_and_connect_failure_retry_elsewhere(nats_url, subjects, bus: Bus) -> None:
    router, workers, beats = await _cluster(nats_url, subjects, bus, n=3, policy="round_robin")
    try:
        workers[0].mode = "503"
        await workers[1].stop()  # heartbeats still claim it is up: connect refused
        retries0 = M.RETRIES.value
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                st, h, body = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": f"p{i}", "max_tokens": 2},
                )
                assert st == 200, body
                assert h["x-kvgate-worker"] == "w2"
        assert M.RETRIES.value > retries0
    finally:
        await _teardown(router, workers, beats)


async def test_breaker_opens_alerts_probes_and_closes(nats_url, subjects, bus: Bus) -> None:
    sig_stream, _ = await require_alert_streams(bus)
    alerts: asyncio.Queue[Alert] = asyncio.Queue()

    async def on_alert(a: Alert, _raw) -> None:
        await alerts.put(a)

    await bus.consume(sig_stream, bus.subjects.alert_signals_all, "t_sig", Alert, on_alert)
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=2,
        policy='{"name":"weighted","params":{"weights":{"session":1}}}',
        breaker_threshold=3,
        breaker_recovery_s=0.3,
        max_retries=0,
    )
    r = router.router
    try:
        async with aiohttp.ClientSession() as s:
            # a session whose home worker is w0 (rendezvous hash): find one
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
            # client errors never count against the breaker
            workers[0].mode = "400"
            for _ in range(5):
                st, _, _ = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "x"},
                    {"x-session-id": sid},
                )
                assert st == 400
            assert r.breaker_state("w0") == "closed"
            workers[0].mode = "500"
            for _ in range(3):
                st, h, _ = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "x"},
                    {"x-session-id": sid},
                )
                assert st == 500 and h["x-kvgate-worker"] == "w0"
            assert r.breaker_state("w0") in ("open", "half_open")
            fired = await asyncio.wait_for(alerts.get(), 10)
            assert (
                fired.kind == "circuit_open" and fired.worker_id == "w0" and fired.state == "firing"
            )
            assert fired.severity == "critical" and fired.fingerprint == "circuit_open:w0"
            # open: the session's requests go to w1 now
            st, h, _ = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "x"},
                {"x-session-id": sid},
            )
            assert st == 200 and h["x-kvgate-worker"] == "w1"
            # still failing: half-open, the session's next request is a trial on w0; it
            # fails and the circuit re-opens for longer (no new alert)
            await wait_until(lambda: r.breaker_state("w0") == "half_open", what="half-open")
            st, h, _ = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "x"},
                {"x-session-id": sid},
            )
            assert st == 500 and h["x-kvgate-worker"] == "w0"
            assert r.breaker_state("w0") == "open" and r.breakers["w0"].wait_s == 0.6
            workers[0].mode = "ok"
            # recovered: three trials succeed and close it; closed 0.3 s ends the incident
            await wait_until(lambda: r.breaker_state("w0") == "half_open", what="half-open")
            for _ in range(3):
                st, h, _ = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "x"},
                    {"x-session-id": sid},
                )
                assert st == 200 and h["x-kvgate-worker"] == "w0"
            assert r.breaker_state("w0") == "closed"
            assert alerts.empty()  # re-opening and closing inside the incident: no alert
            resolved = await asyncio.wait_for(alerts.get(), 10)
            assert resolved.state == "resolved" and resolved.fingerprint == "circuit_open:w0"
            st, h, _ = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "x"},
                {"x-session-id": sid},
            )
            assert h["x-kvgate-worker"] == "w0"
    finally:
        await _teardown(router, workers, beats)


@pytest.mark.parametrize("chat", [True, False])
async def test_stream_migrates_when_worker_dies_mid_stream(
    nats_url, subjects, bus: Bus, chat: bool
) -> None:
    router, workers, beats = await _cluster(nats_url, subjects, bus, n=2, policy="round_robin")
    stream = await require_outcomes_stream(bus)
    outs: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on(o: RouterOutcome, _raw) -> None:
        await outs.put(o)

    await bus.consume(
        stream, bus.subjects.router_outcomes, "t_mig", RouterOutcome, on, deliver_new=True
    )
    try:
        for w in workers:
            w.chunks, w.chunk_text = 6, "xy"
        workers[0].mode = "crash_mid"
        workers[0].crash_after = 2
        migrations0 = M.MIGRATIONS.labels("completed").value
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": "m", "max_tokens": 12, "stream": True}
        body.update(
            {"messages": [{"role": "user", "content": "tell me"}]}
            if chat
            else {"prompt": "tell me"}
        )
        async with aiohttp.ClientSession() as s:
            # round robin starts at w0 (the crashing one)
            async with s.post(
                router.url + path, json=body, headers={"x-request-id": "mig-1"}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-worker"] == "w0"
                raw = await resp.read()
        text, events = _sse_text(raw, chat)
        # 2 chunks from w0, then the rest (12 - 4 tokens = 4 chunks of 2) from w1
        assert text == "xy" * 6
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert len({e["id"] for e in events}) == 1 if chat else True
        cont = workers[1].served[-1]
        assert cont["path"] == "/v1/completions"
        assert cont["body"]["prompt"].endswith("xyxy") and cont["body"]["max_tokens"] == 8
        assert M.MIGRATIONS.labels("completed").value == migrations0 + 1
        o = await asyncio.wait_for(outs.get(), 10)
        assert (
            o.request_id == "mig-1" and o.migrated == 1 and o.status == "ok" and o.worker_id == "w1"
        )
    finally:
        await _teardown(router, workers, beats)


async def test_hanging_worker_times_out_and_retries(nats_url, subjects, bus: Bus) -> None:
    router, workers, beats = await _cluster(
        nats_url,
        subjects,
        bus,
        n=2,
        policy="round_robin",
        request_timeout=0.5,
        stream_idle_timeout=0.5,
    )
    try:
        workers[0].mode = "hang"
        async with aiohttp.ClientSession() as s:
            st, h, _ = await post(
                s, router.url + "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2}
            )
            assert st == 200 and h["x-kvgate-worker"] == "w1"
            workers[1].mode = "hang"
            t0 = M.TIMEOUTS.value
            st, _, body = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "b", "max_tokens": 2, "stream": True},
            )
            assert st == 504, body
            assert M.TIMEOUTS.value == t0 + 1
    finally:
        await _teardown(router, workers, beats)


async def test_cordon_drain_uncordon(nats_url, subjects, bus: Bus) -> None:
    router, workers, beats = await _cluster(nats_url, subjects, bus, n=2, policy="round_robin")
    r = router.router
    try:

        async def control(wid: str, action: str) -> None:
            await bus.publish(
                bus.subjects.worker_control(wid),
                WorkerControl(worker_id=wid, action=action, by="test"),
            )

        await control("w0", "cordon")
        await wait_until(lambda: r.state.states["w0"].cordoned, what="cordon applied")
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                _, h, _ = await post(
                    s, router.url + "/v1/completions", {"model": "m", "prompt": f"{i}"}
                )
                assert h["x-kvgate-worker"] == "w1"
            await control("w0", "uncordon")
            await control("w1", "drain")
            await wait_until(
                lambda: r.state.states["w1"].draining and not r.state.states["w0"].cordoned
            )
            for i in range(4):
                _, h, _ = await post(
                    s, router.url + "/v1/completions", {"model": "m", "prompt": f"{i}"}
                )
                assert h["x-kvgate-worker"] == "w0"
            async with s.get(router.url + "/health") as resp:
                assert (await resp.json())["workers"] == 1
    finally:
        await _teardown(router, workers, beats)


async def test_replica_cancelled_by_router_stop_is_counted_cancelled(
    nats_url, subjects, bus: Bus
) -> None:
    """A hot-prefix copy still in flight when the router stops (its task cancelled) is
    ``kvgate_router_replicas_total{outcome="cancelled"}``, not ``ok``."""
    from services.core.policy import Decision

    router, workers, beats = await _cluster(nats_url, subjects, bus, n=2)
    try:
        workers[1].mode = "hang"  # the copy's worker never answers
        r = router.router
        ctx = await r.path.intake(
            b'{"model": "m", "prompt": "a hot prefix", "max_tokens": 4}',
            {},
            "/v1/completions",
            False,
            0.0,
        )
        assert hasattr(ctx, "request_id"), ctx  # a Ctx, not a 400
        ok0, cancelled0 = M.REPLICAS.labels("ok").value, M.REPLICAS.labels("cancelled").value
        before = set(r.spawner._tasks)
        ticket = r.dispatcher.dispatch(ctx, Decision("w0", replicate_to=("w1",)))
        copies = set(r.spawner._tasks) - before
        assert len(copies) == 1
        await asyncio.wait_for(workers[1].started.wait(), 10)  # the copy reached its worker
        (copy,) = copies
        copy.cancel()  # what stopping the router does to the tasks it leaves
        with pytest.raises(asyncio.CancelledError):
            await copy
        r.dispatcher.release(ctx, ticket)
        assert M.REPLICAS.labels("cancelled").value == cancelled0 + 1
        assert M.REPLICAS.labels("ok").value == ok0
        assert r.state.states["w1"].inflight == 0  # the copy's claim was released
    finally:
        await _teardown(router, workers, beats)
