"""Sending: one attempt of one request on one worker, and the response back to the client.

Non-streaming requests over plain HTTP take the kept-alive fast path (``upstream.FastClient``);
others go through aiohttp. A streaming response is pumped event by event (``sse``).

Invariants: a failure before the client saw anything raises :class:`WorkerFailed` (the
request path retries elsewhere); a failure after output raises :class:`StreamBroken`, handled
here by the migrator (the client's stream continues elsewhere); 5xx other than 503 is passed
through and counted against the worker's breaker; a complete answer counts as a breaker
success; the first token (or the whole answer) is reported to the dispatcher exactly once.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from services.core.cluster import ClusterState, Ticket
from services.router import sse
from services.router.circuits import Circuits
from services.router.dispatch import Dispatcher
from services.router.proxy import (
    ClientGone,
    Ctx,
    StreamBroken,
    Upstream5xx,
    WorkerFailed,
    error_response,
    read_error,
    upstream_body,
    worker_headers,
    write,
)
from services.router.upstream import FastClient, UpstreamError
from services.router.usage import continued_usage

_json_decode = msgspec.json.decode


class StreamMigrator(Protocol):
    async def migrate(self, request: web.Request, ctx: Ctx, exc: StreamBroken) -> None: ...


class Sender:
    def __init__(
        self,
        state: ClusterState,
        circuits: Circuits,
        dispatcher: Dispatcher,
        fast: FastClient,
        st: Any,
    ) -> None:
        self.state = state
        self.circuits = circuits
        self.dispatcher = dispatcher
        self.fast = fast
        self.request_timeout_s = st.request_timeout
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=st.connect_timeout, sock_read=st.stream_idle_timeout
        )
        self.whole_timeout = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )
        self.session: aiohttp.ClientSession | None = None  # set by the router at start
        self.migrator: StreamMigrator | None = None  # set by the router (migrate.Migrator)

    async def send(self, request: web.Request, ctx: Ctx, ticket: Ticket) -> web.StreamResponse:
        wid = ticket.worker_id
        raw_body = upstream_body(ctx, migrate=False)
        if not ctx.parsed.stream and self.state.states[wid].url.startswith("http://"):
            return await self._send_fast(ctx, wid, raw_body or await request.read(), ticket)
        try:
            resp = await self.post(ctx, wid, ctx.path, raw_body, await request.read())
        except Upstream5xx as exc:
            ctx.status, ctx.http_status = "error", exc.status
            return error_response(
                exc.status,
                f"worker {wid} failed: {exc.detail}",
                "upstream_error",
                worker_headers(ctx, wid),
            )
        if not ctx.parsed.stream or resp.status != 200:
            return await self._send_whole(ctx, wid, resp, ticket)
        return await self._send_stream(request, ctx, wid, resp, ticket)

    async def post(
        self, ctx: Ctx, wid: str, path: str, body: bytes, raw: bytes
    ) -> aiohttp.ClientResponse:
        """Open the upstream request; connect errors, timeouts and 503 raise WorkerFailed."""
        assert self.session is not None
        url = self.state.states[wid].url + path
        timeout = self.stream_timeout if ctx.parsed.stream else self.whole_timeout
        try:
            resp = await self.session.post(
                url,
                data=body or raw,
                headers={"Content-Type": "application/json", "x-request-id": ctx.request_id},
                timeout=timeout,
            )
        except TimeoutError as exc:
            raise WorkerFailed(wid, "timeout before response", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise WorkerFailed(wid, f"connect failed: {type(exc).__name__}") from exc
        if resp.status == 503 or resp.status >= 500:
            detail = (await read_error(resp))[:200].decode("utf-8", "replace")
            resp.release()
            if resp.status == 503:
                raise WorkerFailed(wid, f"503 from worker: {detail}")
            # other 5xx: counts against the breaker, passed through to the client
            self.circuits.failure(wid, f"{resp.status} from worker", ctx.sent_at)
            raise Upstream5xx(resp.status, detail)
        return resp

    async def _send_fast(self, ctx: Ctx, wid: str, body: bytes, ticket: Ticket) -> web.Response:
        """Non-streaming: one request / response on a kept-alive connection (upstream.py)."""
        try:
            resp = await self.fast.post(
                self.state.states[wid].url,
                ctx.path,
                body,
                {"x-request-id": ctx.request_id},
                self.request_timeout_s,
            )
        except UpstreamError as exc:
            if exc.kind == "timeout":
                raise WorkerFailed(wid, "timeout before response", timeout=True) from exc
            if exc.kind == "connect":
                raise WorkerFailed(wid, f"connect failed: {exc.detail}") from exc
            raise WorkerFailed(wid, f"response broken: {exc.detail}") from exc
        status = resp.status
        if status == 503:
            raise WorkerFailed(
                wid, f"503 from worker: {resp.body[:200].decode('utf-8', 'replace')}"
            )
        if status >= 500:
            self.circuits.failure(wid, f"{status} from worker", ctx.sent_at)
            ctx.status = "error"
        else:
            self.circuits.success(wid, ctx.sent_at)
            if status >= 400:
                ctx.status = "error"
        self.dispatcher.first_token(ctx, ticket)
        ctx.http_status = status
        if status < 400:
            _read_usage(ctx, resp.body)
        headers = worker_headers(ctx, wid)
        headers["Content-Type"] = resp.headers.get("content-type", "application/json")
        return web.Response(body=resp.body, status=status, headers=headers)

    async def _send_whole(
        self, ctx: Ctx, wid: str, resp: aiohttp.ClientResponse, ticket: Ticket
    ) -> web.Response:
        try:
            data = await resp.read()
        except TimeoutError as exc:
            raise WorkerFailed(wid, "timeout reading response", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise WorkerFailed(wid, f"response broken: {type(exc).__name__}") from exc
        finally:
            resp.release()
        self.dispatcher.first_token(ctx, ticket)
        self.circuits.success(wid, ctx.sent_at)
        ctx.http_status = resp.status
        if resp.status >= 400:
            ctx.status = "error"
        else:
            _read_usage(ctx, data)
        headers = worker_headers(ctx, wid)
        return web.Response(
            body=data,
            status=resp.status,
            headers={
                **headers,
                "Content-Type": resp.headers.get("Content-Type", "application/json"),
            },
        )

    async def _send_stream(
        self, request: web.Request, ctx: Ctx, wid: str, resp: aiohttp.ClientResponse, ticket: Ticket
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=200,
            headers={
                **worker_headers(ctx, wid),
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            },
        )
        ctx.out = out
        try:
            await self.pump(request, ctx, wid, resp, ticket, reframe=False)
        except StreamBroken as exc:
            assert self.migrator is not None
            await self.migrator.migrate(request, ctx, exc)
        except ClientGone:
            ctx.status, ctx.http_status = "cancelled", 499
        return out

    async def pump(
        self,
        request: web.Request,
        ctx: Ctx,
        wid: str,
        resp: aiohttp.ClientResponse,
        ticket: Ticket,
        reframe: bool,
    ) -> None:
        """Copy SSE events from the worker to the client until [DONE]."""
        out = ctx.out
        assert out is not None
        chat = ctx.parsed.chat
        buf: list[bytes] = []
        seen_done = False
        try:
            async for line in resp.content:
                if line.strip():
                    buf.append(line)
                    continue
                if not buf:
                    continue
                event = b"".join(buf) + b"\n"
                buf = []
                payload = b"".join(
                    ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")
                )
                info = sse.inspect(payload, chat if not reframe else False)
                if info.done:
                    seen_done = True
                    if not out.prepared:
                        await out.prepare(request)
                    await write(out, sse.DONE)
                    break
                if info.usage is not None:
                    if reframe:  # a continuation: usage as if one worker did it all
                        info.usage = continued_usage(info.usage, ctx.carried_tokens)
                        if info.data is not None and "usage" in info.data:
                            info.data = {**info.data, "usage": info.usage}
                    ctx.cached_reported = sse.cached_tokens_of(info.usage)
                    if isinstance(info.usage.get("completion_tokens"), int):
                        ctx.completion_tokens = info.usage["completion_tokens"]
                if info.usage_only and not ctx.client_wants_usage:
                    continue
                if info.text and ctx.ttft is None:
                    ctx.ttft = time.perf_counter() - ctx.t0
                if info.text:
                    self.dispatcher.first_token(ctx, ticket)
                ctx.generated += info.text
                if reframe:
                    chunk = sse.as_client_chunk(info, chat, ctx.template)
                    if chunk is None:
                        continue
                    event = sse.event(chunk)
                elif ctx.template is None and info.data is not None:
                    ctx.template = info.data
                if not out.prepared:
                    await out.prepare(request)
                await write(out, event)
        except TimeoutError as exc:
            resp.release()
            if not out.prepared:
                raise WorkerFailed(wid, "stream stalled before output", timeout=True) from exc
            raise StreamBroken(wid, "stream stalled") from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
            resp.release()
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                raise
            if not out.prepared:
                raise WorkerFailed(
                    wid, f"stream broken before output: {type(exc).__name__}"
                ) from exc
            raise StreamBroken(wid, f"stream broken: {type(exc).__name__}") from exc
        resp.release()
        if not seen_done:
            if not out.prepared:
                raise WorkerFailed(wid, "stream ended before output")
            raise StreamBroken(wid, "stream ended without [DONE]")
        self.circuits.success(wid, ctx.sent_at)
        await out.write_eof()


def _read_usage(ctx: Ctx, body: bytes) -> None:
    """Completion and cached tokens from a whole response's ``usage`` (best effort)."""
    try:
        usage = _json_decode(body).get("usage") or {}
        ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
        ctx.cached_reported = sse.cached_tokens_of(usage)
    except Exception:
        pass
