"""The router's lifecycle with real processes: a ``kvgate router`` subprocess, real NATS, the
real indexer, simulated workers (``kvgate sim-worker`` subprocesses streaming slowly) or a
fake engine whose heartbeats the test times.

- SIGTERM under load: streams in progress finish with ``[DONE]`` (they outlast the 5 s the
  router used to give them), ``/ready`` answers 503 at once, no new connection is accepted,
  a kept-alive connection's next request is answered with ``Connection: close``, and the
  router exits by itself; past ``--drain-timeout-s`` what is left is cut and it exits.
- A router restarted after SIGKILL answers, from the moment its port opens, 503 with
  Retry-After (in OpenAI's error shape) or a completion, never 404 "model not served", and
  ``/ready`` turns 200 one heartbeat interval after it hears the workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from services.common.bus import Bus
from services.common.embedded import free_port
from tests.test_router_support import Beats, FakeWorker, Indexer, post

MODEL = "sim-llama-8b"
STREAM_TOKENS = 80  # x 0.1 s steps: an 8 s stream, longer than the old 5 s stop grace


def _env() -> dict[str, str]:
    return {**os.environ, "NO_PROXY": "127.0.0.1"}


def _common(nats_url: str, prefix: str) -> list[str]:
    return ["--nats-url", nats_url, "--subject-prefix", prefix, "--log-level", "info"]


def start_router(
    nats_url: str, prefix: str, port: int, operator: int, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "services.cli", "router", "--port", str(port)]
    argv += ["--operator-port", str(operator), *_common(nats_url, prefix), *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def start_sims(nats_url: str, prefix: str, log: Path, count: int = 2) -> subprocess.Popen[bytes]:
    """Simulated workers whose every step takes 0.1 s: one token per 0.1 s per stream."""
    argv = [sys.executable, "-m", "services.cli", "sim-worker", "--count", str(count)]
    argv += ["--port", str(free_port()), "--step-overhead-s", "0.1"]
    argv += ["--heartbeat-interval", "0.5", *_common(nats_url, prefix)]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=_env(), stdout=out, stderr=subprocess.STDOUT)


async def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    await asyncio.to_thread(proc.wait, 20)


async def get_json(s: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.json(content_type=None)


async def poll(what: str, check, timeout: float = 20.0) -> Any:
    """Another process's state has no event this test can await: ask until it says so."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = await check()
        except (aiohttp.ClientError, OSError, TimeoutError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


async def workers_seen(s: aiohttp.ClientSession, operator: int, n: int) -> bool:
    _, h = await get_json(s, f"http://127.0.0.1:{operator}/health")
    return h.get("workers", 0) >= n


async def refused(port: int) -> bool:
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    w.close()
    return False


async def raw_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: dict[str, Any]
) -> tuple[int, dict[str, str], bytes]:
    """One keep-alive request on an open connection; the whole (Content-Length) answer."""
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    payload = await reader.readexactly(int(headers["content-length"]))
    return status, headers, payload


