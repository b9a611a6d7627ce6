"""One request, from the client's bytes to its outcome:

    parse (tokenize) -> admission (decide, or wait for capacity) -> dispatch (ticket, replicas,
    hold) -> send (stream or whole; mid-stream failure migrates) -> release -> outcome

A failure before the client saw anything (``WorkerFailed``) excludes that worker and goes
round again, at most ``max_retries`` times.

Invariants: every request records exactly one outcome (``finally``); every attempt's ticket
is released in ``finally``; deciding reads local state only.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from services.common.logging import get_logger
from services.router import metrics as M
from services.router import slo
from services.router.admission import Admission
from services.router.canary import PolicySet
from services.router.circuits import Circuits
from services.router.dispatch import Dispatcher
from services.router.outcomes import OutcomeRecorder
from services.router.proxy import Ctx, WorkerFailed, error_response, reject, session_of
from services.router.send import Sender
from services.router.tokenize import BadRequest, RequestParser

log = get_logger("router")
_json_decode = msgspec.json.decode


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
    ) -> None:
        self.parser = parser
        self.policies = policies
        self.admission = admission
        self.dispatcher = dispatcher
        self.sender = sender
        self.circuits = circuits
        self.outcomes = outcomes
        self.max_retries = max_retries

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            parsed = await self.parser.parse(_json_decode(await request.read()), chat, request.path)
        except msgspec.DecodeError as exc:
            return error_response(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            )
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error", param=exc.param)
        try:
            targets = slo.parse(request.headers)
        except slo.BadSloHeader as exc:
            return error_response(400, str(exc), "invalid_request_error", param=exc.header)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        session_id = session_of(request)
        ctx = Ctx(rid, parsed, self.policies.arm(rid, session_id), session_id, t0, request.path)
        ctx.slo = targets
        so = parsed.body.get("stream_options")
        ctx.client_wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        M.INFLIGHT.inc()
        try:
            return await self._route_and_send(request, ctx)
        finally:
            M.INFLIGHT.dec()
            self.outcomes.record(ctx)

    async def _route_and_send(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        while True:
            d = await self.admission.decide_or_wait(ctx)
            if isinstance(d, web.Response):
                return d
            ticket = self.dispatcher.dispatch(ctx, d)
            try:
                await self.dispatcher.hold(d)
                ctx.sent_at = time.monotonic()  # the breaker weighs only evidence sent after
                return await self.sender.send(request, ctx, ticket)
            except WorkerFailed as exc:
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
                self.dispatcher.release(ctx, ticket)
