"""The router's HTTP/1.1 server: an asyncio protocol around the ``httptools`` parser (the
parser uvicorn uses), with the small request / response interface the router's handlers need.

aiohttp's server (request objects, multidicts, the router, middlewares, payload writers) cost
the router more CPU per request than everything else it does to route and forward one;
serving a proxy's few fixed routes needs none of it (docs/benchmarks.md, "HTTP server").

Serves: routes by method and exact path (plus prefix routes with one parameter), HEAD on
GET routes, keep-alive and pipelining (HTTP/1.1; HTTP/1.0 with ``Connection: keep-alive``),
``Content-Length`` and chunked request bodies, ``Expect: 100-continue`` (sent when a handler
first reads the body), TLS (``ssl_context``), chunked streaming responses (HTTP/1.0: until
close), write flow control, a graceful drain (:meth:`Server.drain`), and the limits of ``surface.limits``
(services.router.conn_limits): head size, header count and URL length, header / body /
keep-alive timeouts, the number of open connections.

Invariants:
- a connection answers its requests in the order they arrived, one handler at a time
  (pipelined requests wait, parsed, their turn);
- a connection is kept for the next request only when the request was read to its end, both
  sides allow keep-alive and the response was complete; otherwise the response says
  ``Connection: close`` and the connection closes after it (reading, and dropping, what the
  client still sends for a moment, so the response is not lost to a reset);
- ``surface.check`` sees every request before its handler and before its body is read;
  a body over ``surface.max_body`` is never buffered past that size;
- a request head is measured before the parser sees it: one over ``max_header_bytes`` (or a
  URL over ``max_url_bytes``, or more than ``max_headers`` fields) is answered 431 (414) and
  never buffered past the limit (a head that starts in the same socket read as the end of
  the previous request is measured from the next read: at most one read, 256 KiB, more);
- a head still incomplete ``header_timeout_s`` after it began (or after the accept), a body
  silent for ``body_timeout_s`` while the server waits for it, get 408 and the connection
  closes (a connection that never sent a byte is closed without an answer); a connection
  beyond ``max_connections`` gets 503 with Retry-After and is closed;
- a path with ``.`` or ``..`` segments (percent-encoded or not) or control characters gets
  400: no route, check or upstream sees a path that a normaliser would read differently;
- bytes that do not parse as HTTP/1.x get a 400 and the connection closes (when they follow
  requests still in progress, those are answered and the connection closes after them);
- the client leaving cancels the handler of its request (its ``finally`` blocks release
  what it held; an upstream request in flight is closed with it);
- draining (:meth:`Server.drain`): no connection is accepted any more; every request already
  received, and every one that arrives on an open connection before the drain ends, is
  answered, with ``Connection: close``; a handler is cancelled only at the drain's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import re
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

import httptools
import msgspec

from services.common.logging import get_logger
from services.router.conn_limits import ConnLimits, reject

log = get_logger("router.http")

_encode = msgspec.json.encode
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
MAX_PIPELINED = 32  # parsed requests waiting on one connection before reading pauses
LINGER_S = 2.0  # after a closing response: how long what the client still sends is dropped
# where a head ends: an empty line (llhttp also takes a bare LF as a line's end)
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# a path segment "." or "..", or a control character (after percent-decoding)
_UNSAFE_PATH = re.compile(r"(?:^|/)\.{1,2}(?:/|$)|[\x00-\x1f\x7f]")


class BodyTooLarge(Exception):
    """The request body grew past the server's limit while it was read."""


class BodyTimeout(Exception):
    """The client stopped sending its request body (``body_timeout_s``)."""


