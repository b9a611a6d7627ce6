"""A minimal HTTP/1.1 keep-alive client for upstream calls to engines over plain http (the
hot path): :meth:`FastClient.post` (one whole response) and :meth:`FastClient.open_stream`
(a response read as it arrives: server-sent events).

aiohttp's client is general (cookies, redirects, multipart, tracing) and costs more per call
than the whole routing decision; an engine answering a completion needs none of that. This
client writes one request, reads one response (Content-Length, chunked, or until close) and
keeps the connection for the next request.

Invariants:
- a connection is reused only after its previous response was read completely and neither
  side asked to close it (a stream released before its last bytes arrived is parked: it goes
  back to the pool when they do, and is closed if anything else happens);
- a request that fails on a *reused* connection before any response byte (the server closed
  an idle keep-alive connection) is retried once on a fresh connection; any other failure
  raises :class:`UpstreamError` (``connect`` / ``timeout`` / ``broken``) and the connection is
  dropped; a stream that breaks after its head raises :class:`StreamError` from ``readany``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from services.common.deadlines import Deadlines

MAX_IDLE_PER_HOST = 256


class UpstreamError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # "connect" | "timeout" | "broken"
        self.detail = detail


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes


MAX_HEAD_BYTES = 64 * 1024


class StreamError(OSError):
    """An upstream stream broke after its head: closed early, or bytes that are not HTTP."""


class FastClient:
    def __init__(self, connect_timeout: float = 2.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        # response and stream timeouts (seconds long; a timer per wait would cost more than
        # the rest of the wait): checked every Deadlines.tick_s, so they fire up to that late
        self.deadlines = Deadlines()

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            host, port = u.hostname or "127.0.0.1", u.port or 80
            t = self._targets[base_url] = (host, port, f"{host}:{port}".encode())
        return t

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        await self.deadlines.close()

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float
    ) -> Response:
        """POST and read the whole response (at most ``timeout`` once connected)."""
        key, conn = await self._exchange(base_url, path, body, headers, timeout, whole=True)
        out = conn.out
        conn.out = []
        resp = Response(conn.status, conn.headers, out[0] if len(out) == 1 else b"".join(out))
        if conn.keep and not conn.lost:
            self._keep(key, conn)
        else:
            conn.close()
        return resp

    async def open_stream(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        idle_timeout: float,
    ) -> Stream:
        """POST and wait for the response's head (at most ``idle_timeout``); the body is read
        with :meth:`Stream.readany`."""
        key, conn = await self._exchange(base_url, path, body, headers, idle_timeout, whole=False)
        return Stream(self, key, conn, idle_timeout)

    async def _exchange(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout: float,
        whole: bool,
    ) -> tuple[tuple[str, int], _Conn]:
        """Send the request on a pooled or new connection; wait for the response's head
        (``whole``: for all of it)."""
        host, port, hostport = self._target(base_url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: ".encode()
            + hostport
            + f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        )
        key = (host, port)
        for attempt in (0, 1):
            idle = self._idle.get(key)
            conn = None
            while idle and conn is None:
                c = idle.pop()
                conn = None if c.lost else c
            reused = conn is not None
            if conn is None:
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        _t, conn = await asyncio.get_running_loop().create_connection(
                            lambda: _Conn(self.deadlines), host, port
                        )
                except TimeoutError as exc:
                    raise UpstreamError("connect", "connect timeout") from exc
                except OSError as exc:
                    raise UpstreamError("connect", f"{type(exc).__name__}: {exc}") from exc
            conn.begin()
            conn.transport.write(head + body)
            try:
                deadline = conn.loop.time() + timeout
                while not (conn.done if whole else conn.head_done):
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(deadline)
            except TimeoutError as exc:
                conn.close()
                raise UpstreamError("timeout", "no response in time") from exc
            except StreamError as exc:
                conn.close()
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # the server closed an idle keep-alive connection
                raise UpstreamError("broken", str(exc)) from exc
            except BaseException:  # cancelled (the client left): the answer is not read
                conn.close()
                raise
            return key, conn
        raise UpstreamError("broken", "connection closed")  # pragma: no cover

    def _keep(self, key: tuple[str, int], conn: _Conn) -> None:
        lst = self._idle.setdefault(key, [])
        if len(lst) < MAX_IDLE_PER_HOST and not conn.lost:
            lst.append(conn)
        else:
            conn.close()


class _Conn(asyncio.Protocol):
    """One upstream connection reading one response at a time, decoded as bytes arrive by
    httptools' parser (llhttp, the parser of Node.js: the head, then a body framed by
    Content-Length, chunks, or the connection's end). Its callbacks fill ``out`` with body
    bytes and mark ``head_done`` / ``done``; anything llhttp refuses is an error."""

    def __init__(self, deadlines: Deadlines) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.deadlines = deadlines
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.lost = False
        self.begin()

    def begin(self) -> None:
        """Ready for the next response on this connection (a parser of its own)."""
        self.parser = httptools.HttpResponseParser(self)
        self.head_bytes = 0  # bytes of the head read so far (bounded by MAX_HEAD_BYTES)
        self.head_done = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep = False
        self.out: list[bytes] = []
        self.done = False
        self.error: StreamError | None = None
        self.got_bytes = False
        self.waiter: asyncio.Future[None] | None = None
        self.park: tuple[FastClient, tuple[str, int]] | None = None

    def close(self) -> None:
        self.park = None
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.park = None
        if not self.done and self.error is None:
            if self.head_done and self._until_close():
                self.done = True
            else:
                self.error = StreamError("connection closed by the worker")
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, deadline: float) -> None:
        """Until bytes arrive or the connection ends; ``TimeoutError`` past ``deadline`` (the
        loop's clock)."""
        self.waiter = self.loop.create_future()
        try:
            await self.deadlines.wait(self.waiter, deadline)
        finally:
            self.waiter = None

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.done:  # bytes after a complete response: not a connection to reuse
            self.keep = False
            self.close()
            return
        if not self.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
            if not self.head_done and self.head_bytes > MAX_HEAD_BYTES:
                raise StreamError("response head too large")
        except (httptools.HttpParserError, StreamError) as exc:
            if self.done:  # bytes after the response: the response stands, the connection not
                self.keep = False
            else:
                self.error = StreamError(f"bad response: {exc}")
                self.close()
        if self.park is not None:  # released before its end: reusable only if it ends now
            if self.out or self.error is not None:
                self.close()
            elif self.done:
                client, key = self.park
                self.park = None
                if self.keep:
                    client._keep(key, self)
                else:
                    self.close()
        self._wake()

    # ------------------------------------------------------------ parser callbacks
    def _until_close(self) -> bool:
        """Is the body framed by the connection's end (no length, not chunked)?"""
        return (
            "content-length" not in self.headers
            and self.headers.get("transfer-encoding", "").lower() != "chunked"
            and self.status not in (204, 304)
        )

    def on_message_begin(self) -> None:
        if self.done:  # a second response in the bytes of one (data_received: not reused)
            raise StreamError("bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        p = self.parser
        self.status = p.get_status_code()
        if 100 <= self.status < 200:  # informational (103 Early Hints): the answer follows
            self.headers = {}
            return
        self.keep = p.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.out.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:  # (not the end of an informational response)
            self.done = True


class Stream:
    """An upstream response read as it arrives. ``content.readany()``, ``read()``,
    ``release()`` and ``close()`` mean what aiohttp's ``ClientResponse`` methods mean."""

    def __init__(
        self, client: FastClient, key: tuple[str, int], conn: _Conn, idle_timeout: float
    ) -> None:
        self.client = client
        self.key = key
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers  # lower-cased names
        self.idle_timeout = idle_timeout
        self.content = self
        self._released = False

    async def readany(self) -> bytes:
        """What arrived since the last call (waiting at most ``idle_timeout`` for some);
        b"" at the end of the body; :class:`StreamError` when the stream broke."""
        c = self.conn
        while not c.out:
            if c.error is not None:
                raise c.error
            if c.done:
                return b""
            await c.wait(c.loop.time() + self.idle_timeout)
        out = c.out
        c.out = []
        return out[0] if len(out) == 1 else b"".join(out)

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool once the response is complete
        (now, or when its last bytes arrive), else it is closed."""
        if self._released:
            return
        self._released = True
        c = self.conn
        if c.lost or c.error is not None or not c.keep:
            c.close()
        elif c.done:
            if c.out:
                c.close()
            else:
                self.client._keep(self.key, c)
        else:
            c.out = []
            c.park = (self.client, self.key)

    def close(self) -> None:
        self._released = True
        self.conn.close()
