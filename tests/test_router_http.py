"""The router's HTTP/1.1 server (services/router/http_server.py) at the byte level: keep-alive,
pipelining, malformed requests, the body limit and API keys before the body, Expect:
100-continue, HTTP/1.0 clients, and a client leaving mid-stream. Real router, real NATS,
engines behind it; the client is a raw socket, so every byte on the wire is the test's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.common.bus import Bus
from tests.test_router_support import Beats, FakeWorker, RouterProc, wait_until

LIMIT = 16 * 1024
KEY = "sk-http-test-key"
AUTH = f"Authorization: Bearer {KEY}\r\n"


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One response: Content-Length, chunked, or until the connection closes."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for ln in lines[1:]:
        if ln:
            k, _, v = ln.partition(":")
            headers[k.strip().lower()] = v.strip()
    if status == 100:
        return Response(100, headers, b"")
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return Response(status, headers, body)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Does the server close the connection (EOF, nothing more sent)?"""
    return await asyncio.wait_for(reader.read(), 10) == b""


def completion(rid: str, *, version: str = "1.1", extra: str = AUTH, stream: bool = False) -> bytes:
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 6, "stream": stream})
    return (
        f"POST /v1/completions HTTP/{version}\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"x-request-id: {rid}\r\n{extra}Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


@pytest.fixture
async def router(nats_url, subjects, bus: Bus) -> AsyncIterator[RouterProc]:
    workers = [await FakeWorker("w0").start(bus)]
    beats = Beats(bus, workers).start()
    proc = await RouterProc(nats_url, subjects, max_body_bytes=LIMIT, api_keys=KEY).start()
    await proc.wait_workers(1)
    yield proc
    await proc.stop()
    await beats.stop()
    for w in workers:
        await w.stop()


async def connect(proc: RouterProc) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proc.port)


async def test_keep_alive_and_pipelined_requests_answered_in_order(router: RouterProc) -> None:
    reader, writer = await connect(router)
    # three requests in one write: answered in the order sent, on the same connection
    writer.write(
        completion("first") + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n" + completion("third")
    )
    first, health, third = [await read_response(reader) for _ in range(3)]
    assert (first.status, health.status, third.status) == (200, 200, 200)
    assert first.headers["x-request-id"] == "first" and third.headers["x-request-id"] == "third"
    assert first.json()["choices"][0]["text"] == "ab ab "
    assert health.json()["status"] == "ok"
    # the connection is kept for the next request
    writer.write(completion("fourth"))
    fourth = await read_response(reader)
    assert fourth.status == 200 and fourth.headers["x-request-id"] == "fourth"
    assert "connection" not in fourth.headers
    writer.close()


async def test_malformed_requests_get_400_and_the_connection_closes(router: RouterProc) -> None:
    for garbage in (
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad\r\n\r\n",
    ):
        reader, writer = await connect(router)
        writer.write(garbage)
        resp = await read_response(reader)
        assert resp.status == 400, garbage
        assert resp.headers["connection"] == "close"
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert await closed(reader)
        writer.close()
    # garbage after a good request: the good one is answered, then the connection closes
    reader, writer = await connect(router)
    writer.write(completion("good") + b"\x00\x01 nonsense\r\n\r\n")
    good = await read_response(reader)
    assert good.status == 200 and good.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_body_limit_and_api_key_answered_before_the_body(router: RouterProc) -> None:
    # the client announces a body and waits for 100-continue: refused without it being sent
    for extra, status in (
        (AUTH, 413),  # over the limit, from Content-Length
        ("Authorization: Bearer sk-wrong\r\n", 401),
    ):
        length = LIMIT + 1 if status == 413 else 100
        reader, writer = await connect(router)
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{extra}Expect: 100-continue\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        resp = await read_response(reader)
        assert resp.status == status, resp.body
        assert resp.json()["error"]["code"] == status
        assert resp.headers["connection"] == "close"  # the body never came: no reuse
        assert await closed(reader)
        writer.close()
    # a chunked body growing past the limit: 413 once it does, in OpenAI's shape
    reader, writer = await connect(router)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b"x" * 4096
    for _ in range(LIMIT // len(chunk) + 1):
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    resp = await read_response(reader)
    assert resp.status == 413 and str(LIMIT) in resp.json()["error"]["message"]
    writer.close()


async def test_chunked_body_and_expect_continue_are_read(router: RouterProc) -> None:
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 6}).encode()
    reader, writer = await connect(router)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n".encode()
        + b"%x\r\n%s\r\n" % (5, body[:5])
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 5, body[5:])
    )
    resp = await read_response(reader)
    assert resp.status == 200 and resp.json()["choices"][0]["text"] == "ab ab "
    # Expect: 100-continue: the router asks for the body, then answers
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{AUTH}Expect: 100-continue\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    assert (await read_response(reader)).status == 100
    writer.write(body)
    resp = await read_response(reader)
    assert resp.status == 200 and resp.json()["choices"][0]["text"] == "ab ab "
    writer.close()


async def test_http10_clients(router: RouterProc) -> None:
    # no keep-alive asked: answered with a length, then the connection closes
    reader, writer = await connect(router)
    writer.write(completion("old", version="1.0"))
    resp = await read_response(reader)
    assert resp.status == 200 and resp.json()["choices"][0]["text"] == "ab ab "
    assert await closed(reader)
    writer.close()
    # keep-alive asked: kept
    reader, writer = await connect(router)
    for rid in ("ka1", "ka2"):
        writer.write(completion(rid, version="1.0", extra=AUTH + "Connection: keep-alive\r\n"))
        resp = await read_response(reader)
        assert resp.status == 200 and resp.headers["x-request-id"] == rid
        assert resp.headers["connection"] == "keep-alive"
    writer.close()
    # a stream to an HTTP/1.0 client: no chunked encoding, the end is the connection's
    reader, writer = await connect(router)
    writer.write(completion("sse", version="1.0", stream=True))
    resp = await read_response(reader)
    assert resp.status == 200 and "transfer-encoding" not in resp.headers
    assert resp.body.count(b"data: ") == 3 and resp.body.endswith(b"data: [DONE]\n\n")
    writer.close()


