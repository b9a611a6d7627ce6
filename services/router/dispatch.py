"""Dispatch on the live clock: a decided request's claim on its worker, from the decision to
the release, through the lifecycle the simulator runs too (``services.core.lifecycle``).

On dispatch the request takes a :class:`Ticket` on its worker (in-flight count, queued
prefill, reserved KV blocks) and becomes pending until its first token (followers may hold
on it); the decision's hot-prefix replicas take their tickets at once and are sent as
one-token copies in the background. A follower (``Decision.after``) waits for its leader's
first token, at most ``hold_s``.

Invariants: every ticket is released exactly once (every path ends in :meth:`Dispatcher.release`
or :meth:`Dispatcher.release_ticket` in a ``finally``); every release notifies the capacity
signal and the load publisher. A replica's failure never affects the user's request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from services.common import tracing
from services.common.logging import get_logger
from services.core.cluster import ClusterState, Ticket
from services.core.lifecycle import Replica, RequestLifecycle
from services.core.policy import Decision
from services.router import metrics as M
from services.router.holds import FirstTokenWaits
from services.router.load_share import LoadSharing
from services.router.proxy import Ctx, replica_body
from services.router.scaling import ScalingSignal
from services.router.signals import CapacitySignal, Spawner
from services.router.trace import end_replica
from services.router.upstream import FastClient, UpstreamError

log = get_logger("router")


class Dispatcher:
    def __init__(
        self,
        lifecycle: RequestLifecycle[asyncio.Event],
        load: LoadSharing,
        capacity: CapacitySignal,
        spawner: Spawner,
        fast: FastClient,
        st: Any,
    ) -> None:
        self.lifecycle = lifecycle
        self.state: ClusterState = lifecycle.state
        assert isinstance(lifecycle.holds, FirstTokenWaits)
        self.waits: FirstTokenWaits = lifecycle.holds  # follower holds (Decision.after)
        self.load = load
        self.capacity = capacity
        self.spawner = spawner
        self.fast = fast
        self.wake_on_first_token = False  # --protect-prefill: a first token may reopen the room
        self.request_timeout_s = st.request_timeout
        self.whole_timeout = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )
        self.session: aiohttp.ClientSession | None = None  # set by the router at start
        self.scaling: ScalingSignal | None = None  # set by the router

    def dispatch(self, ctx: Ctx, d: Decision) -> Ticket:
        """Claim ``d.worker_id`` for ``ctx`` and send the decision's replicas."""
        wid = d.worker_id
        assert wid is not None
        ctx.worker_id = wid
        ctx.predicted_cached = d.cached_tokens
        if self.scaling is not None:
            self.scaling.sent(wid)
        # reuse attribution: a retry's decision no longer sees the workers that failed it; the
        # first decision's best holder still counts as available (lost to the retry)
        if d.available_tokens >= ctx.available_cached:
            ctx.available_cached, ctx.lost_reason = d.available_tokens, d.lost_reason
        else:
            ctx.lost_reason = "retry" if d.cached_tokens < ctx.available_cached else ""
        prompt_tokens, wall = len(ctx.parsed.token_ids), time.time()
        ctx.dispatched_at = time.monotonic()
        if d.prefill_worker is not None:  # P/D: the decoder's claim and the prefiller's
            ticket, ctx.pd_ticket = self.lifecycle.dispatch_pd(
                ctx.request_id, d, prompt_tokens, ctx.parsed.max_tokens, wall
            )
        else:
            ticket = self.lifecycle.dispatch(
                ctx.request_id, wid, prompt_tokens, ctx.parsed.max_tokens, d.cached_tokens, wall
            )
        replicas = self.lifecycle.replicas(ctx.request_id, d, prompt_tokens, ctx.overlaps, wall)
        self.load.mark_dirty()
        if len(replicas) < len(d.replicate_to):  # a replica's worker is gone
            M.child(M.REPLICAS, "skipped").inc(len(d.replicate_to) - len(replicas))
        for rep in replicas:
            self.spawner.spawn(self.replicate(ctx, rep))
        return ticket

    async def hold(self, d: Decision) -> None:
        """Follower hold: wait for ``d.after``'s first token (it computes the prefix this
        request needs on the same worker) so the engine does not start both in one step."""
        if d.after is None:
            return
        t0 = time.perf_counter()
        outcome = await self.waits.wait(d.after, d.hold_s)
        if outcome != "none":
            M.child(M.HOLDS, outcome).inc()
            M.HOLD_SECONDS.observe(time.perf_counter() - t0)

    def first_token(self, ctx: Ctx, ticket: Ticket) -> None:
        """The request's first token: its prefill is done, its followers may go. A P/D
        policy's local prefill (no prefill worker) is timed for its prefill model."""
        if ctx.trace is not None:
            ctx.trace.first_token()
        now = time.monotonic()
        policy = ctx.arm.policy
        if (
            ticket.prefilling
            and not ctx.migrated
            and ctx.prefill_worker is None
            and getattr(policy.impl, "disaggregated", False)
        ):
            self.lifecycle.prefill_observed(
                policy, ctx.request_id, ticket.worker_id, now - ctx.dispatched_at
            )
        self.lifecycle.first_token(ctx.request_id, ticket, now)
        if self.wake_on_first_token:
            self.capacity.notify()

    def drop_prefill_claim(self, ctx: Ctx) -> None:
        """The request's claim on a prefill worker (``ctx.pd_ticket``), if it still holds one,
        is released without a prefill to learn from (the decoder prefills after all, or the
        request ended before the remote prefill did)."""
        if ctx.pd_ticket is not None:
            self.prefilled(ctx, ctx.pd_ticket, False)
            ctx.pd_ticket = None

    def prefilled(self, ctx: Ctx, ticket: Ticket, ok: bool, took_s: float | None = None) -> None:
        """A remote prefill ended: its claim on the prefill worker is released (once), and
        when it succeeded the policy learns how long it took (``took_s``; None: from dispatch
        until now, the prefill's answer as the router sees it)."""
        if ticket.released:
            return
        now = time.monotonic()
        if ok:
            took = now - ctx.dispatched_at if took_s is None else took_s
            self.lifecycle.prefilled(ctx.arm.policy, ctx.request_id, ticket, took, now)
        else:
            self.state.release(ticket)
        self.load.mark_dirty()
        self.capacity.notify()

    def decoded(self, ctx: Ctx, ticket: Ticket, ended_at: float) -> None:
        """A stream ended well on ``ticket``'s worker at ``ended_at`` (perf_counter): its mean
        inter-token gap for the policy's latency model (tokens from the usage, else the chunks
        passed through)."""
        if ctx.ttft is None:
            return
        tokens = ctx.completion_tokens or ctx.chunks
        first = ctx.t0 + ctx.ttft
        self.lifecycle.decoded(ctx.arm.policy, ticket.worker_id, tokens, first, ended_at)

    def release(self, ctx: Ctx, ticket: Ticket) -> None:
        """The attempt ended (answered, failed or cancelled)."""
        self.lifecycle.end(ctx.request_id, ticket)
        self.load.mark_dirty()
        self.capacity.notify()

    def reserve(self, wid: str, prompt_tokens: int, max_tokens: int, cached: int) -> Ticket:
        """A ticket for a migration's continuation (nobody holds on it)."""
        ticket = self.state.reserve(wid, prompt_tokens, max_tokens, cached, time.time())
        self.load.mark_dirty()
        return ticket

    def release_ticket(self, ticket: Ticket) -> None:
        self.state.release(ticket)
        self.load.mark_dirty()
        self.capacity.notify()

    async def replicate(self, ctx: Ctx, rep: Replica) -> None:
        """Hot-prefix replication: a one-token copy of the request to ``rep.worker_id``
        (claimed there by the lifecycle like any request), so that worker computes the prefix
        before users need it there. Best effort: a failure is counted and logged, the user's
        request is unaffected."""
        rid, wid = rep.request_id, rep.worker_id
        s = self.state.states.get(wid)
        outcome = "ok"
        span = None  # its trace span (tracing on, the request sampled)
        error: str | None = None
        try:
            if s is None or self.session is None:
                outcome = "skipped"
                return
            headers = {"x-request-id": rid}
            if ctx.trace is not None:  # the engine continues the request's trace
                span = ctx.trace.start_replica(wid, s.url, rid)
                tracing.inject(span if span is not None else ctx.trace.root, headers)
            elif ctx.traceparent is not None and tracing.enabled():
                headers["traceparent"] = ctx.traceparent  # not sampled: the engine is told so
            status = await self._post_replica(s.url, ctx.path, replica_body(ctx), headers)
            if status >= 400:
                outcome, error = "error", f"HTTP {status}"
                log.warning("replica failed", request_id=rid, worker=wid, status=status)
            else:
                self.lifecycle.first_token(rid, rep.ticket, time.monotonic())
        except (UpstreamError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome, error = "error", str(exc) or type(exc).__name__
            log.warning("replica failed", request_id=rid, worker=wid, error=str(exc))
        except asyncio.CancelledError:  # the router stops: counted and traced as cancelled
            outcome = error = "cancelled"
            raise
        finally:
            if span is not None:
                end_replica(span, outcome, error)
            M.child(M.REPLICAS, outcome).inc()
            self.lifecycle.end(rid, rep.ticket)
            self.load.mark_dirty()
            self.capacity.notify()

    async def _post_replica(self, url: str, path: str, body: bytes, headers: Any) -> int:
        if url.startswith("http://"):
            resp = await self.fast.post(url, path, body, headers, self.request_timeout_s)
            return resp.status
        assert self.session is not None
        async with self.session.post(
            url + path,
            data=body,
            headers={"Content-Type": "application/json", **headers},
            timeout=self.whole_timeout,
        ) as r:
            await r.read()
            return r.status
