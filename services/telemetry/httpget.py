"""Keep-alive HTTP/1.1 GET for scraping ``/metrics`` at 10 Hz, polled without I/O callbacks.

Why not aiohttp, nor even an ``asyncio.Protocol``: with 64 endpoints at 10 Hz the agent makes
640 requests a second. On the machines measured the dominant cost was not Python code but
*wake-ups*: every time the event loop (or a thread) is woken by a socket it pays roughly
0.1-0.25 ms of CPU (scheduler, cold caches), so 640 answers arriving one by one cost several
percent of a core before a byte is parsed. A :class:`Conn` is therefore a plain non-blocking
socket that is *never registered* with the event loop on the fast path: the agent writes each
target's request at a tick and reads the answer with non-blocking ``recv`` at the next tick
(:meth:`Conn.poll`), so 64 scrapes cost one wake-up per tick. :meth:`Conn.wait` (reader
callback) is the slow path: the first request on a new connection. ``https`` is not handled
here (the agent uses aiohttp for it).

Invariants:
- At most one request per connection at a time; a connection that failed, timed out or got a
  malformed or over-long answer is closed, so a late answer is never read as the next one.
- Errors are :class:`HttpError` (with a short ``reason``), ``OSError`` or ``TimeoutError``;
  never a partial body. ``HttpError.idle_close`` marks a kept-alive connection that the peer
  had closed before any byte of the answer (safe to retry a GET on a new connection).
- :class:`Response` is pure (bytes in, ``(status, body)`` out): Content-Length, chunked, or
  read-to-close bodies, a body size cap, a header size cap.
"""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

MAX_HEADER = 64 * 1024
_RECV = 65536


class HttpError(Exception):
    def __init__(self, reason: str, text: str, idle_close: bool = False) -> None:
        super().__init__(text)
        self.reason = reason
        self.idle_close = idle_close


class Response:
    """Incremental parser of one HTTP/1.x response (pure). :meth:`feed` returns
    ``(status, body)`` once the answer is complete, None while more bytes are needed."""

    __slots__ = ("max_body", "buf", "status", "body_start", "length", "chunked", "keep_alive")

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.buf = bytearray()  # used only when an answer arrives in several pieces
        self.status = 0
        self.body_start = -1
        self.length: int | None = None
        self.chunked = False
        self.keep_alive = True

    def feed(self, data: bytes) -> tuple[int, bytes] | None:
        if self.buf:
            self.buf += data
            view: bytes | bytearray = self.buf
        else:
            view = data  # the common case: the whole answer in one read, no copy
        out = self._parse(view)
        if out is None and view is data:
            self.buf += data
        return out

    def received(self) -> int:
        return len(self.buf)

    def eof(self) -> tuple[int, bytes]:
        """The peer closed the connection: a read-to-close body ends here; else an error."""
        if self.body_start >= 0 and self.length is None and not self.chunked:
            return self.status, bytes(self.buf[self.body_start :])
        raise HttpError("connect", "connection closed by peer (EOF)")

    def _head(self, view: bytes | bytearray) -> bool:
        end = view.find(b"\r\n\r\n")
        if end < 0:
            if len(view) > MAX_HEADER:
                raise HttpError("http", "response header too large")
            return False
        head = bytes(view[:end])
        if head.startswith(b"HTTP/1.1 "):  # the usual answer: a few C-level searches
            low = head.lower()
            i = low.find(b"\r\ncontent-length:")
            if i > 0 and b"\r\ntransfer-encoding:" not in low and b"\r\nconnection:" not in low:
                j = low.find(b"\r\n", i + 17)
                try:
                    self.status = int(head[9:12])
                    self.length = int(low[i + 17 : j if j > 0 else len(low)])
                except ValueError:
                    pass  # the general parser below says what is wrong
                else:
                    if self.length < 0:
                        raise HttpError("http", "bad Content-Length")
                    self.keep_alive = True
                    self.body_start = end + 4
                    if self.length > self.max_body:
                        raise HttpError("too_large", f"metrics body over {self.max_body} bytes")
                    return True
                self.length = None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HttpError("http", f"not an HTTP/1.x response: {lines[0][:80]!r}")
        try:
            self.status = int(parts[1])
        except ValueError:
            raise HttpError("http", f"bad status line {lines[0][:80]!r}") from None
        self.keep_alive = parts[0] == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                try:
                    self.length = int(value.strip())
                except ValueError:
                    raise HttpError("http", "bad Content-Length") from None
            elif name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "connection":
                v = value.strip().lower()
                self.keep_alive = v == "keep-alive" or (self.keep_alive and v != "close")
        self.body_start = end + 4
        if self.length is not None and self.length > self.max_body:
            raise HttpError("too_large", f"metrics body over {self.max_body} bytes")
        return True

    def _parse(self, view: bytes | bytearray) -> tuple[int, bytes] | None:
        if self.body_start < 0 and not self._head(view):
            return None
        start = self.body_start
        if self.chunked:
            # the last chunk (and any trailers) end with a blank line: try only then
            if not view.endswith(b"\r\n\r\n"):
                if len(view) - start > self.max_body + 4096:
                    raise HttpError("too_large", f"metrics body over {self.max_body} bytes")
                return None
            body = self._dechunk(view)
            if body is None:
                return None
        elif self.length is not None:
            stop = start + self.length
            if len(view) < stop:
                return None
            if len(view) > stop:  # bytes after the answer: the stream cannot be trusted
                self.keep_alive = False
            body = bytes(view[start:stop])
        else:
            if len(view) - start > self.max_body:
                raise HttpError("too_large", f"metrics body over {self.max_body} bytes")
            return None  # read to close
        return self.status, body

    def _dechunk(self, view: bytes | bytearray) -> bytes | None:
        pos = self.body_start
        out = bytearray()
        while True:
            eol = view.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(view[pos:eol]).split(b";", 1)[0], 16)
            except ValueError:
                raise HttpError("http", "bad chunk size") from None
            if size == 0:
                end = view.find(b"\r\n\r\n", eol)
                if end < 0:
                    return None
                if end + 4 != len(view):
                    self.keep_alive = False
                return bytes(out)
            start, stop = eol + 2, eol + 2 + size
            if len(view) < stop + 2:
                return None
            out += view[start:stop]
            if len(out) > self.max_body:
                raise HttpError("too_large", f"metrics body over {self.max_body} bytes")
            pos = stop + 2