async def test_head_and_unknown_routes(router: RouterProc) -> None:
    reader, writer = await connect(router)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: " in head
    writer.write(f"DELETE /v1/completions HTTP/1.1\r\nHost: r\r\n{AUTH}\r\n".encode())
    resp = await read_response(reader)  # nothing of HEAD's body came before this
    assert resp.status == 405 and resp.headers["allow"] == "POST"
    writer.write(f"GET /v1/nothing HTTP/1.1\r\nHost: r\r\n{AUTH}\r\n".encode())
    resp = await read_response(reader)
    assert resp.status == 404 and resp.json()["error"]["code"] == 404
    writer.close()


class TricklingWorker(FakeWorker):
    """Streams one chunk, then one more every 50 ms until its client (the router) leaves."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.router_left = asyncio.Event()

    async def _complete(self, r: web.Request) -> web.StreamResponse:
        await r.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
        try:
            while True:
                data = {**chunk, "choices": [{"index": 0, "text": "t", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")
                await asyncio.sleep(0.05)  # the engine's pace of tokens
        except (ConnectionResetError, RuntimeError):
            self.router_left.set()
        return resp


async def test_client_leaving_mid_stream_releases_the_worker(nats_url, subjects, bus: Bus) -> None:
    worker = await TricklingWorker("wt").start(bus)
    beats = Beats(bus, [worker]).start()
    proc = await RouterProc(nats_url, subjects).start()
    try:
        await proc.wait_workers(1)
        assert proc.router is not None
        state = proc.router.state.states["wt"]
        reader, writer = await connect(proc)
        writer.write(completion("gone", extra="", stream=True))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"data: " in await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
        assert state.inflight == 1
        writer.close()  # the client leaves mid-stream
        await asyncio.wait_for(worker.router_left.wait(), 10)  # the router left the engine
        await wait_until(lambda: state.inflight == 0, 10, "the worker's ticket released")
    finally:
        await proc.stop()
        await beats.stop()
        await worker.stop()


async def test_stop_lets_requests_in_progress_finish_then_cancels_the_rest(
    nats_url, subjects, bus: Bus
) -> None:
    hold = asyncio.Event()
    worker = await FakeWorker("wg", hold=hold).start(bus)
    beats = Beats(bus, [worker]).start()
    proc = await RouterProc(nats_url, subjects).start()  # shutdown_s=0.5
    try:
        await proc.wait_workers(1)
        assert proc.router is not None and proc._server is not None
        state = proc.router.state.states["wg"]
        reader, writer = await connect(proc)
        writer.write(completion("in-progress", extra=""))
        await asyncio.wait_for(worker.started.wait(), 10)
        stopping = asyncio.create_task(proc._server.stop())
        await wait_until(lambda: proc._server is not None and proc._server.stopping, 5, "stop")
        with pytest.raises(OSError):  # no new connections
            await connect(proc)
        hold.set()  # the worker answers within the grace period: the client gets it
        resp = await read_response(reader)
        assert resp.status == 200 and resp.headers["connection"] == "close"
        assert await closed(reader)
        await asyncio.wait_for(stopping, 5)
        writer.close()
        assert state.inflight == 0
    finally:
        await proc.stop()
        await beats.stop()
        await worker.stop()
    # a request that outlasts the grace period is cancelled: its ticket is released
    never = asyncio.Event()
    worker = await FakeWorker("wn", hold=never).start(bus)
    beats = Beats(bus, [worker]).start()
    proc = await RouterProc(nats_url, subjects).start()
    try:
        await proc.wait_workers(1)
        assert proc.router is not None and proc._server is not None
        state = proc.router.state.states["wn"]
        reader, writer = await connect(proc)
        writer.write(completion("too-slow", extra=""))
        await asyncio.wait_for(worker.started.wait(), 10)
        assert state.inflight == 1
        await asyncio.wait_for(proc._server.stop(), 5)
        assert await closed(reader)  # no answer: the connection closes
        assert state.inflight == 0
        writer.close()
    finally:
        never.set()
        await proc.stop()
        await beats.stop()
        await worker.stop()


async def test_half_closed_clients(router: RouterProc) -> None:
    # a complete request, then the client's write side closed: still answered, then close
    reader, writer = await connect(router)
    writer.write(completion("half"))
    writer.write_eof()
    resp = await read_response(reader)
    assert resp.status == 200 and resp.headers["x-request-id"] == "half"
    assert await closed(reader)
    writer.close()
    # a body cut short by the half-close: nothing is routed, the connection closes
    reader, writer = await connect(router)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{AUTH}Content-Length: 100\r\n\r\n"
        '{"model": "m",'.encode()
    )
    writer.write_eof()
    assert await closed(reader)
    writer.close()


async def test_health_says_the_index_is_not_ready_until_the_replica_synced(
    nats_url: str, subjects
) -> None:
    """No indexer answers on this subject prefix: the router's index replica never gets its
    snapshot, and /health must say so (it said index_ready: true for any replica)."""
    router = await RouterProc(nats_url, subjects).start()
    try:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/health") as resp:
            assert (await resp.json())["index_ready"] is False
    finally:
        await router.stop()