async def test_sigterm_drains_streams_refuses_new_connections_and_exits(
    nats_url: str, subjects, bus: Bus, tmp_path: Path
) -> None:
    prefix = subjects.prefix.rstrip(".")
    indexer = await Indexer(nats_url, subjects).start()
    sims = start_sims(nats_url, prefix, tmp_path / "sim.log")
    port, operator = free_port(), free_port()
    router = start_router(nats_url, prefix, port, operator, tmp_path / "router.log")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            await poll("router sees both workers", lambda: workers_seen(s, operator, 2))

            async def started() -> (
                dict[str, Any] | None
            ):  # ready (asserted below, after the streams)
                st, body = await get_json(s, f"http://127.0.0.1:{operator}/ready")
                return None if st == 503 else body

            ready = await poll("router no longer starting", started)
            # a kept-alive client connection, idle when the signal comes
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            st, h, _ = await raw_request(
                reader, writer, {"model": MODEL, "prompt": "k", "max_tokens": 1}
            )
            assert st == 200 and h.get("connection", "") != "close"

            n = 12
            first = [asyncio.Event() for _ in range(n)]

            async def stream(i: int) -> tuple[int, list[bytes]]:
                lines: list[bytes] = []
                body = {
                    "model": MODEL,
                    "prompt": f"stream {i} " * 4,
                    "max_tokens": STREAM_TOKENS,
                    "stream": True,
                }
                timeout = aiohttp.ClientTimeout(total=60)
                async with aiohttp.ClientSession() as own:  # a connection of its own
                    async with own.post(f"{base}/v1/completions", json=body, timeout=timeout) as r:
                        try:
                            async for line in r.content:
                                if line.strip():
                                    lines.append(line.strip())
                                    first[i].set()
                        except aiohttp.ClientPayloadError:
                            pass  # cut: asserted below
                        return r.status, lines

            streams = [asyncio.create_task(stream(i)) for i in range(n)]
            for e in first:
                await asyncio.wait_for(e.wait(), 30)
            signalled = time.monotonic()
            router.send_signal(signal.SIGTERM)

            # not ready at once (the operator port stays up while the router drains)
            async def not_ready() -> tuple[int, dict[str, Any]] | None:
                st, body = await get_json(s, f"http://127.0.0.1:{operator}/ready")
                return None if st == 200 else (st, body)

            drain_ready = await poll("/ready not 200", not_ready, timeout=5)
            await poll("no new connection accepted", lambda: refused(port), timeout=5)
            # the kept-alive connection is answered, and told to close
            try:
                kept: Any = await raw_request(
                    reader, writer, {"model": MODEL, "prompt": "k", "max_tokens": 1}
                )
                kept_closed = await asyncio.wait_for(reader.read(), 10) == b""
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                kept, kept_closed = exc, True
            writer.close()

            results = await asyncio.gather(*streams)
            ended = time.monotonic() - signalled
            for status, lines in results:
                assert status == 200
                assert lines[-1] == b"data: [DONE]", lines[-3:]
                tokens = sum(
                    len(json.loads(x[6:])["choices"][0]["text"])
                    for x in lines[:-1]
                    if json.loads(x[6:]).get("choices")
                )
                assert tokens > 0
            assert ended > 5.0  # they outlasted the old stop grace
            assert ready.get("status") == "ready"  # before the signal
            assert drain_ready[0] == 503 and drain_ready[1]["status"] == "draining"
            assert isinstance(kept, tuple), kept
            assert kept[0] == 200 and kept[1]["connection"] == "close" and kept_closed
        code = await asyncio.to_thread(router.wait, 30)
        assert code == 0
        log = (tmp_path / "router.log").read_text()
        assert '"router drained"' in log and '"cut": 0' in log
    finally:
        await stop_process(router)
        await stop_process(sims)
        await indexer.stop()


async def _status(s: aiohttp.ClientSession, base: str, want: int) -> bool:
    st, _ = await get_json(s, f"{base}/ready")
    return st == want


async def test_drain_timeout_cuts_what_outlasts_it(
    nats_url: str, subjects, bus: Bus, tmp_path: Path
) -> None:
    prefix = subjects.prefix.rstrip(".")
    indexer = await Indexer(nats_url, subjects).start()
    sims = start_sims(nats_url, prefix, tmp_path / "sim.log", count=1)
    port, operator = free_port(), free_port()
    log = tmp_path / "router.log"
    router = start_router(nats_url, prefix, port, operator, log, "--drain-timeout-s", "1")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            await poll("router sees the worker", lambda: workers_seen(s, operator, 1))
            got_first = asyncio.Event()

            async def stream() -> list[bytes]:
                lines: list[bytes] = []
                body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "stream": True}
                try:
                    async with s.post(f"{base}/v1/completions", json=body) as r:
                        async for line in r.content:
                            if line.strip():
                                lines.append(line.strip())
                                got_first.set()
                except aiohttp.ClientPayloadError:
                    pass  # cut: the chunked answer never ended
                return lines

            task = asyncio.create_task(stream())
            await asyncio.wait_for(got_first.wait(), 30)
            signalled = time.monotonic()
            router.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(router.wait, 20)
            took = time.monotonic() - signalled
            lines = await asyncio.wait_for(task, 10)
        assert code == 0
        assert took < 8, took  # 1 s of drain, then closing (the stream wanted 20 s)
        assert lines and lines[-1] != b"data: [DONE]"
        text = log.read_text()
        assert '"router drained"' in text and '"cut": 1' in text
    finally:
        await stop_process(router)
        await stop_process(sims)
        await indexer.stop()


def _assert_openai_503(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 503, (status, body)
    assert int(headers["Retry-After"]) >= 1
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "code", "param"} and err["code"] == 503
    assert "not served" not in err["message"]


