"""Follower holds on the live clock: :class:`FirstTokenWaits` is the lifecycle's
:class:`~services.core.lifecycle.FirstTokenHolds` whose followers are asyncio events.

``kv_aware`` may answer "send this request after request X's first token" (``Decision.after``).
Every request the router sends (user requests and one-token replicas) is marked ``sent`` at
dispatch and ``done`` at its first token or its end, whichever is first (services.core.lifecycle).

Invariants: every waiter of a request is woken by its ``done`` (or gives up at its timeout and
is dropped); waiting on a request that is not pending returns at once. One event loop.
"""

from __future__ import annotations

import asyncio

from services.common.aio import wait_event
from services.core.lifecycle import FirstTokenHolds


class FirstTokenWaits(FirstTokenHolds[asyncio.Event]):
    def done(self, request_id: str) -> list[asyncio.Event]:
        """``request_id`` has its first token, or ended: wake whoever waits for it."""
        followers = super().done(request_id)
        for ev in followers:
            ev.set()
        return followers

    async def wait(self, request_id: str, timeout: float) -> str:
        """Wait until ``request_id`` is done: ``"none"`` when it was not pending (nothing to
        wait for), ``"token"`` when it became done, ``"timeout"`` after ``timeout`` seconds."""
        ev = asyncio.Event()
        if not self.hold(request_id, ev):
            return "none"
        if await wait_event(ev, timeout):
            return "token"
        self.drop(request_id, ev)
        return "timeout"
