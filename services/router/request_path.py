"""One request, from the client's bytes to its outcome:

    parse (tokenize) -> admission (decide, or wait for capacity) -> dispatch (ticket, replicas,
    hold) -> send (stream or whole; mid-stream failure migrates) -> release -> outcome

A failure before the client saw anything (``WorkerFailed``) excludes that worker and goes
round again, at most ``max_retries`` times.

Invariants: every request records exactly one outcome (``finally``); every attempt's ticket
is released in ``finally``; deciding reads local state only. The answered attempt's release
and the outcome run just after the reply is written (scheduled from ``finally``: the server
writes a reply in the same step its handler returns), so they are not on the client's wait.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Mapping

import msgspec

from services.common import tracing
from services.common.logging import get_logger
from services.common.tenancy import NO_TENANT, RequestTenancy
from services.router import metrics as M
from services.router import slo
from services.router.admission import Admission
from services.router.canary import PolicySet
from services.router.circuits import Circuits
from services.router.dispatch import Dispatcher
from services.router.http_server import Reply, Request, Response
from services.router.outcomes import OutcomeRecorder
from services.router.pd import PdSender
from services.router.proxy import Ctx, WorkerFailed, error_response, reject, session_of
from services.router.public_surface import check_prompt_size
from services.router.scaling import ScalingSignal
from services.router.send import Sender
from services.router.tenant_identity import TenancyError
from services.router.tokenize import BadRequest, RequestParser
from services.router.trace import RequestTrace

log = get_logger("router")
_json_decode = msgspec.json.decode


class RequestIds:
    """Ids for requests that came without ``x-request-id``: 32 hex digits like a uuid4's,
    unique per router process (a random 64-bit prefix drawn at start + a counter), without
    a random draw (a system call) per request."""

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.seq = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self.seq):016x}"


def isolate(body: dict, tenant_salt: str) -> None:
    """Put the request in its tenant's private cache namespace: ``cache_salt`` is the tenant's
    secret salt (joined with the client's own salt, if it sent one), so its block keys and the
    engine's prefix cache share nothing with another tenant's (services.core.keys)."""
    own = body.get("cache_salt")
    body["cache_salt"] = f"{tenant_salt}:{own}" if isinstance(own, str) and own else tenant_salt


def tenancy_refusal(exc: TenancyError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return error_response(exc.status, exc.message, "invalid_request_error", headers, exc.param)


class RequestPath:
    def __init__(
        self,
        parser: RequestParser,
        policies: PolicySet,
        admission: Admission,
        dispatcher: Dispatcher,
        sender: Sender,
        circuits: Circuits,
        outcomes: OutcomeRecorder,
        max_retries: int,
        max_prompt_chars: int = 0,  # 0: no limit (services.router.public_surface)
        pd: PdSender | None = None,  # disaggregated serving (Decision.prefill_worker)
    ) -> None:
        self.pd = pd
        self.parser = parser
        self.policies = policies
        self.admission = admission
        self.dispatcher = dispatcher
        self.sender = sender
        self.circuits = circuits
        self.outcomes = outcomes
        self.max_retries = max_retries
        self.max_prompt_chars = max_prompt_chars
        self.ids = RequestIds()
        # who a request is for and its priority: the router's tenant directory
        # (services.router.tenant_identity; may raise TenancyError: 401 / 400)
        self.tenancy_of: Callable[[Request], RequestTenancy] = lambda _request: NO_TENANT
        self.tracer = tracing.tracer("kvgate.router")  # None: tracing off
        # the blocks a tenant's request had its worker compute (services.router.tenant_cache),
        # told after the reply
        self.cache_claim: Callable[[Ctx, str], None] | None = None
        self.scaling: ScalingSignal | None = None  # set by the router

    async def intake(
        self,
        raw: bytes | None,
        headers: Mapping[str, str],
        path: str,
        chat: bool,
        t0: float,
        tenancy: RequestTenancy = NO_TENANT,
        tr: RequestTrace | None = None,
        traceparent: str | None = None,
    ) -> Ctx | Response:
        """A request's body and headers as its :class:`Ctx` (parsed and tokenized, SLO
        targets, session, canary arm, ``tenancy``), or the 400 to answer: the same for both
        front doors, the router's HTTP port and the EPP (services/epp/picker.py). ``raw`` None:
        a request without a body (the EPP's headers-only requests), parsed as an empty object.
        A tenant with its own cache namespace gets its ``cache_salt`` in the parsed body.
        Traced (``tr``): its parse and tokenize steps recorded, the trace bound to the
        request; else ``traceparent`` is what the engine gets (the client's, when tracing is
        off; a not-sampled one of the router's, when it is on)."""
        try:
            if raw is None:
                body: object = {}
            else:
                body = _json_decode(raw)
                # before the tokenizer sees it; a body of at most that many bytes cannot hold
                # more characters of text (each takes one byte of JSON or more)
                if len(raw) > self.max_prompt_chars:
                    check_prompt_size(body, self.max_prompt_chars)
            if tenancy.cache_salt is not None and isinstance(body, dict):
                isolate(body, tenancy.cache_salt)
            if tr is not None:
                t_read = time.time_ns()
            parsed = await self.parser.parse(body, chat, path)
            if tr is not None:
                size = {"kvgate.body_bytes": len(raw or b"")}
                tr.step("parse", tr.start_ns, t_read, size)
                tokens = {"kvgate.prompt_tokens": len(parsed.token_ids)}
                tr.step("tokenize", t_read, time.time_ns(), tokens)
        except msgspec.DecodeError as exc:
            return error_response(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            )
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error", param=exc.param)
        try:
            targets = slo.parse(headers)
        except slo.BadSloHeader as exc:
            return error_response(400, str(exc), "invalid_request_error", param=exc.header)
        rid = headers.get("x-request-id") or self.ids.next()
        session_id = session_of(headers)
        ctx = Ctx(rid, parsed, self.policies.arm(rid, session_id), session_id, t0, path)
        if self.scaling is not None:
            self.scaling.arrived()
        ctx.slo = targets
        ctx.tenancy = tenancy
        so = parsed.body.get("stream_options")
        ctx.client_wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        if tr is not None:
            ctx.trace = tr.bind(ctx)
            if tr.recording and tenancy.tenant_id is not None:
                tr.root.set_attribute("kvgate.tenant", tenancy.tenant_id)
                tr.root.set_attribute("kvgate.priority", str(tenancy.priority.value))
        elif traceparent is not None:
            ctx.traceparent, ctx.tracestate = traceparent, headers.get("tracestate")
        return ctx

    async def handle(self, request: Request, chat: bool) -> Reply:
        if self.tracer is None:  # tracing off: a client's trace context passes through
            return await self._handle(request, chat, None, request.headers.get("traceparent"))
        return await self._handle_traced(request, chat)

    async def _handle_traced(self, request: Request, chat: bool) -> Reply:
        """:meth:`_handle` under its trace (current while it runs: log lines carry its ids)."""
        start_ns = time.time_ns()
        parent, forward = tracing.begin(request.headers)
        if forward is not None:  # not sampled: no span; the engine is told so
            return await self._handle(request, chat, None, forward)
        from opentelemetry import context

        tr = RequestTrace(self.tracer, parent, request.path, start_ns)
        token = context.attach(tr.root_ctx)
        reply: Reply | None = None
        try:
            reply = await self._handle(request, chat, tr, None)
            return reply
        finally:
            context.detach(token)
            if tr.ctx is None:  # refused before routing (bad body): no outcome to wait for
                tr.refused(reply.status if reply is not None else 499)

    async def _handle(
        self, request: Request, chat: bool, tr: RequestTrace | None, traceparent: str | None
    ) -> Reply:
        t0 = time.perf_counter()
        raw = await request.read()  # BodyTooLarge / BodyTimeout: answered by the server
        try:
            tenancy = self.tenancy_of(request)
        except TenancyError as exc:  # an expired key, a bad band: 401 / 400
            return tenancy_refusal(exc)
        ctx = await self.intake(
            raw, request.headers, request.path, chat, t0, tenancy, tr, traceparent
        )
        if isinstance(ctx, Response):
            return ctx
        if tenancy.cache_salt is not None:  # forward the body with the tenant's salt
            request.replace_body(msgspec.json.encode(ctx.parsed.body))
        M.INFLIGHT.inc()
        try:
            return await self._route_and_send(request, ctx)
        except asyncio.CancelledError:  # the client left (services.router.http_server)
            ctx.status, ctx.http_status = "cancelled", 499
            raise
        finally:
            M.INFLIGHT.dec()
            asyncio.get_running_loop().call_soon(self._settle, ctx)

    def _settle(self, ctx: Ctx) -> None:
        """After the reply: the answered attempt's ticket released, the outcome recorded (a
        failure here is logged; it reaches no client)."""
        try:
            try:
                if ctx.answered is not None:
                    self.dispatcher.release(ctx, ctx.answered)
                self.admission.ended(ctx)
            finally:
                self.outcomes.record(ctx)
                if ctx.trace is not None:
                    ctx.trace.finish(ctx)
            self.claim_cache(ctx)
        except Exception:
            log.exception("request bookkeeping failed", request_id=ctx.request_id)

    def claim_cache(self, ctx: Ctx) -> None:
        """After the reply: the blocks ``ctx``'s worker computed are claimed for its tenant
        (the router's settle; the EPP's, when its stream ends)."""
        if self.cache_claim is not None and ctx.tenancy.tenant_id and ctx.worker_id:
            self.cache_claim(ctx, ctx.worker_id)

    async def _route_and_send(self, request: Request, ctx: Ctx) -> Reply:
        while True:
            d = await self.admission.decide_or_wait(ctx)
            if isinstance(d, Response):
                return d
            ticket = self.dispatcher.dispatch(ctx, d)
            self.circuits.sent(ticket.worker_id)  # a half-open circuit counts its trials
            tr = ctx.trace
            try:
                if tr is not None and d.after is not None:
                    held = time.time_ns()
                    await self.dispatcher.hold(d)
                    tr.step("hold", held, time.time_ns(), {"kvgate.after": d.after})
                else:
                    await self.dispatcher.hold(d)
                ctx.sent_at = time.monotonic()  # the breaker weighs only evidence sent after
                if tr is not None:
                    url = self.sender.url_of(ticket.worker_id)
                    tr.start_attempt(ticket.worker_id, url, ctx.retries)
                if d.prefill_worker is not None and self.pd is not None:
                    reply = await self.pd.send(request, ctx, ticket, d)
                else:
                    ctx.prefill_worker = ctx.pd_fields = None  # a retry may be colocated
                    self.dispatcher.drop_prefill_claim(ctx)  # (no P/D sender: decoder alone)
                    reply = await self.sender.send(request, ctx, ticket)
                ctx.answered = ticket  # released once the reply is out (_settle)
                if tr is not None:
                    tr.end_attempt(ctx.status, streamed=ctx.parsed.stream)
                return reply
            except WorkerFailed as exc:
                if tr is not None:
                    tr.end_attempt("worker_failed", exc.reason)
                ctx.last_failure = exc
                self.circuits.failure(exc.worker_id, exc.reason, ctx.sent_at)
                ctx.excluded.add(exc.worker_id)
                if ctx.retries >= self.max_retries:
                    return reject(
                        ctx,
                        504 if exc.timeout else 502,
                        f"worker failed after {ctx.retries} retries: {exc.reason}",
                        "upstream_error",
                        "timeout" if exc.timeout else "error",
                    )
                ctx.retries += 1
                M.RETRIES.inc()
                log.info(
                    "retrying on another worker",
                    request_id=ctx.request_id,
                    failed=ticket.worker_id,
                    reason=exc.reason,
                )
            finally:
                if ctx.answered is not ticket:
                    self.dispatcher.release(ctx, ticket)