class _Refused(Exception):
    """Raised in a parser callback: the head broke a limit (the parser stops there)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class Headers(dict[str, str]):
    """Request headers: names lower-cased when parsed, looked up in any case."""

    __slots__ = ()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key.lower() if isinstance(key, str) else key)


class Request:
    """One parsed request. The body arrives after the handler starts: :meth:`read`."""

    __slots__ = (
        "_body",
        "_chunks",
        "_complete",
        "_conn",
        "_continued",
        "_size",
        "_timed_out",
        "_too_large",
        "_waiter",
        "fixed",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query_string",
        "version",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        path: str,
        query_string: str,
        headers: Headers,
        version: str,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.match_info: dict[str, str] = {}
        self.fixed: Response | None = None  # answered without a handler (a parse error)
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._too_large = False
        self._timed_out = False
        self._continued = False  # "100 Continue" was sent
        self._body: bytes | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ reading
    @property
    def content_length(self) -> int | None:
        v = self.headers.get("content-length")
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    @property
    def expects_continue(self) -> bool:
        """The client waits for "100 Continue" before it sends the body."""
        return dict.get(self.headers, "expect", "").lower() == "100-continue"

    @property
    def can_read_body(self) -> bool:
        return bool(self._size) or not self._complete

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string)) if self.query_string else {}

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's connection; None once the client left."""
        c = self._conn
        return None if c.lost else c.transport

    async def read(self) -> bytes:
        """The whole body (read once, kept); :class:`BodyTooLarge` past the server's limit,
        :class:`BodyTimeout` when the client stopped sending it."""
        if self._body is not None:
            return self._body
        if not self._complete and not self._too_large and not self._timed_out:
            conn = self._conn
            if not self._continued and self.expects_continue and not conn.lost:
                conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                conn.last = conn.loop.time()  # the body timeout counts from the invitation
                self._continued = True
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._too_large:
            raise BodyTooLarge()
        if self._timed_out:
            raise BodyTimeout()
        if not self._complete:  # the client left (or half-closed) before its body ended
            raise ConnectionResetError("the request body was cut short")
        self._body = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks = []
        return self._body

    def replace_body(self, body: bytes) -> None:
        """After :meth:`read`: what the router forwards instead of the client's bytes (a body
        it rewrote, e.g. a tenant's ``cache_salt`` added)."""
        self._body = body

    def _feed(self, data: bytes, limit: int) -> None:
        if self._too_large:
            return
        self._size += len(data)
        if self._size > limit:
            self._too_large = True
            self._chunks = []
            self._wake()
        else:
            self._chunks.append(data)

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Response:
    """A whole response: status, headers, body."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        headers: dict[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        self.body = body
        self.status = status
        self.headers = headers if headers is not None else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    h = dict(headers) if headers else {}
    h["Content-Type"] = "application/json"
    return Response(_encode(data), status, h)


def _date() -> bytes:
    now = int(time.time())
    if now != _DATE[0]:
        _DATE[0], _DATE[1] = now, formatdate(now, usegmt=True).encode()
    return _DATE[1]  # type: ignore[return-value]


_DATE: list[Any] = [0, b""]


def _head(status: int, headers: dict[str, str], framing: bytes) -> bytes:
    reason = _REASONS.get(status, b"Unknown")
    fields = "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1")
    return b"HTTP/1.1 %d %s\r\n%sDate: %s\r\n%s\r\n" % (status, reason, fields, _date(), framing)


class StreamResponse:
    """A response written in parts (server-sent events): :meth:`prepare`, :meth:`write`,
    :meth:`write_eof`. The headers leave with the first part. Chunked for HTTP/1.1 clients;
    HTTP/1.0 clients read until the connection closes. Writing after the client left raises
    ``ConnectionResetError``."""

    __slots__ = ("_chunked", "_conn", "_eof", "_keep", "_started", "headers", "prepared", "status")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = headers if headers is not None else {}
        self.prepared = False
        self._conn: _Connection | None = None
        self._started = False
        self._eof = False
        self._chunked = True
        self._keep = False

    async def prepare(self, request: Request) -> None:
        self._conn = request._conn
        self._chunked = request.version == "1.1"
        self._keep = self._chunked and request._conn.may_keep(request)
        self.prepared = True

    def _start(self) -> bytes:
        self._started = True
        if self._chunked:
            framing = b"Transfer-Encoding: chunked\r\n"
            if not self._keep:
                framing += b"Connection: close\r\n"
        else:
            framing = b"Connection: close\r\n"
        return _head(self.status, self.headers, framing)

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or conn.lost or self._eof:
            raise ConnectionResetError("the client connection is closed")
        if not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if not self._started:
            data = self._start() + data
        conn.transport.write(data)
        if conn.paused:
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof:
            return
        conn = self._conn
        if conn is None or conn.lost:
            raise ConnectionResetError("the client connection is closed")
        out = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        if not self._chunked:
            out = data
        if not self._started:
            out = self._start() + out
        self._eof = True
        conn.transport.write(out)


Reply = Response | StreamResponse
Handler = Callable[[Request], Awaitable[Reply]]


class Surface(Protocol):
    """What a port lets through (services.router.public_surface): a check before each
    handler (None: go on), the body limit, the connection limits, and errors in the port's
    shape."""

    max_body: int
    limits: ConnLimits

    def check(self, request: Request) -> Response | None: ...

    def error(
        self, status: int, message: str, headers: dict[str, str] | None = None
    ) -> Response: ...

    def too_large(self, length: int | None) -> Response: ...


class Routes:
    """Handlers by method and path: exact paths, and prefixes whose rest is one parameter."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._prefix: list[tuple[str, str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        """``method`` "*": any method."""
        self._exact.setdefault(path, {})[method] = handler

    def add_prefix(self, method: str, prefix: str, name: str, handler: Handler) -> None:
        """``prefix`` + a non-empty rest, given to the handler as ``match_info[name]``."""
        for p, n, by_method in self._prefix:
            if p == prefix and n == name:
                by_method[method] = handler
                return
        self._prefix.append((prefix, name, {method: handler}))

    def resolve(self, request: Request) -> Handler | tuple[int, list[str]]:
        """The handler, or (404, []) / (405, allowed methods)."""
        method = request.method
        by_method = self._exact.get(request.path)
        if by_method is None:
            for prefix, name, methods in self._prefix:
                if request.path.startswith(prefix) and len(request.path) > len(prefix):
                    request.match_info[name] = request.path[len(prefix) :]
                    by_method = methods
                    break
            else:
                return 404, []
        h = by_method.get(method) or by_method.get("*")
        if h is None and method == "HEAD":
            h = by_method.get("GET")
        if h is None:
            return 405, sorted(by_method)
        return h


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order.

    Phases, for the timeouts (:meth:`check_timeouts`): *head* (``in_head``: waiting for or
    receiving a request's head; ``head_started`` is when its first byte came, or the accept
    for the first request), *body* (``req``: the head is parsed, its body is arriving), and
    between them *busy* (a handler answers) or *idle* (nothing in progress, since
    ``idle_since``)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.req: Request | None = None  # the one being parsed
        self.url = b""
        self.headers = Headers()
        self.lost = False
        self.paused = False  # the transport's buffer is full: writers wait
        self.reading_paused = False
        self.broken = False  # a parse error or a refusal: nothing more is read
        self.closing = False  # a closing response went out: what arrives is dropped
        self.last = self.loop.time()  # when bytes last arrived
        self.idle_since = self.last
        # the head in progress: measured before the parser sees it
        self.in_head = True
        self.head_started: float | None = self.last  # the first request: from the accept
        self.head_begun = False  # some byte of it arrived
        self.head_bytes = 0
        self.head_tail = b""  # its last bytes, to find an empty line split over two reads
        self.line_done = False  # its request line has ended
        self.line_bytes = 0  # how long its request line is (so far)
        self.header_count = 0
        self.heads_done = 0  # heads parsed on this connection
        self._drain: asyncio.Future[None] | None = None
        self._linger: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """A request is being received or answered (a drain waits for it)."""
        if self.lost:
            return False
        return self.task is not None or (self.head_begun and not self.closing and not self.broken)

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if len(server.conns) >= self.limits.max_connections:
            self._refuse_connection()
            return
        server.conns.add(self)

    def _refuse_connection(self) -> None:
        """Over ``max_connections``: 503 with Retry-After before reading anything, then close
        (after a moment of dropping what the client sends, so the answer is not lost to a
        reset). Past as many again refused and lingering: closed with no answer."""
        server = self.server
        self.broken = self.closing = True
        reject("connection_limit", self._peer(), status=503)
        if len(server.refusing) >= self.limits.max_connections:
            self.transport.close()
            return
        server.refusing.add(self)
        retry = str(self.limits.retry_after_s)
        reply = server.surface.error(
            503,
            f"the router is at its limit of {self.limits.max_connections} connections; "
            f"retry after {retry} s",
            {"Retry-After": retry},
        )
        framing = b"Content-Length: %d\r\nConnection: close\r\n" % len(reply.body)
        self.transport.write(_head(503, reply.headers, framing) + reply.body)
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.conns.discard(self)
        self.server.refusing.discard(self)
        if self._linger is not None:
            self._linger.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its request's handler stops
        for r in self.queue:
            r._wake()
        self._wake_drain()
        if self.server.stopping:
            self.server.check_drained()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client connection is closed")
        if self.paused:
            self._drain = self.loop.create_future()
            await self._drain
            if self.lost:
                raise ConnectionResetError("the client connection is closed")

    def data_received(self, data: bytes) -> None:
        if self.closing or self.broken:
            return
        self.last = now = self.loop.time()
        heads = -1
        if self.in_head:
            if self.head_started is None:
                self.head_started = now
            self.head_begun = True
            if self.head_bytes or len(data) > self.limits.max_header_bytes:
                if not self._measure_head(data):
                    return
            else:  # this read cannot take the head past the limit: measured only if it goes on
                heads = self.heads_done
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.broken = True  # no protocol switch: the request is answered, then close
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):  # a limit, raised in a callback
                self._refuse(refused.status, refused.reason, refused.message)
            else:
                self._refuse(400, "malformed", f"malformed HTTP request: {exc}", linger=False)
            return
        if heads >= 0 and self.in_head and self.heads_done == heads and not self.broken:
            self._measure_head(data)  # the head goes on in the next read

    def _measure_head(self, data: bytes) -> bool:
        """Count the bytes of ``data`` that belong to the head in progress; False (and the
        head refused, the data dropped) when they take it past ``max_header_bytes``."""
        tail = self.head_tail
        m = _HEAD_END.search(tail + data[:3]) if tail else None
        if m is not None and m.end() > len(tail):
            ends = m.end() - len(tail)
        else:
            m = _HEAD_END.search(data)
            ends = m.end() if m is not None else -1
        n = len(data) if ends < 0 else ends
        if not self.line_done:
            i = data.find(b"\n", 0, n)
            self.line_bytes = self.head_bytes + (n if i < 0 else i)
            self.line_done = i >= 0
        self.head_bytes += n
        limit = self.limits.max_header_bytes
        if self.head_bytes > limit:
            if self.line_bytes > self.limits.max_url_bytes:
                self._refuse(
                    414,
                    "url_too_long",
                    f"request line is over the limit of {self.limits.max_url_bytes} bytes",
                )
            else:
                self._refuse(
                    431, "header_too_large", f"request headers are over the limit of {limit} bytes"
                )
            return False
        self.head_tail = data[-3:] if ends < 0 else b""
        return True

    def eof_received(self) -> bool | None:
        """The client half-closed: complete requests in progress are still answered, then
        the connection closes; one whose body was cut short ends with the connection."""
        if self.task is None or self.req is not None:
            return None
        self.broken = True
        return True

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = Headers()
        self.header_count = 0
        if self.head_started is None:  # a head that began inside the previous one's read
            self.head_started = self.loop.time()
            self.head_begun = True

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_url_bytes:
            raise _Refused(
                414, "url_too_long", f"URL is over the limit of {self.limits.max_url_bytes} bytes"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > self.limits.max_headers:
            raise _Refused(
                431,
                "too_many_headers",
                f"request has more than {self.limits.max_headers} header fields",
            )
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_started = None
        self.heads_done += 1
        p = self.parser
        url = self.url
        if not url.startswith(b"/"):  # absolute form (a proxy's), or "*"
            try:
                url = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                url = b"/"
        path, _, qs = url.partition(b"?")
        raw = spath = path.decode("latin-1")
        if "%" in raw:
            spath = unquote(raw)
        req = Request(
            self,
            p.get_method().decode(),
            spath,
            qs.decode("latin-1"),
            self.headers,
            p.get_http_version(),
            p.should_keep_alive(),
        )
        if ("." in raw or "%" in raw) and _UNSAFE_PATH.search(spath):
            reject("bad_path", self._peer(), status=400)
            req.fixed = self.server.surface.error(
                400, "request path has '.' or '..' segments or control characters"
            )
        self.req = req
        self._enqueue(req)

    def on_body(self, body: bytes) -> None:
        if self.req is not None:
            self.req._feed(body, self.server.surface.max_body)

    def on_message_complete(self) -> None:
        if self.req is not None:
            self.req._end()
            self.req = None
        self.in_head = True
        self.head_begun = False
        if self.head_bytes:  # it was measured (a large head, or one over several reads)
            self.head_bytes = 0
            self.head_tail = b""
            self.line_done = False
            self.line_bytes = 0

    # ------------------------------------------------------------------ limits
    def _peer(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport else None

    def _refuse(self, status: int, reason: str, message: str, *, linger: bool = True) -> None:
        """Answer ``status`` after the requests before it; nothing more is read. ``linger``:
        the client may still be sending (a head past the limit), so what it sends is dropped
        for a moment before the close instead of resetting the connection under the answer."""
        self.broken = True
        reject(reason, self._peer(), status=status)
        req = Request(self, "", "", "", Headers(), "1.1", False)
        req.fixed = self.server.surface.error(status, message)
        req._complete = not linger
        self.req = None
        self._enqueue(req)

    def check_timeouts(self, now: float) -> None:
        """Act on a timeout of the phase the connection is in (the server's sweep)."""
        if self.lost or self.closing or self.broken:
            return
        limits = self.limits
        if self.in_head:
            started = self.head_started
            if started is not None and now - started > limits.header_timeout_s:
                if self.head_begun:
                    message = f"request head not received within {limits.header_timeout_s:g} s"
                    # a slow client is still sending: linger (bounded, LINGER_S) so its
                    # bytes do not reset the connection under the 408
                    self._refuse(408, "header_timeout", message)
                else:  # nothing sent since the accept: no request to answer
                    reject("header_timeout", self._peer(), status=None)
                    self.transport.close()
            elif (
                started is None
                and self.task is None
                and now - self.idle_since > limits.keepalive_timeout_s
            ):
                self.transport.close()
            return
        req = self.req
        if req is None or self.reading_paused or (req.expects_continue and not req._continued):
            return  # not waiting on the client
        if now - self.last > limits.body_timeout_s:
            self.broken = True
            self.req = None
            reject("body_timeout", self._peer(), status=408)
            req._timed_out = True
            req._wake()

    # ------------------------------------------------------------------ answering
    def _enqueue(self, req: Request) -> None:
        self.queue.append(req)
        if len(self.queue) > MAX_PIPELINED and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    def may_keep(self, req: Request) -> bool:
        """Can the connection take another request after ``req``'s response?"""
        return (
            req.keep_alive
            and req._complete
            and not req._too_large
            and not self.broken
            and not self.server.stopping
        )

    async def _serve(self) -> None:
        try:
            while self.queue and not self.lost:
                req = self.queue[0]
                reply = req.fixed or await self.server.respond(req)
                keep = self._send(req, reply)
                self.queue.popleft()
                if not keep:
                    self._close(req)
                    return
                if self.reading_paused and len(self.queue) <= MAX_PIPELINED // 2:
                    self.reading_paused = False
                    self.transport.resume_reading()
        except asyncio.CancelledError:
            if not self.lost:  # stopped by the server: no answer coming
                self.transport.close()
        finally:
            self.task = None
            self.idle_since = self.loop.time()
            if self.server.stopping:
                self.server.check_drained()

    def _send(self, req: Request, reply: Reply) -> bool:
        """Write ``reply`` (what is left of it); whether the connection stays open."""
        if self.lost:
            return False
        if isinstance(reply, StreamResponse):
            if reply._eof:  # its head said keep-alive; while draining it closes anyway
                return reply._keep and not self.server.stopping
            if reply._started:  # cut short (an error, the client left): the framing is broken
                return False
            reply = Response(b"", reply.status, reply.headers)  # never written: empty
        keep = self.may_keep(req)
        if keep:
            framing = b"Content-Length: %d\r\n" % len(reply.body)
            if req.version == "1.0":
                framing += b"Connection: keep-alive\r\n"
        else:
            framing = b"Content-Length: %d\r\nConnection: close\r\n" % len(reply.body)
        head = _head(reply.status, reply.headers, framing)
        self.transport.write(head if req.method == "HEAD" else head + reply.body)
        return keep

    def _close(self, req: Request) -> None:
        if self.lost:
            return
        if req._complete and not self.closing:
            self.transport.close()
            return
        # the client may still be sending its body: drop it for a moment instead of
        # resetting the connection under the response
        self.closing = True
        if self.reading_paused:
            self.transport.resume_reading()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)


