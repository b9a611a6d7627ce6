"""The scraper's minimal HTTP/1.1 client against a raw socket server sending crafted answers:
Content-Length, chunked, read-to-close, keep-alive reuse, size cap, garbage, timeouts; the
polled path (send at one tick, non-blocking read later) and the pure response parser."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from services.telemetry.httpget import Conn, HttpError, Response, request_bytes

BODY = b"vllm:num_requests_running 3\n" * 50


@asynccontextmanager
async def raw_server(
    answer: Callable[[int], bytes | list[bytes] | None],
) -> AsyncIterator[tuple[str, list]]:
    """Answers request n (per server) with ``answer(n)`` bytes (a list: written in separate
    pieces); None: say nothing; a trailing b"<close>" closes the connection after writing."""
    conns: list[int] = []
    count = {"n": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /metrics")
                count["n"] += 1
                out = answer(count["n"])
                if out is None:
                    await asyncio.Event().wait()  # hang (the client must time out)
                pieces = out if isinstance(out, list) else [out]
                close = pieces[-1].endswith(b"<close>")
                for i, piece in enumerate(pieces):
                    if i:
                        await asyncio.sleep(0.02)  # pacing: make the client see separate reads
                    writer.write(piece.removesuffix(b"<close>"))
                    await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics", conns
    finally:
        server.close()


def ok(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


class Client:
    """What the agent does for one target: a kept-alive :class:`Conn`, opened when needed."""

    def __init__(self, url: str, max_body: int = 8 << 20) -> None:
        (self.host, self.port), self.req = request_bytes(url)
        self.max_body = max_body
        self.conn: Conn | None = None
        self.opened = 0

    async def get(self, timeout: float = 2.0) -> tuple[int, bytes]:
        if self.conn is None or self.conn.closed:
            self.conn = await Conn.open(self.host, self.port, timeout, self.max_body)
            self.opened += 1
        self.conn.send(self.req)
        return await self.conn.wait(timeout)


async def readable(conn: Conn) -> None:
    """Until the socket has something to read (an event, not a sleep)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.add_reader(conn.fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, 5)
    finally:
        loop.remove_reader(conn.fd)


async def test_content_length_and_keep_alive_reuse() -> None:
    async with raw_server(lambda n: ok(BODY + str(n).encode())) as (url, conns):
        c = Client(url)
        for n in (1, 2, 3):
            status, body = await c.get()
            assert status == 200 and body == BODY + str(n).encode()
        assert len(conns) == 1 and c.opened == 1  # one connection for all three
        c.conn.close()


async def test_chunked_body_split_across_writes() -> None:
    chunked = [
        b"HTTP/1.1 200 OK\r\nTransfer-Enc",
        b"oding: chunked\r\n\r\n" + b"%x\r\n" % 10 + BODY[:10] + b"\r\n",
        b"%x;ext=1\r\n" % (len(BODY) - 10) + BODY[10:500],
        BODY[500:] + b"\r\n0\r\n",
        b"\r\n",
    ]
    async with raw_server(lambda n: chunked) as (url, _):
        c = Client(url)
        assert await c.get() == (200, BODY)
        assert await c.get() == (200, BODY)  # the connection is reusable afterwards
        assert c.opened == 1
        c.conn.close()


async def test_read_to_close_and_connection_close() -> None:
    async with raw_server(lambda n: b"HTTP/1.0 200 OK\r\n\r\n" + BODY + b"<close>") as (url, conns):
        c = Client(url)
        assert await c.get() == (200, BODY)
        assert c.conn.closed
        assert await c.get() == (200, BODY)  # reconnects after the close
        assert len(conns) == 2


