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
    """One upstream connection reading one response at a time, decoded as bytes arrive
    (the head, then a body framed by Content-Length, chunks, or the connection's end)."""

    def __init__(self, deadlines: Deadlines) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.deadlines = deadlines
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.lost = False
        self.begin()

    def begin(self) -> None:
        """Ready for the next response on this connection."""
        self.buf = b""
        self.head_done = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep = False
        self.mode = "close"  # "length" | "chunked" | "close"
        self.left = 0  # bytes left of the body (length) or of the current chunk (chunked)
        self.cstate = 0  # chunked: 0 size line, 1 data, 2 CRLF after data, 3 trailers
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
            if self.head_done and self.mode == "close":
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
        try:
            if not self.head_done:
                buf = self.buf + data if self.buf else data
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise ValueError("response head too large")
                    self.buf = buf
                    return
                self._head(buf[:i])
                self.buf = b""
                data = buf[i + 4 :]
            if data:
                if self.mode == "chunked":
                    self._chunked(data)
                elif self.mode == "length":
                    take = data[: self.left]
                    self.left -= len(take)
                    self.out.append(take)
                    if self.left == 0:
                        self.done = True
                else:
                    self.out.append(data)
        except ValueError as exc:
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

    def _head(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            if "\n" in line or "\r" in line:  # a bare CR or LF: never passed on to a client
                raise ValueError("bare CR or LF in the response head")
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self.mode = "chunked"
        elif "content-length" in headers:
            self.mode = "length"
            self.left = int(headers["content-length"])
            self.done = self.left == 0
        elif self.status in (204, 304):
            self.mode, self.done = "length", True
        else:
            self.keep = False
        self.head_done = True

    def _chunked(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, n = 0, len(buf)
        while pos < n:
            st = self.cstate
            if st == 1:  # chunk data
                take = min(self.left, n - pos)
                self.out.append(buf[pos : pos + take] if take != n else buf)
                pos += take
                self.left -= take
                if self.left == 0:
                    self.cstate = 2
            elif st == 2:  # the CRLF after a chunk's data
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self.cstate = 0
            else:  # a size line (0) or a trailer line (3)
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    if n - pos > 4096:
                        raise ValueError("chunk size line too long")
                    break
                line = buf[pos:j]
                pos = j + 2
                if st == 0:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size:
                        self.left, self.cstate = size, 1
                    else:
                        self.cstate = 3
                elif not line:  # the empty line after the (usually absent) trailers
                    self.done = True
                    if pos < n:
                        self.keep = False  # bytes after the response
                    break
        self.buf = buf[pos:] if pos < n and not self.done else b""


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