async def test_restarted_router_answers_503_never_404_until_it_knows_the_cluster(
    nats_url: str, subjects, bus: Bus, tmp_path: Path
) -> None:
    """SIGKILL and restart: the new router's port opens before the worker's next heartbeat
    (held back here for as long as the test needs: a worker heartbeats every second, and a
    router starts in a fraction of that). ``--worker-timeout 30``: only hearing the worker
    (one heartbeat interval) can make the router ready within this test."""
    prefix = subjects.prefix.rstrip(".")
    indexer = await Indexer(nats_url, subjects).start()
    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    port = free_port()
    first = start_router(nats_url, prefix, port, free_port(), tmp_path / "r1.log")
    second: subprocess.Popen[bytes] | None = None
    base = f"http://127.0.0.1:{port}"
    completion = {"model": "m", "prompt": "hello", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as s:

            async def served() -> bool:
                st, _h, _b = await post(s, f"{base}/v1/completions", completion)
                return st == 200

            await poll("first router serves", served)
            first.kill()
            await asyncio.to_thread(first.wait, 10)
            beats.paused.add("w0")
            second = start_router(
                nats_url,
                prefix,
                port,
                free_port(),
                tmp_path / "r2.log",
                "--worker-timeout",
                "30",
            )

            async def opened() -> bool:
                return not await refused(port)

            await poll("restarted router listens", opened, timeout=30)
            # right after the port opens: a burst, the model list, /ready
            answers = await asyncio.gather(
                *(
                    post(s, f"{base}/v1/completions", {**completion, "stream": i % 2 == 0})
                    for i in range(20)
                )
            )
            for st, h, b in answers:
                _assert_openai_503(st, h, b)
            async with s.get(f"{base}/v1/models") as r:
                _assert_openai_503(r.status, dict(r.headers), await r.read())
            async with s.get(f"{base}/v1/models/m") as r:
                _assert_openai_503(r.status, dict(r.headers), await r.read())
            st, body = await get_json(s, f"{base}/ready")
            assert st == 503 and body["status"] == "starting" and not body["cluster_known"]

            beats.paused.discard("w0")  # the worker's next heartbeat
            statuses: list[int] = []

            async def answered() -> bool:
                st, h, b = await post(s, f"{base}/v1/completions", completion)
                statuses.append(st)
                if st != 200:
                    _assert_openai_503(st, h, b)
                return st == 200

            await poll("restarted router serves", answered, timeout=15)
            assert 404 not in statuses
            began = time.monotonic()
            await poll("restarted router ready", lambda: _status(s, base, 200), timeout=10)
            assert time.monotonic() - began < 5  # a heartbeat interval, not --worker-timeout
            # known now: a model nobody serves is a 404 again
            st, _h, b = await post(s, f"{base}/v1/completions", {**completion, "model": "nope"})
            assert st == 404 and "not served" in json.loads(b)["error"]["message"]
    finally:
        await stop_process(first)
        if second is not None:
            await stop_process(second)
        await beats.stop()
        await w.stop()
        await indexer.stop()


class _Clock:
    """Time the test sets (the rule under test is about intervals, not about waiting)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Replica:
    def __init__(self) -> None:
        self.ready = asyncio.Event()


def test_cluster_known_after_one_heartbeat_interval_or_the_worker_timeout() -> None:
    from services.router.readiness import Readiness

    clock, replica = _Clock(), _Replica()
    r = Readiness(3.0, replica, clock=clock)
    r.heartbeats_subscribed()
    r.index_started = True
    r.heard("a")
    clock.now += 0.01
    r.heard("a")  # a duplicate, not an interval
    clock.now += 0.4
    r.heard("b")
    assert not r.cluster_known() and r.ready()[1]["status"] == "starting"
    clock.now += 0.59
    r.heard("a")  # a's interval (1 s) has passed since it was first heard
    assert not r.cluster_known()  # the jitter margin: a quarter of it
    clock.now += 0.25
    assert r.cluster_known()
    ok, body = r.ready()
    assert ok and body == {
        "status": "ready",
        "cluster_known": True,
        "index": "catching_up",  # no snapshot: the replica's first attempt found no indexer
        "draining": False,
    }
    replica.ready.set()
    assert r.ready()[1]["index"] == "ready"
    r.start_draining()
    assert r.ready() == (
        False,
        {"status": "draining", "cluster_known": True, "index": "ready", "draining": True},
    )
    # no worker heard twice: known after --worker-timeout
    quiet = Readiness(3.0, _Replica(), clock=clock)
    quiet.heartbeats_subscribed()
    quiet.heard("a")
    clock.now += 2.9
    assert not quiet.cluster_known() and quiet.starting_refusal()
    clock.now += 0.1
    assert quiet.cluster_known() and not quiet.starting_refusal()
    assert not quiet.ready()[0]  # index replica still syncing