def request_bytes(url: str) -> tuple[tuple[str, int], bytes]:
    """((host, port), the GET request) for an ``http://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are scraped this way, not {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rsplit("@", 1)[-1]
    req = (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: kvgate-telemetry\r\n"
        "Accept: text/plain\r\nAccept-Encoding: identity\r\n\r\n"
    ).encode("latin-1")
    return (parts.hostname, parts.port or 80), req


class Conn:
    """One kept-alive connection. :meth:`send` writes a request; the answer is then read by
    :meth:`poll` (non-blocking, no wake-up) or awaited with :meth:`wait` (reader callback)."""

    def __init__(self, sock: socket.socket, max_body: int, addr: tuple[str, int] = ("", 0)) -> None:
        self.sock = sock
        self.addr = addr  # (host, port) as asked for: a request for another is not sent here
        self.fd = sock.fileno()
        self.max_body = max_body
        self.resp: Response | None = None  # the answer being read (None: idle)
        self.sent_at = 0.0  # time.monotonic() of the last send
        self.served = 0  # answers completed on this connection
        self.closed = False
        self._reader: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def open(cls, host: str, port: int, timeout: float, max_body: int = 8 << 20) -> Conn:
        """Connect (non-blocking) within ``timeout``; ``HttpError('connect')`` on failure."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                last: OSError | None = None
                for family, type_, proto, _, addr in infos:
                    sock = socket.socket(family, type_, proto)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, addr)
                    except OSError as exc:
                        sock.close()
                        last = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return cls(sock, max_body, (host, port))
        except TimeoutError:
            raise HttpError("connect", f"cannot connect: timed out after {timeout:g} s") from None
        except OSError as exc:
            raise HttpError("connect", f"cannot connect: {exc}") from None
        raise HttpError("connect", f"cannot connect: {last or 'no address'}")

    def send(self, req: bytes) -> None:
        """Write ``req`` (the connection must be idle). An idle kept-alive connection's send
        buffer is empty, so a request of a few hundred bytes goes out whole; anything else is
        an error and closes the connection."""
        if self.closed or self.resp is not None:
            raise HttpError("connect", "connection closed or busy")
        self.resp = Response(self.max_body)
        self.sent_at = time.monotonic()
        try:
            n = self.sock.send(req)
        except OSError:
            self.close()
            raise
        if n != len(req):
            self.close()
            raise HttpError("connect", "request not written whole")

    def poll(self) -> tuple[int, bytes] | None:
        """Read what has arrived without waiting: ``(status, body)`` once the answer is
        complete, None while it is not. Raises (and closes) on EOF, errors, bad answers."""
        resp = self.resp
        if resp is None:
            raise HttpError("connect", "no request in flight")
        sock = self.sock
        try:
            while True:
                try:
                    data = sock.recv(_RECV)
                except BlockingIOError:
                    return None
                except ConnectionError as exc:  # reset by the peer
                    idle = self.served > 0 and resp.received() == 0
                    raise HttpError("connect", f"connection lost: {exc}", idle) from None
                if not data:
                    idle = self.served > 0 and resp.received() == 0
                    try:
                        out = resp.eof()
                    except HttpError as exc:
                        exc.idle_close = idle
                        raise
                    self.resp = None
                    self.close()
                    return out
                out = resp.feed(data)
                if out is not None:
                    self.resp = None
                    self.served += 1
                    if not resp.keep_alive:
                        self.close()
                    return out
        except BaseException:
            self.close()
            raise

    async def wait(self, timeout: float) -> tuple[int, bytes]:
        """The answer to the request in flight, read as the event loop sees it arrive."""
        out = self.poll()
        if out is not None:
            return out
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()

        def readable() -> None:
            if fut.done():
                return
            try:
                got = self.poll()
            except BaseException as exc:  # poll closed the connection (and the reader)
                fut.set_exception(exc)
                return
            if got is not None:
                fut.set_result(got)

        self._reader = loop
        loop.add_reader(self.fd, readable)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            self.close()
            raise TimeoutError("scrape timed out") from None
        except BaseException:
            self.close()  # cancelled: the answer can no longer be matched to a request
            raise
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        loop, self._reader = self._reader, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._unwatch()
        self.sock.close()
