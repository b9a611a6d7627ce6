"""What one client connection may cost the router (services/router/conn_limits.py, enforced by
services/router/http_server.py): head size, header count and URL length (431 / 414), header,
body and keep-alive timeouts (408 or a plain close), the connection cap (503 + Retry-After),
paths with dot segments (400), each counted in kvgate_router_http_rejected_total{reason};
the public /health without details; --passthrough-paths refusing paths with a second spelling.

Real router (in-process, real NATS), raw sockets: every byte on the wire is the test's. The
timeouts are configured short (0.5 s) and every wait is for the server's answer or its close,
bounded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import REGISTRY

from services.common.embedded import free_port
from services.router.openai_extras import passthrough_paths
from services.router.public_surface import start_operator_http
from tests.test_router_http import Response, closed, read_response
from tests.test_router_support import RouterProc, wait_until

SHORT_S = 0.5
KEY = "sk-limits-test-key"


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("kvgate_router_http_rejected_total", {"reason": reason}) or 0


def assert_error(resp: Response, status: int) -> dict:
    assert resp.status == status, resp.body
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


async def connect(proc: RouterProc) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proc.port, limit=1 << 20)


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes the connection (bounded wait)."""
    return await asyncio.wait_for(reader.read(), within)


@pytest.fixture
async def router(nats_url, subjects) -> AsyncIterator[RouterProc]:
    proc = await RouterProc(
        nats_url,
        subjects,
        header_timeout_s=SHORT_S,
        body_timeout_s=SHORT_S,
        keepalive_timeout_s=SHORT_S,
    ).start()
    yield proc
    await proc.stop()


def head(lines: list[str], path: str = "/health") -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: r\r\n" + "".join(lines) + "\r\n").encode()


async def test_head_size_and_header_count_limits(router: RouterProc) -> None:
    before = {r: rejected(r) for r in ("header_too_large", "too_many_headers", "url_too_long")}
    # a head of exactly 64 KiB (the default) is served; one byte more is refused
    base = len(head(["X-Pad: \r\n"]))
    for extra, status in ((0, 200), (1, 431)):
        reader, writer = await connect(router)
        writer.write(head([f"X-Pad: {'a' * (64 * 1024 - base + extra)}\r\n"]))
        resp = await read_response(reader)
        assert resp.status == status, resp.body
        if status == 431:
            assert "65536 bytes" in assert_error(resp, 431)["message"]
            assert resp.headers["connection"] == "close"
            assert await closed(reader)
        writer.close()
    # a 1 MB header (the case): 431, in OpenAI's shape, and the connection closes
    reader, writer = await connect(router)
    writer.write(head([f"X-Big: {'b' * 1_000_000}\r\n"]))
    assert_error(await read_response(reader), 431)
    assert await closed(reader)
    writer.close()
    # a head over the limit that arrives in many small writes: measured across them
    reader, writer = await connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\nX-Drip: ")
    for _ in range(100):  # 100 KiB; after the answer the router drops what still comes
        writer.write(b"d" * 1024)
        await writer.drain()
    assert_error(await read_response(reader), 431)
    writer.close()
    # 100 fields (Host included) are served, 101 are not; 200 x 8 KB (the issue's) neither
    for fields, status in ((99, 200), (100, 431)):
        reader, writer = await connect(router)
        writer.write(head([f"X-H{i}: v\r\n" for i in range(fields)]))
        resp = await read_response(reader)
        assert resp.status == status, (fields, resp.body)
        if status == 431:
            assert "100 header fields" in assert_error(resp, 431)["message"]
        writer.close()
    reader, writer = await connect(router)
    writer.write(head([f"X-H{i}: {'c' * 8192}\r\n" for i in range(200)]))
    assert_error(await read_response(reader), 431)
    writer.close()
    # a URL over 8 KiB: 414, whether the request line ends before the head limit or not
    for length in (9000, 100_000):
        reader, writer = await connect(router)
        writer.write(head([], path="/v1/models?q=" + "u" * length))
        assert_error(await read_response(reader), 414)
        assert await closed(reader)
        writer.close()
    # pipelined behind a good request: the good one is answered, then the connection closes
    reader, writer = await connect(router)
    writer.write(head([]) + head([f"X-H{i}: v\r\n" for i in range(150)]))
    good = await read_response(reader)
    assert good.status == 200 and good.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    assert rejected("header_too_large") - before["header_too_large"] >= 4
    assert rejected("too_many_headers") - before["too_many_headers"] >= 2
    assert rejected("url_too_long") - before["url_too_long"] == 2