async def test_status_size_cap_garbage_timeout_and_refused() -> None:
    async with raw_server(lambda n: ok(b"nope", b"").replace(b"200 OK", b"503 Busy")) as (url, _):
        assert (await Client(url).get())[0] == 503
    async with raw_server(lambda n: ok(b"x" * 5000)) as (url, _):
        c = Client(url, max_body=1000)
        with pytest.raises(HttpError, match="over 1000 bytes") as e:
            await c.get()
        assert e.value.reason == "too_large" and c.conn.closed
    async with raw_server(lambda n: b"SSH-2.0-OpenSSH\r\n\r\n") as (url, _):
        with pytest.raises(HttpError, match="not an HTTP/1.x response"):
            await Client(url).get()
    answers = {1: None}  # the first request hangs, the second is answered
    async with raw_server(lambda n: answers.get(n, ok())) as (url, conns):
        c = Client(url)
        with pytest.raises(TimeoutError):
            await c.get(0.2)
        assert c.conn.closed  # the late answer can never be read as the next one
        assert await c.get() == (200, BODY)  # on a fresh connection
        assert len(conns) == 2
        c.conn.close()
    from services.common.embedded import free_port

    with pytest.raises(HttpError, match="cannot connect") as e:
        await Client(f"http://127.0.0.1:{free_port()}/metrics").get()
    assert e.value.reason == "connect"
    with pytest.raises(ValueError, match="only http:// URLs"):
        request_bytes("https://127.0.0.1:1/metrics")


async def test_polled_answer_and_idle_close() -> None:
    """The agent's fast path: send() at a tick, poll() later without waiting: None until the
    whole answer is there (here written in two pieces), then the answer exactly once."""
    answers = {2: [ok(BODY[:100])[:40], ok(BODY[:100])[40:]]}
    async with raw_server(lambda n: answers.get(n, ok())) as (url, conns):
        c = Client(url)
        assert await c.get() == (200, BODY)  # request 1 opens the connection
        conn = c.conn
        conn.send(c.req)  # request 2, polled
        got = None
        while got is None:
            await readable(conn)
            got = conn.poll()
        assert got == (200, BODY[:100]) and not conn.closed
        with pytest.raises(HttpError, match="no request in flight"):
            conn.poll()  # nothing in flight: a caller bug, reported
        assert len(conns) == 1
        conn.close()


async def test_idle_close_is_marked_for_one_retry() -> None:
    """The engine answers, then closes the kept-alive connection without saying so: the next
    request on it meets EOF (or a reset) before any byte -> HttpError(idle_close=True), which
    the agent retries once on a new connection instead of reporting a failed scrape."""
    async with raw_server(lambda n: [ok() + b"<close>"]) as (url, _):
        (host, port), req = request_bytes(url)
        conn = await Conn.open(host, port, 2)
        conn.send(req)
        assert await conn.wait(2) == (200, BODY)
        await readable(conn)  # the peer's close has arrived
        try:
            conn.send(req)
        except OSError:
            return  # refused at once (reset already seen): the agent reconnects
        with pytest.raises(HttpError) as e:
            while conn.poll() is None:
                await readable(conn)
        assert e.value.idle_close and conn.closed


def test_response_parser_any_split() -> None:
    """Every way of cutting an answer into two reads gives the same result."""
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"a\r\n"
        + BODY[:10]
        + b"\r\n"
        + b"%x\r\n" % (len(BODY) - 10)
        + BODY[10:]
        + b"\r\n0\r\n\r\n"
    )
    for raw in (ok(), chunked):
        for cut in range(1, len(raw)):
            r = Response(1 << 20)
            assert r.feed(raw[:cut]) is None
            assert r.feed(raw[cut:]) == (200, BODY)
            assert r.keep_alive
    r = Response(1 << 20)
    assert r.feed(ok() + b"HTTP/1.1 200") == (200, BODY)
    assert not r.keep_alive  # bytes after the answer: the connection is not reused
    r = Response(1 << 20)
    assert r.feed(b"HTTP/1.0 200 OK\r\n\r\nabc") is None
    assert r.eof() == (200, b"abc")
