"""Admission: a decision with a worker, or the request's error response.

When every worker is at capacity (the decision says ``wait``) the request joins the
lifecycle's bounded :class:`~services.core.lifecycle.AdmissionQueue` and decides again each
time the capacity signal fires (at least every 0.5 s).

Invariants: at most ``queue_size`` requests wait at once (the next one gets 429 at once); a
request waits at most ``queue_timeout`` seconds (then 429 with the workers' reasons); the
queue holds exactly the requests waiting now (each leaves it in ``finally``).
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
from services.core.cluster import ClusterState
from services.core.policy import Decision
from services.router import metrics as M
from services.router.decide import Decider
from services.router.http_server import Response
from services.router.proxy import Ctx, reject
from services.router.signals import CapacitySignal


class Admission:
    def __init__(
        self, decider: Decider, state: ClusterState, capacity: CapacitySignal, st: Any
    ) -> None:
        self.decider = decider
        self.state = state
        self.capacity = capacity
        self.st = st
        # True while a model not seen yet may just not have been heard of (a router starting)
        self.starting: Callable[[], bool] = lambda: False

    async def decide_or_wait(self, ctx: Ctx) -> Decision | Response:
        """A decision with a worker, or the error response (400 / 404 / 429 / 502 / 503 / 504)."""
        entry = object()  # this request's place in the queue
        queue = self.capacity.queue
        queued = False
        try:
            while True:
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
                if d.worker_id is not None:
                    return d
                if d.shed:  # the policy predicts no worker meets the request's SLO
                    ctx.shed = True
                    return reject(
                        ctx,
                        429,
                        d.reason,
                        "rate_limit_error",
                        "rejected",
                        {"Retry-After": str(self.st.retry_after)},
                    )
                if d.never_fits:
                    return reject(ctx, 400, d.never_fits, "invalid_request_error", "rejected")
                if not d.wait:
                    return self._no_worker(ctx, d)
                # every worker is at capacity: wait in the bounded queue
                if not queued:
                    if not queue.join(entry, time.monotonic()):
                        M.QUEUE_REJECTED.labels("full").inc()
                        return reject(
                            ctx,
                            429,
                            f"router queue full ({self.st.queue_size} waiting)",
                            "rate_limit_error",
                            "rejected",
                            {"Retry-After": str(self.st.retry_after)},
                        )
                    queued = True
                    M.QUEUE_LEN.set(len(queue))
                left = queue.left_s(entry, time.monotonic())
                if left <= 0:
                    M.QUEUE_REJECTED.labels("timeout").inc()
                    return reject(
                        ctx,
                        429,
                        f"no worker could take the request within {self.st.queue_timeout}s "
                        f"(all at capacity: {'; '.join(f'{k}: {v}' for k, v in sorted(d.filtered.items())[:8])})",
                        "rate_limit_error",
                        "rejected",
                        {"Retry-After": str(max(1, math.ceil(self.st.retry_after)))},
                    )
                await wait_event(self.capacity.event, min(left, 0.5))
        finally:
            if queued:
                queue.leave(entry)
                M.QUEUE_LEN.set(len(queue))

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
