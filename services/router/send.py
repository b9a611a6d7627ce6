"""Sending: one attempt of one request on one worker, and the response back to the client.

Requests to plain-http workers take the kept-alive client (``upstream.FastClient``: whole
responses and streams); others go through aiohttp. A streaming response is pumped event by
event (``sse``).

Invariants: a failure before the client saw anything raises :class:`WorkerFailed` (the
request path retries elsewhere); a failure after output raises :class:`StreamBroken`, handled
here by the migrator (the client's stream continues elsewhere), a stream silent past its stall
bound after its first token (:mod:`services.router.stall`) included; 5xx other than 503 is passed
through and counted against the worker's breaker; a complete answer counts as a breaker
success; the first token (or the whole answer) is reported to the dispatcher exactly once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn, Protocol

import aiohttp
import msgspec

from services.common.logging import get_logger
from services.core.cluster import ClusterState, Ticket
from services.router import metrics as M
from services.router import sse
from services.router.circuits import Circuits
from services.router.dispatch import Dispatcher
from services.router.http_server import Reply, Request, Response, StreamResponse
from services.router.proxy import (
    ClientGone,
    Ctx,
    StreamBroken,
    Upstream5xx,
    WorkerFailed,
    error_response,
    read_error,
    upstream_body,
    upstream_headers,
    worker_headers,
    write,
)
from services.router.stall import StallBound
from services.router.upstream import FastClient, Stream, UpstreamError
from services.router.usage import continued_usage, read_usage, take_usage

_decode_obj = msgspec.json.decode


def with_fields(body: bytes, fields: dict[str, Any]) -> bytes:
    """A JSON object's bytes with ``fields`` set (the decode request's P/D handshake)."""
    obj = _decode_obj(body)
    obj.update(fields)
    return msgspec.json.encode(obj)


log = get_logger("router")


Upstream = Stream | aiohttp.ClientResponse  # an opened upstream response
MAX_EVENT_BYTES = 4 << 20  # one SSE event larger than this: the stream is broken


class StreamMigrator(Protocol):
    async def migrate(self, request: Request, ctx: Ctx, exc: StreamBroken) -> None: ...


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
        self.stream_idle_s = st.stream_idle_timeout
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=st.connect_timeout, sock_read=st.stream_idle_timeout
        )
        self.whole_timeout = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )
        self.session: aiohttp.ClientSession | None = None  # set by the router at start
        self.migrator: StreamMigrator | None = None  # set by the router (migrate.Migrator)
        # streams keep their text only when a broken one can continue elsewhere
        self.keep_text = getattr(st, "max_migrations", 1) > 0
        self.stall = StallBound.from_settings(st)

    def url_of(self, wid: str) -> str:
        s = self.state.states.get(wid)
        return s.url if s is not None else ""

    async def send(self, request: Request, ctx: Ctx, ticket: Ticket) -> Reply:
        wid = ticket.worker_id
        raw = await request.read()  # aiohttp keeps the bytes it read: no second read
        body = upstream_body(ctx, migrate=False, raw=raw)
        if ctx.pd_fields:  # the decode half of a P/D request: the handshake's fields
            body = with_fields(body or raw, ctx.pd_fields)
        if ctx.engine_priority is not None:  # --engine-priority: the engine's queue order
            body = with_fields(body or raw, {"priority": ctx.engine_priority})
        if not ctx.parsed.stream and self.state.states[wid].url.startswith("http://"):
            return await self._send_fast(ctx, wid, body or raw, ticket)
        try:
            resp = await self.post(ctx, wid, ctx.path, body, raw)
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

    async def post(self, ctx: Ctx, wid: str, path: str, body: bytes, raw: bytes) -> Upstream:
        """Open the upstream request (streams to plain-http workers on the fast client,
        others through aiohttp); connect errors, timeouts and 503 raise WorkerFailed."""
        base = self.state.states[wid].url
        if ctx.parsed.stream and base.startswith("http://"):
            return await self._open_stream(ctx, wid, base, path, body or raw)
        assert self.session is not None
        url = base + path
        timeout = self.stream_timeout if ctx.parsed.stream else self.whole_timeout
        try:
            resp = await self.session.post(
                url,
                data=body or raw,
                headers={"Content-Type": "application/json", **upstream_headers(ctx)},
                timeout=timeout,
            )
        except TimeoutError as exc:
            raise WorkerFailed(wid, "timeout before response", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise WorkerFailed(wid, f"connect failed: {type(exc).__name__}") from exc
        if ctx.trace is not None:
            ctx.trace.connected()
        if resp.status >= 500:
            await self._refuse_5xx(ctx, wid, resp)
        return resp

    async def _refuse_5xx(self, ctx: Ctx, wid: str, resp: Any) -> NoReturn:
        """A worker answered 5xx before any output: 503 is a retryable worker failure; any
        other 5xx counts against the breaker and is passed through to the client."""
        detail = (await read_error(resp))[:200].decode("utf-8", "replace")
        resp.release()
        if resp.status == 503:
            raise WorkerFailed(wid, f"503 from worker: {detail}")
        self.circuits.failure(wid, f"{resp.status} from worker", ctx.sent_at)
        raise Upstream5xx(resp.status, detail)

    async def _open_stream(self, ctx: Ctx, wid: str, base: str, path: str, body: bytes) -> Stream:
        """A stream over plain http (upstream.FastClient): errors as :meth:`post`'s."""
        try:
            resp = await self.fast.open_stream(
                base, path, body, upstream_headers(ctx), self.stream_idle_s
            )
        except UpstreamError as exc:
            raise _worker_failed(wid, exc) from exc
        if ctx.trace is not None:
            ctx.trace.connected()
        if resp.status >= 500:
            await self._refuse_5xx(ctx, wid, resp)
        return resp

    async def _send_fast(self, ctx: Ctx, wid: str, body: bytes, ticket: Ticket) -> Response:
        """Non-streaming: one request / response on a kept-alive connection (upstream.py)."""
        try:
            resp = await self.fast.post(
                self.state.states[wid].url,
                ctx.path,
                body,
                upstream_headers(ctx),
                self.request_timeout_s,
            )
        except UpstreamError as exc:
            raise _worker_failed(wid, exc) from exc
        if ctx.trace is not None:
            ctx.trace.connected()
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
            read_usage(ctx, resp.body)
        headers = worker_headers(ctx, wid)
        headers["Content-Type"] = resp.headers.get("content-type", "application/json")
        return Response(resp.body, status, headers)

    async def _send_whole(self, ctx: Ctx, wid: str, resp: Upstream, ticket: Ticket) -> Response:
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
            read_usage(ctx, data)
        headers = worker_headers(ctx, wid)
        return Response(
            data,
            resp.status,
            {
                **headers,
                "Content-Type": resp.headers.get("content-type", "application/json"),
            },
        )

    async def _send_stream(
        self, request: Request, ctx: Ctx, wid: str, resp: Upstream, ticket: Ticket
    ) -> Reply:
        out = StreamResponse(
            status=200,
            headers={
                **worker_headers(ctx, wid),
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            },
        )
        # (the headers leave with the first output, not in a write of their own)
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
        request: Request,
        ctx: Ctx,
        wid: str,
        resp: Upstream,
        ticket: Ticket,
        reframe: bool,
    ) -> None:
        """Copy SSE events from the worker to the client until [DONE]: what one read brought
        goes out in one write; events are decoded only as far as the router needs
        (:mod:`services.router.sse`)."""
        out = ctx.out
        assert out is not None
        chat = ctx.parsed.chat
        # the text is kept only where a migration may need it
        keep_text = reframe or (ctx.parsed.migratable and self.keep_text)
        rest = last = b""
        seen_done = False
        first_seen = False  # this attempt's first token (a continuation has its own ticket)
        # past the first token: the longest silence before the stream counts as stalled
        # (None: the idle timeout, until the first token or with stall detection off)
        stall_s: float | None = None
        try:
            while not seen_done:
                if stall_s is None or isinstance(resp, Stream):
                    data = await resp.content.readany()
                else:  # aiohttp (https workers): its read timeout is the idle timeout
                    async with asyncio.timeout(stall_s):
                        data = await resp.content.readany()
                if not data:
                    break
                buf = rest + data if rest else data
                outgoing: list[bytes] = []
                if first_seen and not reframe and ctx.template is not None:
                    # past the first token: the leading events that need no look go out as
                    # they came, in one piece; the rest event by event
                    run, events, rest = sse.passthrough_split(buf)
                    if run:
                        if keep_text:
                            ctx.text_parts.append(run)
                        ctx.chunks += sse.data_events(run)
                        outgoing.append(run)
                else:
                    events, rest = sse.split_events(buf)
                if len(rest) > MAX_EVENT_BYTES:
                    raise aiohttp.ClientPayloadError(f"SSE event over {MAX_EVENT_BYTES} bytes")
                for ev in events:
                    payload = sse.payload_of(ev)
                    if payload == b"[DONE]":
                        seen_done = True
                        outgoing.append(sse.DONE)
                        break
                    if (
                        first_seen
                        and not reframe
                        and ctx.template is not None
                        and not sse.has_usage(payload)
                    ):
                        # the common chunk: passed through; its bytes kept for its text,
                        # decoded only if a migration needs it (ctx.generated)
                        wire = ev + b"\n\n"
                        if keep_text:
                            ctx.text_parts.append(wire)
                        if payload:
                            ctx.chunks += 1
                        outgoing.append(wire)
                        continue
                    wire, text = self._inspected(ctx, ev, payload, chat, reframe)
                    if text and not first_seen:
                        first_seen = True
                        self.dispatcher.first_token(ctx, ticket)
                        stall_s = self._stall_bound(ctx, wid)
                        if stall_s is not None and isinstance(resp, Stream):
                            resp.idle_timeout = stall_s  # read by each wait from now on
                    if wire is not None:
                        outgoing.append(wire)
                if outgoing:
                    if not out.prepared:
                        await out.prepare(request)
                    last = outgoing[0] if len(outgoing) == 1 else b"".join(outgoing)
                    if seen_done:  # the last output and the end of the stream in one write
                        break
                    await write(out, last)
        except TimeoutError as exc:
            if not out.prepared:
                resp.release()
                raise WorkerFailed(wid, "stream stalled before output", timeout=True) from exc
            # closed, not parked: a hung engine that wakes stops generating for nobody
            resp.close()
            raise self._stalled(ctx, wid, stall_s) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
            resp.release()
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                raise
            if not out.prepared:
                raise WorkerFailed(
                    wid, f"stream broken before output: {type(exc).__name__}"
                ) from exc
            raise StreamBroken(wid, f"stream broken: {type(exc).__name__}") from exc
        except BaseException:  # the client left (ClientGone, cancelled): stop the worker too
            resp.close()
            raise
        resp.release()
        if not seen_done:
            if not out.prepared:
                raise WorkerFailed(wid, "stream ended before output")
            raise StreamBroken(wid, "stream ended without [DONE]")
        self.circuits.success(wid, ctx.sent_at)
        ended_at = time.perf_counter()
        try:
            await out.write_eof(last)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
            raise ClientGone() from exc
        finally:
            # the policy's decode observation once the client has its last bytes: a model
            # update is not on the client's wait
            if not reframe and not ctx.migrated:
                self.dispatcher.decoded(ctx, ticket, ended_at)

    def _stall_bound(self, ctx: Ctx, wid: str) -> float | None:
        """The stall bound of ``wid``'s stream now that its first token is out (None: no
        tighter than the idle timeout)."""
        if not self.stall.enabled:
            return None
        bound = self.stall.bound_s(ctx.arm.policy, wid, *self._decode_load(ctx, wid))
        return bound if bound < self.stall.idle_s else None

    def _decode_load(self, ctx: Ctx, wid: str) -> tuple[int, float]:
        """The sequences in flight on ``wid`` (this one included) and this request's mean
        context over its decode (what the latency model predicts a step from)."""
        s = self.state.states.get(wid)
        p = ctx.parsed
        return (s.inflight if s is not None else 1), len(p.token_ids) + p.max_tokens / 2.0

    def _stalled(self, ctx: Ctx, wid: str, stall_s: float | None) -> StreamBroken:
        """A stream silent past its bound after output: counted, logged, broken (migrates)."""
        kind = "predicted" if stall_s is not None else "idle_timeout"
        bound = stall_s if stall_s is not None else self.stall.idle_s
        M.child(M.STREAM_STALLS, kind).inc()
        gap, _ = self.stall.gaps_s(ctx.arm.policy, wid, *self._decode_load(ctx, wid))
        log.warning(
            "stream stalled",
            request_id=ctx.request_id,
            worker=wid,
            bound=kind,
            silent_s=round(bound, 3),
            predicted_itl_ms=round(gap * 1000.0, 2),
            chunks=ctx.chunks,
        )
        return StreamBroken(
            wid,
            f"stream stalled: no token for {bound:.1f} s"
            + (f" ({self.stall.factor:g} x predicted {gap * 1000:.0f} ms)" if stall_s else ""),
        )

    def _inspected(
        self, ctx: Ctx, ev: bytes, payload: bytes, chat: bool, reframe: bool
    ) -> tuple[bytes | None, bool]:
        """One event decoded whole (before the first token, a usage chunk, a continuation's
        chunk): what the router learns from it; the bytes the client gets (None: none) and
        whether it carried text."""
        info = sse.inspect(payload, chat if not reframe else False)
        if info.usage is not None:
            if reframe:  # a continuation: usage as if one worker did it all
                info.usage = continued_usage(info.usage, ctx.carried_tokens)
                if info.data is not None and "usage" in info.data:
                    info.data = {**info.data, "usage": info.usage}
            take_usage(ctx, info.usage)
        if info.usage_only and not ctx.client_wants_usage:
            return None, False
        if info.text:
            if ctx.ttft is None:
                ctx.ttft = time.perf_counter() - ctx.t0
            ctx.text_parts.append(info.text)
        if not info.usage_only and info.data is not None:
            ctx.chunks += 1
        if reframe:
            chunk = sse.as_client_chunk(info, chat, ctx.template)
            return (None if chunk is None else sse.event(chunk)), bool(info.text)
        if ctx.template is None and info.data is not None:
            ctx.template = info.data
        return ev + b"\n\n", bool(info.text)


def _worker_failed(wid: str, exc: UpstreamError) -> WorkerFailed:
    """The raw upstream client's failure before a response, as a worker failure."""
    if exc.kind == "timeout":
        return WorkerFailed(wid, "timeout before response", timeout=True)
    if exc.kind == "connect":
        return WorkerFailed(wid, f"connect failed: {exc.detail}")
    return WorkerFailed(wid, f"response broken: {exc.detail}")
