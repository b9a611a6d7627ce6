"""One request's pick, through the router's own parts: the same intake
(``RequestPath.intake``: parse and tokenize, SLO headers, session, canary arm), admission
(``decide()`` over the same cluster state and index replica, the bounded wait queue,
shedding), dispatch (ticket, replicas, follower holds), outcome recorder and tenant cache
ledger (a tenant over its cache budget is picked in the sheddable band:
``Router.request_tenancy``) as ``kvgate router``: one decision core, two front doors.

Invariants: a :class:`Pick` holds exactly one ticket on its worker until :meth:`Picker.settle`
releases it (called once per stream, in ``finally``); every request, picked or refused,
records exactly one outcome (in ``settle`` for a pick, at once for a refusal or a stream
dropped while the request waited in the queue or behind its leader); a subset hint
excludes every worker whose endpoint is outside it, so the pick is inside it or there is none.

Disaggregated serving (a P/D policy's decision names a prefill worker): the pick is the
decode worker and :attr:`Pick.prefill` the prefill worker's ``ip:port``, which the gateway
hands to llm-d's routing sidecar on the decode pod (``x-prefiller-host-port``,
services/epp/protocol.py); the sidecar sends the prefill there and decodes locally. The
prefill worker's claim (``Ctx.pd_ticket``) is released at the decoder's first token (the
prefill is over by then) or when the stream ends, whichever is first; a decision whose
prefill worker has no ``ip:port`` is made again without it (another prefill worker, or the
decoder alone, as the policy rules), as the router does when a prefill worker fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import tracing
from services.common.logging import get_logger
from services.core.cluster import Ticket
from services.router import metrics as RM
from services.router import slo
from services.router.app import Router
from services.router.http_server import Response
from services.router.proxy import Ctx, error_response
from services.router.tenant_identity import TenancyError
from services.router.trace import RequestTrace

from . import endpoints
from . import metrics as M

log = get_logger("epp")

# a request without a body (headers only) is load-balanced like the router's un-keyed
# pass-through requests: the parser keys no prompt for a path that is not an OpenAI one
NO_BODY_PATH = "/-/epp-no-body"
# llm-d's names for the SLO headers, read when kvgate's own are absent
LLMD_SLO_ALIASES = {"x-llm-d-slo-ttft-ms": slo.TTFT_HEADER, "x-llm-d-slo-tpot-ms": slo.TPOT_HEADER}


@dataclass
class Pick:
    ctx: Ctx
    ticket: Ticket
    endpoint: str  # the pick: where the ticket is
    value: str  # what the data plane is told: the pick, then any fallbacks, comma-separated
    prefill: str | None = None  # P/D: the prefill worker's ip:port; None: the decoder prefills


class Picker:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.fallbacks = int(getattr(router.st, "fallback_endpoints", 0) or 0)
        self.tracer = tracing.tracer("kvgate.epp")  # None: tracing off

    async def pick(
        self, headers: Mapping[str, str], body: bytes | None, subset: list[str] | None
    ) -> Pick | Response:
        """The pick for one request, or the response the data plane answers with at once."""
        if self.tracer is None:
            return await self._pick(headers, body, subset, None, None)
        path = headers.get(":path", "").split("?", 1)[0]
        start_ns = time.time_ns()
        parent, forward = tracing.begin(headers)
        if forward is not None:  # not sampled: no span; the engine is told so
            return await self._pick(headers, body, subset, None, forward)
        tr = RequestTrace(self.tracer, parent, path, start_ns, prefix="epp")
        got: Pick | Response | None = None
        try:
            got = await self._pick(headers, body, subset, tr, None)
            return got
        finally:
            if isinstance(got, Pick):  # the trace ends when the stream settles
                tr.start_attempt(got.ticket.worker_id, got.endpoint, 0)
            elif tr.ctx is not None:
                tr.finish(tr.ctx)
            else:
                tr.refused(got.status if got is not None else 499)

    async def _pick(
        self,
        headers: Mapping[str, str],
        body: bytes | None,
        subset: list[str] | None,
        tr: RequestTrace | None,
        forward: str | None,
    ) -> Pick | Response:
        """``forward``: the ``traceparent`` the engine gets (tracing on, not sampled); with
        tracing off Envoy forwards the client's own."""
        t0 = time.perf_counter()
        r = self.router
        path = headers.get(":path", "").split("?", 1)[0]
        try:  # the gateway authenticates; the tenant is the client key's, or its header's
            # (its band lowered while it is over its cache budget, as the router does)
            tenancy = r.request_tenancy(headers)
        except TenancyError as exc:  # an expired tenant key, a bad band
            return self._refused(exc.status, exc.message, "invalid_request_error", exc.param)
        if tenancy.cache_salt is not None:
            # the gateway forwards the client's body as it is: the engine sees no salt, so
            # neither may the block keys (a tenant's cache isolation needs the router's port)
            tenancy = dataclasses.replace(tenancy, cache_salt=None)
        got = await r.path.intake(
            body,
            _with_aliases(headers),
            NO_BODY_PATH if body is None else path,
            path == "/v1/chat/completions",
            t0,
            tenancy,
            tr=tr,
            traceparent=forward,
        )
        if isinstance(got, Response):  # a 400: the router's answer to the same request
            M.PICKS.labels(str(got.status)).inc()
            return got
        ctx = got
        if body is None:  # the outcome names the request's own path
            ctx.path = path or NO_BODY_PATH
        if not r.state.states:  # an empty pool: no ready endpoint (the spec's 503)
            return self._unavailable(ctx, "no worker is known to the picker")
        if subset is not None:
            ctx.excluded |= endpoints.outside(r.state, subset)
            ex = ctx.excluded  # a prefill-only worker is never the destination
            if not subset or all(w in ex or s.role == "prefill" for w, s in r.state.states.items()):
                return self._unavailable(
                    ctx, f"no eligible endpoint in the subset hint ({len(subset)} endpoints)"
                )
        while True:
            try:
                d = await r.admission.decide_or_wait(ctx)
            except asyncio.CancelledError:  # the data plane left while the request was queued
                ctx.status, ctx.http_status = "cancelled", 499
                r.recorder.record(ctx)
                raise
            if isinstance(d, Response):  # ctx carries the refusal's status and outcome
                r.recorder.record(ctx)
                M.PICKS.labels(str(d.status)).inc()
                return d
            prefill = None
            if d.prefill_worker is not None:
                prefill = endpoints.worker_endpoint(r.state, d.prefill_worker)
                if prefill is None:  # the sidecar cannot be told where: decide without it
                    log.warning(
                        "prefill worker has no ip:port endpoint; deciding without it",
                        request_id=ctx.request_id,
                        worker=d.prefill_worker,
                    )
                    ctx.excluded.add(d.prefill_worker)
                    continue  # each pass excludes one more worker: bounded by the pool
            break
        ticket = r.dispatcher.dispatch(ctx, d)  # P/D: the prefill worker's claim in pd_ticket
        endpoint = endpoints.worker_endpoint(r.state, ticket.worker_id)
        if endpoint is None:  # its URL names no host:port a gateway could reach
            self._release(ctx, ticket)
            return self._unavailable(ctx, f"worker {ticket.worker_id} has no ip:port endpoint")
        if getattr(ctx.arm.policy.impl, "disaggregated", False):
            M.PD_PICKS.labels("decoder" if prefill is None else "remote").inc()
        if prefill is not None:  # the pair, as the router's outcomes record it
            ctx.prefill_worker = d.prefill_worker
            ctx.pd_transfer_predicted = d.transfer_s
        r.circuits.sent(ticket.worker_id)
        try:
            await r.dispatcher.hold(d)
        except asyncio.CancelledError:  # left while holding behind its leader
            self._release(ctx, ticket)
            ctx.status, ctx.http_status = "cancelled", 499
            r.recorder.record(ctx)
            raise
        ctx.sent_at = time.monotonic()
        RM.INFLIGHT.inc()
        M.PICKED.inc()
        M.PICK_SECONDS.observe(time.perf_counter() - t0)
        value = self._with_fallbacks(endpoint, ctx, d.scores)
        return Pick(ctx, ticket, endpoint, value, prefill)

    def _release(self, ctx: Ctx, ticket: Ticket) -> None:
        """The decoder's claim and, for a remote prefill not yet over, the prefill worker's."""
        self.router.dispatcher.drop_prefill_claim(ctx)
        self.router.dispatcher.release(ctx, ticket)

    def _with_fallbacks(self, endpoint: str, ctx: Ctx, costs: dict[str, float]) -> str:
        """The pick, then up to ``fallbacks`` other candidates in the decision's cost order
        (the policy's next choices; no second decision is made, so nothing more is claimed)."""
        if self.fallbacks <= 0 or not costs:
            return endpoint
        out = [endpoint]
        for wid in sorted(costs, key=costs.__getitem__):
            if len(out) > self.fallbacks:
                break
            if wid == ctx.worker_id or wid in ctx.excluded:
                continue
            e = endpoints.worker_endpoint(self.router.state, wid)
            if e is not None and e not in out:
                out.append(e)
        return ",".join(out)

    def _unavailable(self, ctx: Ctx, message: str) -> Response:
        """The spec's 503 for a request that got as far as its ``ctx``: its outcome recorded."""
        ctx.status, ctx.http_status = "error", 503
        self.router.recorder.record(ctx)
        return self._refused(503, message, "service_unavailable")

    def _refused(self, status: int, message: str, etype: str, param: str | None = None) -> Response:
        M.PICKS.labels(str(status)).inc()
        headers = {"Retry-After": str(self.router.st.retry_after)} if status == 503 else None
        return error_response(status, message, etype, headers, param=param)

    def served_by(self, p: Pick, endpoint: str) -> None:
        """The data plane says ``endpoint`` served the request: the outcome names that worker
        (the ticket stays on the pick, which is what was reserved)."""
        if endpoint == p.endpoint:
            return
        M.SERVED_ELSEWHERE.inc()
        wid = endpoints.worker_at(self.router.state, endpoint)
        p.ctx.worker_id = wid or p.ctx.worker_id
        log.info(
            "served by another endpoint",
            request_id=p.ctx.request_id,
            picked=p.endpoint,
            served=endpoint,
            worker=wid,
        )

    def first_token(self, p: Pick) -> None:
        ctx = p.ctx
        ctx.ttft = time.perf_counter() - ctx.t0
        if ctx.pd_ticket is not None:
            # the decoder's first token: the remote prefill is over. The EPP never sees the
            # prefill's own answer (the sidecar gets it): the policy learns the prefill as
            # this first token less the decision's predicted KV transfer, so that its
            # prefill model plus its transfer model give the first token it observes (an
            # error answer's first bytes teach it nothing)
            took = max(0.0, time.monotonic() - ctx.dispatched_at - ctx.pd_transfer_predicted)
            self.router.dispatcher.prefilled(ctx, ctx.pd_ticket, ctx.status == "ok", took)
            ctx.pd_ticket = None
        self.router.dispatcher.first_token(ctx, p.ticket)

    def settle(self, p: Pick, finished: bool) -> None:
        """The stream ended: release the ticket, record the outcome (``finished``: the
        response's last chunk was seen; otherwise the client or the data plane left)."""
        r = self.router
        try:
            try:
                if finished and p.ctx.status == "ok":
                    r.dispatcher.decoded(p.ctx, p.ticket, time.perf_counter())
                elif not finished and p.ctx.status == "ok":
                    p.ctx.status, p.ctx.http_status = "cancelled", 499
                self._release(p.ctx, p.ticket)
                r.admission.ended(p.ctx)  # flow control: output charged, quota's in-flight freed
            finally:
                RM.INFLIGHT.dec()
                r.recorder.record(p.ctx)
                if p.ctx.trace is not None:
                    p.ctx.trace.end_attempt(p.ctx.status, streamed=finished)
                    p.ctx.trace.finish(p.ctx)
            # the tenant's cache ledger (its blocks held count toward its cache budget, here
            # and, through the load share, on every router): the worker that served it
            r.path.claim_cache(p.ctx)
        except Exception:
            log.exception("request bookkeeping failed", request_id=p.ctx.request_id)


def _with_aliases(headers: Mapping[str, str]) -> Mapping[str, str]:
    if not any(k in headers for k in LLMD_SLO_ALIASES):
        return headers
    out = dict(headers)
    for alias, name in LLMD_SLO_ALIASES.items():
        if alias in out and name not in out:
            out[name] = out[alias]
    return out
