"""A minimal HTTP/1.1 keep-alive client for non-streaming upstream calls (the hot path).

aiohttp's client is general (cookies, redirects, multipart, tracing) and costs more per call
than the whole routing decision; an engine answering a completion needs none of that. This
client writes one request, reads one response (Content-Length or chunked) and keeps the
connection for the next request. Streaming responses still go through aiohttp.

Invariants:
- a connection is reused only after its previous response was read completely and neither
  side asked to close it;
- a request that fails on a *reused* connection before any response byte (the server closed
  an idle keep-alive connection) is retried once on a fresh connection; any other failure
  raises :class:`UpstreamError` (``connect`` / ``timeout`` / ``broken``) and the connection is
  dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

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


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class FastClient:
    def __init__(self, connect_timeout: float = 2.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            host, port = u.hostname or "127.0.0.1", u.port or 80
            t = self._targets[base_url] = (host, port, f"{host}:{port}".encode())
        return t

    async def close(self) -> None:
        for conns in self._idle.values():
            for _r, w in conns:
                w.close()
        self._idle.clear()

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float
    ) -> Response:
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
            conn = idle.pop() if idle else None
            reused = conn is not None
            if conn is None:
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        conn = await asyncio.open_connection(host, port)
                except TimeoutError as exc:
                    raise UpstreamError("connect", "connect timeout") from exc
                except OSError as exc:
                    raise UpstreamError("connect", f"{type(exc).__name__}: {exc}") from exc
            reader, writer = conn
            got_bytes = False
            try:
                writer.write(head + body)
                async with asyncio.timeout(timeout):
                    raw_head = await reader.readuntil(b"\r\n\r\n")
                    got_bytes = True
                    resp, keep = await _read_rest(reader, raw_head)
            except TimeoutError as exc:
                writer.close()
                raise UpstreamError("timeout", "no complete response in time") from exc
            except (
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ConnectionError,
                OSError,
            ) as exc:
                writer.close()
                if reused and not got_bytes and attempt == 0:
                    continue  # the server closed an idle keep-alive connection
                raise UpstreamError("broken", type(exc).__name__) from exc
            except ValueError as exc:
                writer.close()
                raise UpstreamError("broken", f"bad response: {exc}") from exc
            if keep:
                lst = self._idle.setdefault(key, [])
                if len(lst) < MAX_IDLE_PER_HOST:
                    lst.append(conn)
                else:
                    writer.close()
            else:
                writer.close()
            return resp
        raise UpstreamError("broken", "connection closed")  # pragma: no cover


async def _read_rest(reader: asyncio.StreamReader, raw_head: bytes) -> tuple[Response, bool]:
    lines = raw_head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        n = int(headers["content-length"])
        body = await reader.readexactly(n) if n else b""
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                # trailers (usually none) end with an empty line
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            chunks.append((await reader.readexactly(size + 2))[:-2])
        body = b"".join(chunks)
    elif status in (204, 304) or 100 <= status < 200:
        body = b""
    else:
        body = await reader.read()
        keep = False
    return Response(status, headers, body), keep
