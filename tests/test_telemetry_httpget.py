"""The scraper's minimal HTTP/1.1 client against a raw socket server sending crafted answers:
Content-Length, chunked, read-to-close, keep-alive reuse, size cap, garbage, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from services.telemetry.httpget import FastGet, HttpError

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


async def test_content_length_and_keep_alive_reuse() -> None:
    async with raw_server(lambda n: ok(BODY + str(n).encode())) as (url, conns):
        fg = FastGet()
        for n in (1, 2, 3):
            status, body = await fg.get(url, 2)
            assert status == 200 and body == BODY + str(n).encode()
        assert len(conns) == 1  # one connection for all three
        fg.close()


async def test_chunked_body_split_across_writes() -> None:
    chunked = [
        b"HTTP/1.1 200 OK\r\nTransfer-Enc",
        b"oding: chunked\r\n\r\n" + b"%x\r\n" % 10 + BODY[:10] + b"\r\n",
        b"%x;ext=1\r\n" % (len(BODY) - 10) + BODY[10:500],
        BODY[500:] + b"\r\n0\r\n",
        b"\r\n",
    ]
    async with raw_server(lambda n: chunked) as (url, _):
        fg = FastGet()
        assert await fg.get(url, 2) == (200, BODY)
        assert await fg.get(url, 2) == (200, BODY)  # the connection is reusable afterwards
        fg.close()


async def test_read_to_close_and_connection_close() -> None:
    async with raw_server(lambda n: b"HTTP/1.0 200 OK\r\n\r\n" + BODY + b"<close>") as (url, conns):
        fg = FastGet()
        assert await fg.get(url, 2) == (200, BODY)
        assert await fg.get(url, 2) == (200, BODY)  # reconnects after the close
        assert len(conns) == 2
        fg.close()


async def test_status_size_cap_garbage_timeout_and_refused() -> None:
    async with raw_server(lambda n: ok(b"nope", b"").replace(b"200 OK", b"503 Busy")) as (url, _):
        assert (await FastGet().get(url, 2))[0] == 503
    async with raw_server(lambda n: ok(b"x" * 5000)) as (url, _):
        with pytest.raises(HttpError, match="over 1000 bytes") as e:
            await FastGet(max_body=1000).get(url, 2)
        assert e.value.reason == "too_large"
    async with raw_server(lambda n: b"SSH-2.0-OpenSSH\r\n\r\n") as (url, _):
        with pytest.raises(HttpError, match="not an HTTP/1.x response"):
            await FastGet().get(url, 2)
    answers = {1: None}  # the first request hangs, the second is answered
    async with raw_server(lambda n: answers.get(n, ok())) as (url, conns):
        fg = FastGet()
        with pytest.raises(TimeoutError):
            await fg.get(url, 0.2)
        assert await fg.get(url, 2) == (200, BODY)  # a fresh connection, not the late answer
        assert len(conns) == 2
        fg.close()
    from services.common.embedded import free_port

    with pytest.raises(HttpError, match="cannot connect") as e:
        await FastGet().get(f"http://127.0.0.1:{free_port()}/metrics", 2)
    assert e.value.reason == "connect"
    with pytest.raises(ValueError, match="http:// URLs only"):
        await FastGet().get("https://127.0.0.1:1/metrics", 2)


async def test_send_on_the_open_connection_answers_once_and_times_out() -> None:
    """send(): nothing to send on before a connection exists; then the completion is called
    exactly once per request from the protocol (answer, chunked answer, timeout), and a
    timed-out connection is dropped so the late answer is never read."""
    answers = {2: [ok(BODY[:100])[:40], ok(BODY[:100])[40:]], 3: None}
    async with raw_server(lambda n: answers.get(n, ok())) as (url, conns):
        fg = FastGet()
        got: list[tuple[int, bytes, BaseException | None]] = []
        q: asyncio.Queue[None] = asyncio.Queue()

        def done(status: int, body: bytes, exc: BaseException | None) -> None:
            got.append((status, body, exc))
            q.put_nowait(None)

        assert not fg.send(url, 2, done)  # no connection yet
        assert await fg.get(url, 2) == (200, BODY)  # request 1 opens it
        assert fg.send(url, 2, done)  # request 2: answer split in two writes
        assert not fg.send(url, 2, done)  # busy: one request per connection at a time
        await q.get()
        assert got == [(200, BODY[:100], None)]
        assert fg.send(url, 0.2, done)  # request 3 hangs
        await q.get()
        assert got[1][0] == 0 and isinstance(got[1][2], TimeoutError)
        assert not fg.send(url, 2, done)  # the timed-out connection is gone
        assert await fg.get(url, 2) == (200, BODY)
        assert len(conns) == 2 and len(got) == 2
        fg.close()
