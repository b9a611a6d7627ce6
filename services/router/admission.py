"""Admission: a decision with a worker, or the request's error response.

Flow control (services/router/flow_control.py over the pure services/core/flow): a request
over its tenant's quota is refused at once (429 + Retry-After). When the fleet is saturated
for it (its decision names no worker: every worker at capacity, or no worker meets its SLO;
or requests of its band wait already) it waits in its model's :class:`FlowQueue`, or is shed
(services.core.flow.control: sheddable ones at once, standard ones when the SLO cannot be
met, critical ones never on a prediction). Waiting requests are served in order: priority
band, then the tenant with the least virtual token counter, then first come; only the head
of the line asks the policy again, each time the capacity signal fires (at least every
0.5 s), and when it leaves the next head is woken.

With ``--protect-prefill`` (services/core/flow/prefill_room.py) a decision is also placed in
the prefill room: a best-effort request the room holds waits as if every worker were full
(a sheddable one is shed), and while the head of the line is so held a protected request
behind it asks the policy too (it passes it); a first token wakes the line (the room may
have reopened).

Invariants: at most ``queue_size`` requests wait per model (a request that finds its
model's line full takes the place of the youngest one of a lower band, which gets 429, or
gets 429 itself); a request waits at most ``queue_timeout`` seconds (then 429 with the
workers' reasons); the line holds exactly the requests waiting now (each leaves it in
``finally``); a sheddable request is dispatched only while no request of its model waits.
Error mapping: never fits -> 400; every candidate failed this request -> 502/504; unknown
model -> 404, except while the router does not know the cluster yet (``starting``,
services.router.readiness): 503 with Retry-After; nothing routable -> 503 with Retry-After.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from services.common.aio import wait_event
from services.common.tenancy import Priority
from services.core.cluster import ClusterState
from services.core.flow import FlowQueue, Verdict, decide_in_room, on_arrival, verdict
from services.core.policy import Decision
from services.router import metrics as M
from services.router.decide import Decider
from services.router.flow_control import QUEUED, ROOM_HELD_COUNT, WAIT, FlowControl, shed
from services.router.http_server import Response
from services.router.proxy import Ctx, reject
from services.router.signals import CapacitySignal

ROOM_HELD = "held for the prefill room: workers kept free of prompt work for protected requests"


def _held(head: _Waiter | None) -> bool:
    """Is the head of the line held by the prefill room (a protected request may pass it)?"""
    return head is not None and head.room_held


class _Waiter:
    """A request's place in its model's line."""

    __slots__ = ("bumped", "room_held", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.bumped = False  # a higher band took its place: answer 429
        self.room_held = False  # its last decision was held by the prefill room


class Admission:
    def __init__(
        self,
        decider: Decider,
        state: ClusterState,
        capacity: CapacitySignal,
        st: Any,
        flow: FlowControl | None = None,
    ) -> None:
        self.decider = decider
        self.state = state
        self.capacity = capacity
        self.st = st
        self.flow = (
            flow
            if flow is not None
            else FlowControl(st.queue_size, st.queue_timeout, state.remote_ttl_s)
        )
        # True while a model not seen yet may just not have been heard of (a router starting)
        self.starting: Callable[[], bool] = lambda: False

    async def decide_or_wait(self, ctx: Ctx) -> Decision | Response:
        """A decision with a worker, or the error response (400 / 404 / 429 / 502 / 503 / 504)."""
        fc = self.flow
        ten = ctx.tenancy
        prio = ten.priority
        first = ctx.flow_charged is None  # not a retry: quota checked, counted on dispatch
        n_prompt = len(ctx.parsed.token_ids)
        if first:
            refusal = fc.over_quota(ten, n_prompt, time.monotonic())
            if refusal is not None:
                return self._refuse(ctx, refusal.message, refusal.retry_after_s)
        lane = fc.lane(ctx.parsed.model)
        room = fc.room
        # --protect-prefill: protected requests pass a head the room holds and are placed on
        # a worker computing no prompt (services/core/flow/prefill_room.py). Protected is
        # asked again at every wake-up, as the simulator does: the tenant's work in flight
        # changes while it waits (a request that arrived over its share is under it once its
        # tenant's other requests end)
        if first:
            prot = fc.arrived(ten, n_prompt, time.monotonic())
        else:
            prot = room is not None and fc.protected(ten, n_prompt)
        me: _Waiter | None = None
        last: Decision | None = None  # its last decision (why it waits)
        tr = ctx.trace  # services.router.trace (None: not traced)
        try:
            v = on_arrival(prio, lane) if lane else Verdict.DECIDE
            if v is Verdict.SHED:
                shed(prio, "saturated")
                return self._refuse(
                    ctx, f"the fleet is saturated ({len(lane)} waiting); {prio} requests are shed"
                )
            if v is Verdict.QUEUE:
                me, refused = self._join(ctx, lane, prio)
                if refused is not None:
                    return refused
            while True:
                if me is not None and room is not None:
                    prot = fc.protected(ten, n_prompt)
                if me is None or lane.head() is me or (prot and _held(lane.head())):
                    if me is not None and first:  # it waited: its quota again
                        refusal = fc.over_quota(ten, n_prompt, time.monotonic())
                        if refusal is not None:
                            return self._refuse(ctx, refusal.message, refusal.retry_after_s)
                    if tr is not None:
                        ns = time.time_ns()
                    td = time.perf_counter()
                    d, ctx.overlaps = self.decider.decide_for(
                        ctx.parsed,
                        ctx.request_id,
                        ctx.session_id,
                        ctx.arm.policy,
                        ctx.excluded,
                        ctx.slo,
                    )
                    M.DECISION.observe(time.perf_counter() - td)
                    if tr is not None:
                        tr.decided(ns, time.time_ns(), ctx, d, ctx.overlaps)
                    last = d
                    placed = d if room is None else self._in_room(ctx, d, prot)
                    held = placed is None  # by the prefill room
                    if placed is None:  # as if every worker were full: wait, or shed
                        if me is None or not me.room_held:
                            ROOM_HELD_COUNT.labels(prio.value).inc()  # once per request
                        d = Decision(None, wait=True, reason=ROOM_HELD, policy=d.policy)
                    else:
                        d = placed
                    if d.worker_id is not None:
                        if first:
                            ctx.engine_priority = fc.dispatched(ten, n_prompt, time.monotonic())
                            ctx.flow_charged = n_prompt
                        return d
                    if d.never_fits:
                        return reject(ctx, 400, d.never_fits, "invalid_request_error", "rejected")
                    if not (d.wait or d.shed):
                        return self._no_worker(ctx, d)
                    if verdict(prio, d.shed) is Verdict.SHED:
                        shed(prio, "slo" if d.shed else "room" if held else "saturated")
                        if d.shed:  # the policy predicts no worker meets the request's SLO
                            ctx.shed = True
                            return self._refuse(ctx, d.reason)
                        why = (
                            "the prefill room is held for protected requests"
                            if held
                            else "every worker is at capacity"
                        )
                        return self._refuse(ctx, f"{why}; {prio} requests are shed")
                    if me is None:  # saturated: wait in the bounded line
                        me, refused = self._join(ctx, lane, prio)
                        if refused is not None:
                            return refused
                    me.room_held = held
                elif me.bumped:
                    me = None  # no longer in the line
                    shed(prio, "bumped")
                    M.QUEUE_REJECTED.labels("full").inc()
                    return self._refuse(
                        ctx,
                        f"router queue full ({self.st.queue_size} waiting): a request of a "
                        "higher priority took this one's place",
                    )
                assert me is not None
                left = me.since + self.st.queue_timeout - time.monotonic()
                if left <= 0:
                    shed(prio, "timeout")
                    M.QUEUE_REJECTED.labels("timeout").inc()
                    why = sorted(last.filtered.items())[:8] if last is not None else []
                    reasons = "; ".join(f"{k}: {v}" for k, v in why)
                    if me.room_held:
                        reasons = ROOM_HELD
                    return self._refuse(
                        ctx,
                        f"no worker could take the request within {self.st.queue_timeout}s"
                        + (
                            f" ({'' if me.room_held else 'all at capacity: '}{reasons})"
                            if reasons
                            else ""
                        ),
                        max(1, math.ceil(self.st.retry_after)),
                    )
                await wait_event(self.capacity.event, min(left, 0.5))
        finally:
            if me is not None:
                lane.leave(me)
                waited = time.monotonic() - me.since
                WAIT.labels(prio.value).observe(waited)
                if tr is not None:
                    end = time.time_ns()
                    attrs = {"kvgate.priority": prio.value, "kvgate.queue_length": len(lane)}
                    tr.step("queue", end - int(waited * 1e9), end, attrs)
                M.QUEUE_LEN.set(len(fc))
                if lane:  # the next head decides now
                    self.capacity.notify()

    def _in_room(self, ctx: Ctx, d: Decision, protected: bool) -> Decision | None:
        """The decision placed in the prefill room (services/core/flow/prefill_room.py); None:
        the room holds the request. Unchanged with the room off, for a decision that names no
        worker, and for a P/D policy's (the room is for colocated workers)."""
        room = self.flow.room
        if room is None or d.worker_id is None or ctx.arm.policy.impl.disaggregated:
            return d
        return decide_in_room(
            d,
            self.state.states,
            ctx.overlaps,
            len(ctx.parsed.token_ids),
            protected,
            0 if protected else room.room(time.monotonic()),
        )

    def _join(
        self, ctx: Ctx, lane: FlowQueue, prio: Priority
    ) -> tuple[_Waiter | None, Response | None]:
        """Join ``lane``: (its place, None) or (None, the 429: the line is full)."""
        me = _Waiter(time.monotonic())
        joined = lane.join(me, ctx.tenancy, me.since)
        if not joined.ok:
            shed(prio, "queue_full")
            M.QUEUE_REJECTED.labels("full").inc()
            return None, self._refuse(ctx, f"router queue full ({self.st.queue_size} waiting)")
        if joined.bumped is not None:
            joined.bumped.bumped = True
            self.capacity.notify()  # it answers 429 now
        QUEUED.labels(prio.value).inc()
        M.QUEUE_LEN.set(len(self.flow))
        return me, None

    def _refuse(self, ctx: Ctx, message: str, retry_after: float | None = None) -> Response:
        ra = self.st.retry_after if retry_after is None else retry_after
        return reject(ctx, 429, message, "rate_limit_error", "rejected", {"Retry-After": str(ra)})

    def ended(self, ctx: Ctx) -> None:
        """The request ended (after the reply): its generated tokens are charged."""
        if ctx.flow_charged is not None:
            self.flow.ended(ctx.tenancy, ctx.flow_charged, ctx.completion_tokens, time.monotonic())

    def _no_worker(self, ctx: Ctx, d: Decision) -> Response:
        """No worker and no point waiting: why, as the client's error."""
        if ctx.last_failure is not None:
            f = ctx.last_failure
            return reject(
                ctx,
                504 if f.timeout else 502,
                f"every worker that could serve the request failed; last: {f}",
                "upstream_error",
                "timeout" if f.timeout else "error",
            )
        if ctx.parsed.model and ctx.parsed.model not in {
            s.model for s in self.state.states.values()
        }:
            if self.starting():
                return reject(
                    ctx,
                    503,
                    f"the router is starting and has not heard of a worker serving model "
                    f"{ctx.parsed.model!r} yet; retry after {self.st.retry_after} s",
                    "service_unavailable",
                    "error",
                    {"Retry-After": str(self.st.retry_after)},
                )
            return reject(
                ctx,
                404,
                f"model {ctx.parsed.model!r} is not served by any worker",
                "not_found_error",
                "rejected",
            )
        return reject(
            ctx,
            503,
            f"no worker available: {d.reason}",
            "service_unavailable",
            "error",
            {"Retry-After": str(self.st.retry_after)},
        )
