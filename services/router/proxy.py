"""Forwarding one request to a worker: retries before any output, migration mid-stream.

The flow for a request (driven by :meth:`services.router.request_path.RequestPath.handle`):

1. decide (policy core) -> worker, or queue / 400 / 404 / 503;
2. send; on connect failure, 503 or a timeout before the response started: breaker failure,
   exclude the worker, decide again (at most ``max_retries`` times);
3. non-streaming: return the worker's body as is; streaming: pass each SSE event through as it
   completes; if the worker dies mid-stream, resend prompt + text generated so far to the
   next-best worker as a completions request and continue the same client stream, re-framed
   in the client's format (at most ``max_migrations`` times);
4. release the worker's ticket, record metrics and publish the outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec

from services.common.tenancy import NO_TENANT, RequestTenancy
from services.core.cluster import Ticket
from services.router import sse
from services.router.canary import Arm
from services.router.http_server import Response, StreamResponse, json_response
from services.router.slo import NO_TARGETS, SloTargets
from services.router.tokenize import Parsed
from services.router.upstream import Stream

SESSION_HEADERS = ("x-session-id", "x-kvgate-session")


class WorkerFailed(Exception):
    """The worker failed before sending anything the client saw (retry elsewhere)."""

    def __init__(self, worker_id: str, reason: str, timeout: bool = False) -> None:
        super().__init__(f"{worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.timeout = timeout


class StreamBroken(Exception):
    """The worker stream ended early after the client already got output (migrate)."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"{worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class Ctx(msgspec.Struct):
    """Everything one request accumulates on its way through the router (a msgspec struct:
    one per request, built in a third of a dataclass's time)."""

    request_id: str
    parsed: Parsed
    arm: Arm
    session_id: str | None
    t0: float
    path: str
    worker_id: str | None = None
    predicted_cached: int = 0  # captured: the chosen worker's cached prompt tokens
    # the most any eligible worker held (services/core/policy/attribution.py)
    available_cached: int = 0
    lost_reason: str = ""  # why the best holder was not taken ("" when it was)
    cached_reported: int | None = None
    completion_tokens: int = 0
    # generated text, see ``generated``: decoded parts (str) and whole events passed through
    # as they came (bytes, one or more each), decoded only if a migration reads them
    text_parts: list[str | bytes] = msgspec.field(default_factory=list)
    chunks: int = 0  # stream chunks with output passed to the client (tokens, without usage)
    ttft: float | None = None
    retries: int = 0
    migrated: int = 0
    status: str = "ok"
    http_status: int = 200
    excluded: set[str] = msgspec.field(default_factory=set)
    last_failure: WorkerFailed | None = None
    template: dict[str, Any] | None = None  # first chunk the client got (ids for re-framing)
    client_wants_usage: bool = False
    out: StreamResponse | None = None
    overlaps: dict[str, int] = msgspec.field(default_factory=dict)  # of the last decision
    slo: SloTargets = NO_TARGETS  # x-slo-* headers (services/router/slo.py)
    shed: bool = False  # the policy refused it (no worker meets its SLO): 429
    sent_at: float = 0.0  # monotonic time the current worker was sent the request (breaker)
    carried_tokens: int = 0  # tokens generated before the last migration (usage)
    answered: Ticket | None = None  # the attempt that answered, released after the reply
    # disaggregated serving (services/router/pd.py): the prefill worker, the handshake's
    # fields for the decode request, its prefill time, when it ended (perf_counter) and the
    # decision's predicted KV transfer time
    prefill_worker: str | None = None
    pd_handshake: str = ""
    pd_fields: dict[str, Any] | None = None
    # --engine-priority: the body's ``priority`` for the engine (set at the first dispatch)
    engine_priority: int | None = None
    pd_prefill_s: float | None = None
    pd_prefill_done: float | None = None
    pd_transfer_predicted: float = 0.0
    pd_ticket: Ticket | None = None  # the prefill worker's claim (Dispatcher.dispatch)
    dispatched_at: float = 0.0  # monotonic time of the current attempt's dispatch
    # who the request is for and its priority band (services.router.tenant_identity)
    tenancy: RequestTenancy = NO_TENANT
    # its prompt tokens as charged to its tenant by flow control (once, at dispatch; None: not
    # yet): what it holds in the work in flight until it ends
    flow_charged: int | None = None
    # tracing (services.router.trace): the request's trace while tracing is on; off, the
    # client's own W3C trace context, passed to the engine untouched
    trace: Any = None
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def generated(self) -> str:
        """The text generated so far (decoded and joined when read: appending stays O(1) per
        chunk, and a stream that ends normally never decodes its chunks' text)."""
        parts = self.text_parts
        if len(parts) > 1 or (parts and isinstance(parts[0], bytes)):
            chat = self.parsed.chat
            parts[:] = ["".join(p if isinstance(p, str) else sse.texts_of(p, chat) for p in parts)]
        return parts[0] if parts else ""  # type: ignore[return-value]


def upstream_body(
    ctx: Ctx, migrate: bool, max_tokens: int | None = None, raw: bytes = b""
) -> bytes:
    """The body sent to a worker. Streaming requests ask for usage (to learn cached tokens):
    without ``stream_options`` in the client's body (``raw``), the option is written in front
    of its bytes, which are otherwise forwarded untouched; a migration continues as a
    completions request on prompt + generated text."""
    p = ctx.parsed
    if migrate:
        body = {
            k: v
            for k, v in p.body.items()
            if k not in ("messages", "prompt", "max_tokens", "max_completion_tokens", "n", "tools")
        }
        body["prompt"] = p.prompt + ctx.generated
        if p.chat:  # the rendered template already holds its special tokens
            body["add_special_tokens"] = False
        body["max_tokens"] = max_tokens
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if ctx.engine_priority is not None:
            body["priority"] = ctx.engine_priority
        return sse._encode(body)
    if p.stream:
        so = p.body.get("stream_options")
        if "stream_options" not in p.body:
            spliced = _with_usage_option(raw)
            if spliced:
                return spliced
        if not (isinstance(so, dict) and so.get("include_usage")):
            body = dict(p.body)
            body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
            return sse._encode(body)
    return b""  # empty: send the client's original bytes


_USAGE_OPTION = b'{"stream_options":{"include_usage":true},'


def _with_usage_option(raw: bytes) -> bytes:
    """``raw`` (a JSON object without ``stream_options``) with the option as its first
    member, or b"" when ``raw`` is not a non-empty object's bytes."""
    body = raw.lstrip()
    if not body.startswith(b"{") or body[1:].lstrip().startswith(b"}"):
        return b""
    return _USAGE_OPTION + body[1:]


def replica_body(ctx: Ctx) -> bytes:
    """A one-token, non-streaming copy of the client's request (hot-prefix replication): the
    worker computes the same prompt, so it holds the prefix afterwards."""
    body = {k: v for k, v in ctx.parsed.body.items() if k not in ("stream_options", "n")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return sse._encode(body)


async def read_error(resp: Stream | aiohttp.ClientResponse) -> bytes:
    try:
        return await asyncio.wait_for(resp.read(), 5.0)
    except Exception:
        return b""


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


class Upstream5xx(Exception):
    """A worker answered 5xx (other than 503): counted against its breaker, passed through."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


async def write(out: StreamResponse, data: bytes) -> None:
    """Write to the client; a closed client connection raises :class:`ClientGone`."""
    try:
        await out.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
        raise ClientGone() from exc


def error_response(
    status: int,
    message: str,
    etype: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> Response:
    """An error in OpenAI's shape (with vLLM's numeric code); ``param`` names the bad field."""
    return json_response(
        {"error": {"message": message, "type": etype, "param": param, "code": status}},
        status=status,
        headers=headers,
    )


def reject(
    ctx: Ctx,
    status: int,
    message: str,
    etype: str,
    outcome: str,
    headers: dict[str, str] | None = None,
) -> Response:
    """End ``ctx`` with ``outcome`` / ``status`` and the client's error response."""
    ctx.status, ctx.http_status = outcome, status
    return error_response(status, message, etype, headers)


def upstream_headers(ctx: Ctx) -> dict[str, str]:
    """Request headers for the engine: the request id and the W3C trace context (this
    attempt's span while tracing is on; else the client's ``traceparent``, if it sent one)."""
    h = {"x-request-id": ctx.request_id}
    if ctx.trace is not None:
        ctx.trace.headers_into(h)
    elif ctx.traceparent is not None:
        h["traceparent"] = ctx.traceparent
        if ctx.tracestate is not None:
            h["tracestate"] = ctx.tracestate
    return h


def worker_headers(ctx: Ctx, wid: str) -> dict[str, str]:
    """Response headers naming where and how the request was routed."""
    out = {
        "x-kvgate-worker": wid,
        "x-kvgate-policy": ctx.arm.label,  # name@version, as operators named it
        "x-kvgate-arm": ctx.arm.name,
        "x-request-id": ctx.request_id,
    }
    if ctx.prefill_worker is not None:  # disaggregated: wid decoded, this one prefilled
        out["x-kvgate-prefill-worker"] = ctx.prefill_worker
    return out


def session_of(headers: Mapping[str, str]) -> str | None:
    """The client's session id (a conversation), from the first session header present."""
    for h in SESSION_HEADERS:
        v = headers.get(h)
        if v:
            return v
    return None