@dataclass
class DrainResult:
    """What a drain found and did."""

    in_flight: int  # connections with a request in progress when it began
    cut: int  # handlers cancelled at the deadline (their clients got no complete answer)
    seconds: float


class Server:
    """Serves ``routes`` behind ``surface`` on one listening socket."""

    def __init__(
        self,
        routes: Routes,
        surface: Surface,
        *,
        shutdown_s: float = 5.0,
    ) -> None:
        self.routes = routes
        self.surface = surface
        self.limits = surface.limits
        self.shutdown_s = shutdown_s
        self.conns: set[_Connection] = set()
        # connections over max_connections, answered 503 and lingering until closed
        self.refusing: set[_Connection] = set()
        self.stopping = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._drained = asyncio.Event()  # while stopping: no connection is busy

    async def start(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> Server:
        self._server = await self.loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=ssl_context,
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=1024,
            # a TLS handshake is part of the head's time
            ssl_handshake_timeout=self.limits.header_timeout_s if ssl_context else None,
        )
        self._sweeper = self.loop.create_task(self._sweep())
        return self

    async def respond(self, req: Request) -> Reply:
        """The handler's reply (never raises, except when cancelled)."""
        surface = self.surface
        try:
            refused = surface.check(req)
            if refused is not None:
                return refused
            found = self.routes.resolve(req)
            if isinstance(found, tuple):
                status, allow = found
                if status == 404:
                    return surface.error(404, f"no such endpoint: {req.method} {req.path}")
                return surface.error(
                    405,
                    f"method {req.method} not allowed on {req.path}",
                    {"Allow": ",".join(allow)},
                )
            return await found(req)
        except BodyTooLarge:
            return surface.too_large(None)
        except BodyTimeout:
            return surface.error(
                408, f"request body not received: {self.limits.body_timeout_s:g} s without data"
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed", method=req.method, path=req.path)
            return surface.error(500, "internal error in the router")

    async def _sweep(self) -> None:
        """Apply the header, body and keep-alive timeouts (services.router.conn_limits)."""
        every = self.limits.sweep_s
        while True:
            await asyncio.sleep(every)
            now = self.loop.time()
            for c in list(self.conns):
                c.check_timeouts(now)

    def check_drained(self) -> None:
        """While stopping: wake the drain when no connection is busy any more."""
        if not any(c.busy for c in self.conns):
            self._drained.set()

    async def stop(self) -> None:
        """:meth:`drain` with ``shutdown_s``."""
        await self.drain(self.shutdown_s)

    async def drain(self, timeout_s: float, cut_now: asyncio.Event | None = None) -> DrainResult:
        """Stop listening; answer every request in progress, and every one that still arrives
        on an open connection, with ``Connection: close``, for up to ``timeout_s`` (or until
        ``cut_now`` is set); then cancel the handlers still running and close every
        connection. Idle kept-alive connections stay open meanwhile: closing one under a
        request the client is sending on it would lose that request."""
        began = self.loop.time()
        self.stopping = True
        if self._server is not None:
            self._server.close()
        in_flight = sum(1 for c in self.conns if c.busy)
        self.check_drained()
        waits = [asyncio.ensure_future(self._drained.wait())]
        if cut_now is not None:
            waits.append(asyncio.ensure_future(cut_now.wait()))
        try:
            await asyncio.wait(
                waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        tasks = [c.task for c in self.conns if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for c in [*self.conns, *self.refusing]:
            c.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        return DrainResult(in_flight, len(tasks), self.loop.time() - began)
