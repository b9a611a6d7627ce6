"""The router's upstream client (services/router/upstream.py: ``post`` and ``open_stream``):
the body decoded the same wherever the worker's bytes are split, broken framing reported,
a finished stream's connection reused (also when its last bytes come after the router let
go of it), a worker that dies mid-stream seen as broken. Real sockets on loopback."""

from __future__ import annotations

import asyncio

import pytest

from services.common.deadlines import Deadlines
from services.router.upstream import FastClient, StreamError, UpstreamError, _Conn
from tests.test_router_support import wait_until

EVENTS = [b'data: {"i": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def decode_split(raw: bytes, cuts: list[int]) -> _Conn:
    conn = _Conn(Deadlines())
    prev = 0
    for c in [*cuts, len(raw)]:
        if c > prev:
            conn.data_received(raw[prev:c])
        prev = c
    return conn


@pytest.mark.parametrize(
    "head,body",
    [
        (HEAD, chunked(EVENTS)),
        (HEAD.replace(b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(BODY)), BODY),
    ],
)
def test_body_decoded_the_same_at_every_split(head: bytes, body: bytes) -> None:
    raw = head + body
    for cut in range(1, len(raw)):
        for cut2 in (cut + 1, cut + 7, len(raw) - 1):
            conn = decode_split(raw, sorted({cut, min(cut2, len(raw))}))
            assert conn.error is None, (cut, cut2)
            assert conn.status == 200 and conn.done and conn.keep
            assert b"".join(conn.out) == BODY, (cut, cut2)


def test_broken_framing_is_an_error() -> None:
    for raw in (
        HEAD + b"zz\r\nhello\r\n",  # a size that is not hex
        HEAD + b"5\r\nhelloXX",  # no CRLF after the data
        b"SPDY/3 200 OK\r\n\r\n",  # not HTTP/1.x
        b"HTTP/1.1 200 OK\r\nX-Split: a\nSet-Cookie: b\r\n\r\n",  # a bare LF in a header
    ):
        conn = decode_split(raw, [])
        assert isinstance(conn.error, StreamError), raw


def test_an_informational_response_is_skipped_and_trailing_bytes_end_reuse() -> None:
    # 103 Early Hints, then the answer: the answer is the response
    conn = decode_split(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        + HEAD.replace(b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(BODY))
        + BODY,
        [30],
    )
    assert conn.error is None and conn.done and conn.keep
    assert conn.status == 200 and "link" not in conn.headers
    assert b"".join(conn.out) == BODY
    # bytes after a complete response, in the same read or a later one: the response
    # stands, the connection is not reused
    whole = HEAD.replace(b"Transfer-Encoding: chunked", b"Content-Length: 2") + b"hi"
    for raw, cuts in ((whole + b"HTTP/1.1 200 OK\r\n", []), (whole + b"junk", [len(whole)])):
        conn = decode_split(raw, cuts)
        assert conn.error is None and conn.done and conn.out == [b"hi"]
        assert not conn.keep


def test_a_body_framed_by_the_connections_end_ends_with_it() -> None:
    conn = decode_split(b"HTTP/1.1 200 OK\r\n\r\n" + BODY, [25])
    assert conn.head_done and not conn.done and not conn.keep
    conn.connection_lost(None)
    assert conn.done and conn.error is None and b"".join(conn.out) == BODY
    # a framed body cut short is an error
    conn = decode_split(HEAD + chunked(EVENTS)[:-5], [])
    conn.connection_lost(None)
    assert isinstance(conn.error, StreamError) and not conn.done


def test_an_oversized_head_is_an_error() -> None:
    conn = decode_split(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000, [1000])
    assert isinstance(conn.error, StreamError) and "too large" in str(conn.error)


class Worker:
    """A loopback server that answers each request with ``script`` (a list of byte strings
    written in turn; an asyncio.Event in the list: wait for it first)."""

    def __init__(self, script: list[bytes | asyncio.Event], close_after: bool = False) -> None:
        self.script = script
        self.close_after = close_after
        self.accepted = 0
        self.requests = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> Worker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                for part in self.script:
                    if isinstance(part, asyncio.Event):
                        await part.wait()
                    else:
                        writer.write(part)
                        await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def read_all(client: FastClient, url: str) -> tuple[bytes, object]:
    s = await client.open_stream(url, "/v1/completions", b"{}", {"x-request-id": "r"}, 5.0)
    parts = []
    while not b"".join(parts).endswith(b"data: [DONE]\n\n"):
        data = await s.content.readany()
        assert data, "the stream ended before [DONE]"
        parts.append(data)
    s.release()  # as the router does: at [DONE], maybe before the chunked terminator
    return b"".join(parts), s


async def test_a_finished_stream_leaves_its_connection_for_the_next() -> None:
    worker = await Worker([HEAD, chunked(EVENTS)]).start()
    client = FastClient()
    try:
        for _ in range(3):
            body, _s = await read_all(client, worker.url)
            assert body == BODY
        assert (worker.accepted, worker.requests) == (1, 3)
    finally:
        await client.close()
        await worker.stop()


async def test_a_stream_released_before_its_terminator_is_reused_once_it_ends() -> None:
    terminator_may_go = asyncio.Event()
    worker = await Worker(
        [
            HEAD,
            b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS),
            terminator_may_go,
            b"0\r\n\r\n",
        ]
    ).start()
    client = FastClient()
    try:
        body, s = await read_all(client, worker.url)
        assert body == BODY
        conn = s.conn  # type: ignore[attr-defined]
        assert not conn.done and conn.park is not None  # parked, not yet reusable
        terminator_may_go.set()  # (and for the next request: the terminator goes at once)
        await wait_until(lambda: conn.done, 5, "the terminator arrived")
        assert conn.park is None and not conn.lost  # back in the pool
        body, _s = await read_all(client, worker.url)
        assert body == BODY and worker.accepted == 1
    finally:
        await client.close()
        await worker.stop()


