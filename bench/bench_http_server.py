"""What the router's HTTP server front-end costs, alternatives side by side in one run.

Each front-end runs in its own process (uvloop, as the router) and answers
``POST /v1/completions`` with the same small JSON after reading the request body; one load
generator (aiohttp, 64 kept-alive connections, as ``bench_router proxy``) drives each in
turn. Printed: requests per second and the server process's CPU per request (``/proc``, user
+ system). No routing: only what serving HTTP costs.

- ``aiohttp-app``: ``web.Application`` with one middleware (the router's public port before);
- ``aiohttp-server``: aiohttp's low-level ``web.Server`` (no application, router, middleware);
- ``kvgate``: the router's own server, ``services.router.http_server`` (httptools parser,
  the router's public surface: API-key and body-limit checks);
- ``hand``: a hand-written Content-Length-only parser, no checks (a lower bound, not a server).

    python -m bench.bench_http_server --runs 3 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":"hello","finish_reason":"length"}],"usage":{"prompt_tokens":5,'
    b'"completion_tokens":1,"total_tokens":6}}'
)
REQUEST = b'{"model":"m","prompt":"hello there","max_tokens":1}'
HEADERS = {"x-kvgate-worker": "w0", "x-request-id": "r1"}
KINDS = ("aiohttp-app", "aiohttp-server", "kvgate", "hand")


def serve(kind: str, port: int) -> None:
    import uvloop

    uvloop.install()
    asyncio.run(_serve(kind, port))


async def _serve(kind: str, port: int) -> None:
    if kind.startswith("aiohttp"):
        from aiohttp import web

        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=ANSWER, content_type="application/json", headers=HEADERS)

        if kind == "aiohttp-app":

            @web.middleware
            async def guard(request: web.Request, handler):  # type: ignore[no-untyped-def]
                return await handler(request)

            app = web.Application(middlewares=[guard])
            app.router.add_post("/v1/completions", handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        else:
            srv = web.Server(handler, access_log=None)
            await asyncio.get_running_loop().create_server(srv, "127.0.0.1", port)
    elif kind == "kvgate":
        from services.router.http_server import Request, Response, Routes, Server
        from services.router.public_surface import ApiKeys, PublicSurface

        async def answer(request: Request) -> Response:
            await request.read()
            return Response(ANSWER, 200, {**HEADERS, "Content-Type": "application/json"})

        routes = Routes()
        routes.add("POST", "/v1/completions", answer)
        await Server(routes, PublicSurface(4 << 20, ApiKeys([]))).start("127.0.0.1", port)
    else:
        await asyncio.get_running_loop().create_server(_Hand, "127.0.0.1", port)
    await asyncio.Event().wait()


class _Hand(asyncio.Protocol):
    """Requests framed by Content-Length only; nothing checked."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while (i := buf.find(b"\r\n\r\n")) >= 0:
            n = 0
            for line in buf[:i].split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.lower() == b"content-length":
                    n = int(v)
            if len(buf) < i + 4 + n:
                break
            buf = buf[i + 4 + n :]
            asyncio.get_running_loop().create_task(self.answer())
        self.buf = buf

    async def answer(self) -> None:
        head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items()).encode()
        self.t.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
            % (head, len(ANSWER))
            + ANSWER
        )


def _cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    f = stat[stat.rindex(")") + 2 :].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, conns: int, seconds: float) -> int:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    done = 0
    stop_at = time.monotonic() + seconds

    async def loop(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            async with s.post(url, data=REQUEST, headers={"Content-Type": "application/json"}) as r:
                body = await r.read()
                assert r.status == 200 and body == ANSWER, (r.status, body[:80])
                done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as s:
        await asyncio.gather(*(loop(s) for _ in range(conns)))
    return done


async def _ready(port: int) -> None:
    for _ in range(100):
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)  # the server process is starting
    raise RuntimeError(f"server on {port} did not start")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_http_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--runs", type=int, default=3, help="rounds over every front-end")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per front-end")
    ap.add_argument("--conns", type=int, default=64, help="kept-alive client connections")
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve(a.serve, a.port)
        return 0
    print(f"load average {os.getloadavg()[0]:.2f}")
    for run in range(1, a.runs + 1):
        for kind in KINDS:
            port = _free_port()
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.bench_http_server",
                    "--serve",
                    kind,
                    "--port",
                    str(port),
                ]
            )
            try:
                asyncio.run(_ready(port))
                asyncio.run(_load(port, a.conns, 1.0))  # warm up, connections open
                c0 = _cpu_s(p.pid)
                t0 = time.monotonic()
                n = asyncio.run(_load(port, a.conns, a.seconds))
                el = time.monotonic() - t0
                cpu_us = (_cpu_s(p.pid) - c0) / max(1, n) * 1e6
                print(
                    f"run {run}  {kind:15s} {n / el:8,.0f} req/s   server CPU {cpu_us:5.1f} us/request",
                    flush=True,
                )
            finally:
                p.terminate()
                p.wait(10)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
