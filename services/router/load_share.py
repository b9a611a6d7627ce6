"""Load sharing between routers: this router's in-flight counts out on ``router.load.<id>``,
other routers' in (they count in every worker's ``inflight`` / ``pending_prefill_tokens``).

Invariants: a change is published within ~5 ms (bursts coalesce into one message) and at
least every ``load_interval`` seconds; nothing is published while NATS is down; this router's
own messages are ignored on the way in.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.common.aio import wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import RouterLoad
from services.core.cluster import ClusterState
from services.router.signals import CapacitySignal

log = get_logger("router")


class LoadSharing:
    def __init__(
        self,
        router_id: str,
        bus: Bus,
        state: ClusterState,
        capacity: CapacitySignal,
        interval_s: float,
    ) -> None:
        self.router_id = router_id
        self.bus = bus
        self.state = state
        self.capacity = capacity
        self.interval_s = interval_s
        self._dirty = asyncio.Event()
        self._seq = 0
        self._log = RateLimiter(30.0)

    def mark_dirty(self) -> None:
        """This router's counts changed (a dispatch or a release)."""
        self._dirty.set()

    async def on_router_load(self, rl: RouterLoad, _raw: Any) -> None:
        if rl.router_id == self.router_id:
            return
        self.state.on_router_load(rl.router_id, rl.inflight, rl.pending_prefill, time.monotonic())
        if self.capacity.waiting:
            self.capacity.notify()

    async def run(self) -> None:
        """Publish this router's in-flight counts on change (coalesced) and every interval."""
        while True:
            await wait_event(self._dirty, self.interval_s)
            self._dirty.clear()
            if not self.bus.is_connected:
                continue
            self._seq += 1
            msg = RouterLoad(
                router_id=self.router_id,
                ts=time.time(),
                seq=self._seq,
                inflight=self.state.local_inflight(),
                pending_prefill=self.state.local_prefill(),
            )
            try:
                await self.bus.publish(self.bus.subjects.router_load(self.router_id), msg)
            except Exception as exc:
                if self._log.allow("load"):
                    log.warning("router load publish failed", error=repr(exc))
            await asyncio.sleep(0.005)  # coalesce bursts: at most ~200 load messages/s