async def test_a_worker_dying_mid_stream_is_a_broken_stream() -> None:
    worker = await Worker(
        [HEAD, b"%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0])], close_after=True
    ).start()
    client = FastClient()
    try:
        s = await client.open_stream(worker.url, "/v1/completions", b"{}", {}, 5.0)
        assert await s.content.readany() == EVENTS[0]
        with pytest.raises(StreamError):
            await s.content.readany()
        s.close()
        # a worker that closes before any response: a broken request, not a stream
        dead = await Worker([], close_after=True).start()
        with pytest.raises(UpstreamError) as exc:
            await client.open_stream(dead.url, "/v1/completions", b"{}", {}, 5.0)
        assert exc.value.kind == "broken"
        await dead.stop()
    finally:
        await client.close()
        await worker.stop()


async def test_a_silent_worker_times_out() -> None:
    never = asyncio.Event()
    worker = await Worker([HEAD, never]).start()
    client = FastClient()
    try:
        s = await client.open_stream(worker.url, "/v1/completions", b"{}", {}, 0.2)
        with pytest.raises(TimeoutError):
            await s.content.readany()
        s.close()
        silent = await Worker([never]).start()
        with pytest.raises(UpstreamError) as exc:
            await client.open_stream(silent.url, "/v1/completions", b"{}", {}, 0.2)
        assert exc.value.kind == "timeout"
        await silent.stop()
    finally:
        never.set()
        await client.close()
        await worker.stop()


WHOLE = b'{"choices": [{"text": "ok"}]}'
WHOLE_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (len(WHOLE), WHOLE)
)


async def test_whole_responses_reuse_the_connection_and_survive_a_closed_one() -> None:
    worker = await Worker([WHOLE_RESPONSE]).start()
    client = FastClient()
    try:
        for _ in range(3):
            resp = await client.post(worker.url, "/v1/completions", b"{}", {}, 5.0)
            assert (resp.status, resp.body) == (200, WHOLE)
            assert resp.headers["content-type"] == "application/json"
        assert (worker.accepted, worker.requests) == (1, 3)
        # a worker that closes each connection after answering (without saying so): the
        # pooled connection is found closed, the request goes out on a fresh one
        closing = await Worker([WHOLE_RESPONSE], close_after=True).start()
        for _ in range(3):
            resp = await client.post(closing.url, "/v1/completions", b"{}", {}, 5.0)
            assert resp.body == WHOLE
        assert closing.accepted == 3
        await closing.stop()
        # chunked whole responses too
        chunky = await Worker([HEAD, chunked([b"{}", WHOLE])]).start()
        resp = await client.post(chunky.url, "/v1/completions", b"{}", {}, 5.0)
        assert resp.body == b"{}" + WHOLE
        await chunky.stop()
    finally:
        await client.close()
        await worker.stop()
