"""Dispatch: a decided request's claim on its worker, from the decision to the release.

On dispatch the request takes a :class:`Ticket` on its worker (in-flight count, queued
prefill, reserved KV blocks), is marked as waiting for its first token (followers may hold on
it), and the decision's hot-prefix replicas are sent as one-token copies in the background.
A follower (``Decision.after``) waits for its leader's first token, at most ``hold_s``.

Invariants: every ticket is released exactly once (``ClusterState.release`` is idempotent and
every path ends in :meth:`Dispatcher.release` or :meth:`Dispatcher.release_ticket` in a
``finally``); every request marked ``sent`` is marked ``done`` at its first token or its end;
every release notifies the capacity signal and the load publisher. A replica's failure never
affects the user's request.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from services.common.logging import get_logger
from services.core.policy import Decision
from services.core.policy.types import replica_id
from services.router import metrics as M
from services.router.holds import FirstTokenWaits
from services.router.load_share import LoadSharing
from services.router.proxy import Ctx, replica_body
from services.router.signals import CapacitySignal, Spawner
from services.router.state import ClusterState, Ticket
from services.router.upstream import FastClient, UpstreamError

log = get_logger("router")


class Dispatcher:
    def __init__(
        self,
        state: ClusterState,
        load: LoadSharing,
        capacity: CapacitySignal,
        spawner: Spawner,
        fast: FastClient,
        st: Any,
    ) -> None:
        self.state = state
        self.load = load
        self.capacity = capacity
        self.spawner = spawner
        self.fast = fast
        self.request_timeout_s = st.request_timeout
        self.whole_timeout = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )
        self.waits = FirstTokenWaits()  # follower holds (Decision.after)
        self.session: aiohttp.ClientSession | None = None  # set by the router at start

    def dispatch(self, ctx: Ctx, d: Decision) -> Ticket:
        """Claim ``d.worker_id`` for ``ctx`` and send the decision's replicas."""
        wid = d.worker_id
        assert wid is not None
        ctx.worker_id = wid
        ctx.predicted_cached = d.cached_tokens
        ticket = self.state.reserve(
            wid, len(ctx.parsed.token_ids), ctx.parsed.max_tokens, d.cached_tokens, time.time()
        )
        self.load.mark_dirty()
        self.waits.sent(ctx.request_id)
        for rw in d.replicate_to:
            self.spawner.spawn(self.replicate(ctx, rw))
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
        """The request's first token: its prefill is done, its followers may go."""
        if ticket.prefilling:
            self.state.first_token(ticket, time.monotonic())
            self.waits.done(ctx.request_id)

    def release(self, ctx: Ctx, ticket: Ticket) -> None:
        """The attempt ended (answered, failed or cancelled)."""
        self.waits.done(ctx.request_id)
        self.release_ticket(ticket)

    def reserve(self, wid: str, prompt_tokens: int, max_tokens: int, cached: int) -> Ticket:
        """A ticket outside a user's first attempt (a migration's continuation)."""
        ticket = self.state.reserve(wid, prompt_tokens, max_tokens, cached, time.time())
        self.load.mark_dirty()
        return ticket

    def release_ticket(self, ticket: Ticket) -> None:
        self.state.release(ticket)
        self.load.mark_dirty()
        self.capacity.notify()

    async def replicate(self, ctx: Ctx, wid: str) -> None:
        """Hot-prefix replication: a one-token copy of the request to ``wid``, counted there
        like any request, so that worker computes the prefix before users need it there.
        Best effort: a failure is counted and logged, the user's request is unaffected."""
        s = self.state.states.get(wid)
        if s is None or self.session is None:
            M.child(M.REPLICAS, "skipped").inc()
            return
        rid = replica_id(ctx.request_id, wid)
        cached = min(ctx.overlaps.get(wid, 0) * s.capacity.block_size, len(ctx.parsed.token_ids))
        ticket = self.state.reserve(wid, len(ctx.parsed.token_ids), 1, cached, time.time())
        self.load.mark_dirty()
        self.waits.sent(rid)
        body = replica_body(ctx)
        headers = {"x-request-id": rid}
        outcome = "ok"
        try:
            status = await self._post_replica(s.url, ctx.path, body, headers)
            if status >= 400:
                outcome = "error"
                log.warning("replica failed", request_id=rid, worker=wid, status=status)
            else:
                self.state.first_token(ticket, time.monotonic())
        except (UpstreamError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome = "error"
            log.warning("replica failed", request_id=rid, worker=wid, error=str(exc))
        finally:
            M.child(M.REPLICAS, outcome).inc()
            self.waits.done(rid)
            self.release_ticket(ticket)

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