async def test_slowloris_heads_get_408_and_silent_connections_are_closed(
    router: RouterProc,
) -> None:
    before = rejected("header_timeout")
    written = [0] * 5

    async def trickle(i: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n")
        while True:  # one header byte every 0.1 s, never the end of the head
            await asyncio.sleep(0.1)
            writer.write(b"x")
            written[i] += 1

    conns = [await connect(router) for _ in range(5)]
    trickles = [asyncio.create_task(trickle(i, w)) for i, (_, w) in enumerate(conns)]
    silent_reader, silent_writer = await connect(router)  # sends nothing at all
    try:
        # the clients go on sending after their 408: the answer must survive that (a close
        # with their bytes unread would reset the connection under it)
        await wait_until(lambda: rejected("header_timeout") - before == 6, 5, "six timeouts")
        mark = list(written)
        await wait_until(
            lambda: all(w >= m + 3 for w, m in zip(written, mark, strict=True)), 5, "more bytes"
        )
        responses = await asyncio.gather(*(read_response(reader) for reader, _ in conns))
        for t in trickles:
            t.cancel()
        for resp, (reader, _) in zip(responses, conns, strict=True):
            err = assert_error(resp, 408)
            assert "0.5 s" in err["message"] and resp.headers["connection"] == "close"
            assert await closed_by_server(reader, 5) == b""
        assert await closed_by_server(silent_reader, 5) == b""  # no request: no answer
    finally:
        for t in trickles:
            t.cancel()
        for _, w in conns:
            w.close()
        silent_writer.close()
    assert rejected("header_timeout") - before == 6
    assert router._server is not None
    await wait_until(lambda: not router._server.conns, 5, "the slow connections gone")


async def test_a_stalled_body_gets_408(router: RouterProc) -> None:
    before = rejected("body_timeout")
    reader, writer = await connect(router)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": "m",'
    )
    resp = await read_response(reader)
    assert "without data" in assert_error(resp, 408)["message"]
    assert resp.headers["connection"] == "close"
    assert await closed_by_server(reader, 5) == b""
    writer.close()
    assert rejected("body_timeout") - before == 1
    # a body that keeps arriving (slower than the whole timeout, faster than its gaps) is read
    reader, writer = await connect(router)
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    writer.write(
        f"POST /tokenize HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    for i in range(0, len(body), 4):
        writer.write(body[i : i + 4])
        await asyncio.sleep(0.1)  # the client's pace: 10 pieces over ~1 s, gaps of 0.1 s
    resp = await read_response(reader)
    assert resp.status == 200 and resp.json()["count"] == 2
    writer.close()


async def test_idle_keep_alive_connection_is_closed(router: RouterProc) -> None:
    reader, writer = await connect(router)
    writer.write(head([]))
    assert (await read_response(reader)).status == 200
    # nothing more sent: closed after the keep-alive timeout, with no answer
    assert await closed_by_server(reader, 5) == b""
    writer.close()


async def test_connection_cap_answers_503_with_retry_after(nats_url, subjects) -> None:
    proc = await RouterProc(nats_url, subjects, max_connections=3, retry_after=2).start()
    before = rejected("connection_limit")
    held = [await connect(proc) for _ in range(3)]
    try:
        assert proc._server is not None
        await wait_until(lambda: len(proc._server.conns) == 3, 5, "3 connections accepted")
        reader, writer = await connect(proc)
        writer.write(head([]))
        resp = await read_response(reader)
        assert "limit of 3 connections" in assert_error(resp, 503)["message"]
        assert resp.headers["retry-after"] == "2" and resp.headers["connection"] == "close"
        assert await closed_by_server(reader, 5) == b""
        writer.close()
        assert rejected("connection_limit") - before == 1
        # a held connection still works; one closed makes room for a new one
        reader, writer = held[0]
        writer.write(head([]))
        assert (await read_response(reader)).status == 200
        writer.close()
        await wait_until(lambda: len(proc._server.conns) == 2, 5, "a connection closed")
        reader, writer = await connect(proc)
        writer.write(head([]))
        assert (await read_response(reader)).status == 200
        writer.close()
    finally:
        for _, w in held[1:]:
            w.close()
        await proc.stop()


async def test_paths_with_dot_segments_are_refused(router: RouterProc) -> None:
    # an unknown model's card (below) is a 404 once the router knows the cluster, 503 before
    assert router.router is not None
    await wait_until(router.router.readiness.cluster_known, 10, "cluster known")
    before = rejected("bad_path")
    reader, writer = await connect(router)
    for path in (
        "/v1/../admin",
        "/v1/%2e%2e/admin",
        "/v1/%2E./admin",
        "/v1/./completions",
        "/v1/models/../../debug/state",
        "/v1%2f..%2fadmin",
        "/health%00",
    ):
        writer.write(head([], path=path))
        resp = await read_response(reader)
        assert "segments" in assert_error(resp, 400)["message"], path
        assert "connection" not in resp.headers  # a request's error: the connection is kept
    # dots inside a segment are a name, not a segment
    writer.write(head([], path="/v1/models/llama-3.1.gguf"))
    assert (await read_response(reader)).status == 404
    writer.close()
    assert rejected("bad_path") - before == 7


def test_passthrough_paths_refuse_a_second_spelling() -> None:
    assert passthrough_paths(" /v1/responses , /v1/rerank,/v2/x-y_z~1.0:a@b ") == [
        "/v1/responses",
        "/v1/rerank",
        "/v2/x-y_z~1.0:a@b",
    ]
    for bad, why in (
        ("/v1/../admin", "'..'"),
        ("v1/rerank", "absolute"),
        ("/v1/./rerank", "'.'"),
        ("/v1//rerank", "'//'"),
        ("/v1/%72erank", "percent"),
        ("/v1/rerank?x=1", "query"),
        ("/v1/rerank#top", "fragment"),
        ("/v1/re\x00rank", "control"),
        ("/v1/re rank", "space"),
        ("/v1\\..\\admin", "backslash"),
        ("/v1/rérank", "non-ASCII"),
        ("/v1/<x>", "not allowed"),
    ):
        with pytest.raises(ValueError, match=why):
            passthrough_paths(f"/v1/ok,{bad}")


def test_router_refuses_to_start_with_a_bad_passthrough_path() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "router", "--nats-url", "nats://127.0.0.1:1"]
        + ["--port", str(free_port()), "--passthrough-paths", "/v1/rerank,/v1/../admin"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "invalid --passthrough-paths" in done.stderr and "'..' segment" in done.stderr


async def test_public_health_says_only_its_status(nats_url, subjects) -> None:
    proc = await RouterProc(nats_url, subjects, api_keys=KEY, operator_port=free_port()).start()
    assert proc.router is not None
    operator = await start_operator_http(proc.router.st, proc.router.operator_routes())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(proc.url + "/health") as r:  # a load balancer: no key
                assert r.status == 200 and await r.json() == {"status": "ok"}
            async with s.head(proc.url + "/health") as r:
                assert r.status == 200
            bad = {"Authorization": "Bearer sk-wrong"}
            async with s.get(proc.url + "/health", headers=bad) as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}
            good = {"Authorization": f"Bearer {KEY}"}
            async with s.get(proc.url + "/health", headers=good) as r:
                assert (await r.json())["router_id"] == proc.router.router_id
            port = proc.router.st.operator_port
            async with s.get(f"http://127.0.0.1:{port}/health") as r:  # the operator's view
                full = await r.json()
                assert full["router_id"] == proc.router.router_id and "peer_routers" in full
    finally:
        assert operator is not None
        await operator.stop()
        await proc.stop()
    # no client keys at all: the public port still says nothing more
    proc = await RouterProc(nats_url, subjects, operator_port=free_port()).start()
    try:
        async with aiohttp.ClientSession() as s, s.get(proc.url + "/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
    finally:
        await proc.stop()


def test_bad_limits_stop_the_router_naming_the_flag() -> None:
    from services.router.cli import settings
    from services.router.conn_limits import ConnLimits

    for name, value, flag in (
        ("header_timeout_s", 0.0, "--header-timeout-s"),
        ("max_header_bytes", 0, "--max-header-bytes"),
        ("max_connections", -1, "--max-connections"),
    ):
        with pytest.raises(SystemExit, match=flag):
            ConnLimits.from_settings(settings(**{name: value}))
    auto = ConnLimits.from_settings(settings())
    assert 1 <= auto.max_connections <= 10_000 and auto.max_header_bytes == 64 * 1024
