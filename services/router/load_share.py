"""Load sharing between routers: this router's in-flight counts out on ``router.load.<id>``,
other routers' in (they count in every worker's ``inflight`` / ``pending_prefill_tokens``).

Invariants: the counts are published at start and at least every ``load_interval`` seconds
(how routers find each other); while another router is heard (its last message within the
cluster state's ``remote_ttl_s``), a change is published within ~5 ms (bursts coalesce into
one message), and a router heard for the first time gets this one's counts at once. A router
alone publishes only the periodic message: nobody reads its changes, and at ~200 messages a
second, sending them and reading its own back cost it ~7% of its CPU under load
(docs/benchmarks.md, "What keeps the router's CPU down"). Nothing is published while NATS is
down; this router's own messages are ignored on the way in.

The same messages carry this router's per-tenant quota usage (requests, input and output
tokens in the last minute, requests in flight: services.core.flow.quota), so every router
enforces a tenant's quota on the sum; a change of usage comes with the dispatch or release
that made it. At most every half ``load_interval`` (and at least every 1.5) a message
also carries its per-tenant KV blocks held (its cache ledger: they change with KV events, not
dispatches, and are a dict per tenant), and the tenants' cache budgets are re-checked on the
sum (services.router.cache_budget); the other messages carry none (None, not "nothing held").
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
from services.core.flow import QuotaBook
from services.router import metrics as M
from services.router.cache_budget import CacheBudgetGuard
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
        quotas: QuotaBook | None = None,
    ) -> None:
        self.router_id = router_id
        self.bus = bus
        self.state = state
        self.capacity = capacity
        self.interval_s = interval_s
        self.quotas = quotas if quotas is not None else QuotaBook()
        self._dirty = asyncio.Event()
        self._peers = state.remote_routers  # a live view: read on every dispatch and release
        M.PEER_ROUTERS.set_function(lambda: len(self._peers))
        self._seq = 0
        self._log = RateLimiter(30.0)
        self.cache: CacheBudgetGuard | None = None  # set by the router
        self._cache_at = -float("inf")  # when blocks held were last checked and sent

    def mark_dirty(self) -> None:
        """This router's counts changed (a dispatch or a release): published soon when another
        router hears them."""
        if self._peers:
            self._dirty.set()

    async def on_router_load(self, rl: RouterLoad, _raw: Any) -> None:
        if rl.router_id == self.router_id:
            return
        if rl.router_id not in self._peers:
            self._dirty.set()  # a router heard for the first time: our counts at once
        now = time.monotonic()
        self.state.on_router_load(rl.router_id, rl.inflight, rl.pending_prefill, now)
        self.quotas.on_peer(rl.router_id, rl.tenant_usage, now)
        if self.cache is not None and rl.tenant_cache_blocks is not None:
            self.cache.on_peer(rl.router_id, rl.tenant_cache_blocks, now)
        if self.capacity.waiting:
            self.capacity.notify()

    def _cache_tick(self, now: float) -> dict[str, int] | None:
        """Re-check the cache budgets and return this router's blocks held, at most every
        half interval (None otherwise)."""
        if self.cache is None or now - self._cache_at < self.interval_s / 2:
            return None
        self._cache_at = now
        self.cache.refresh(now)
        return self.cache.report()

    async def run(self) -> None:
        """Publish this router's in-flight counts at start, every interval, and on change
        (coalesced) while another router is heard."""
        self._dirty.set()  # announce this router at once
        while True:
            await wait_event(self._dirty, self.interval_s)
            self._dirty.clear()
            cache = self._cache_tick(time.monotonic())
            if not self.bus.is_connected:
                continue
            self._seq += 1
            msg = RouterLoad(
                router_id=self.router_id,
                ts=time.time(),
                seq=self._seq,
                inflight=self.state.local_inflight(),
                pending_prefill=self.state.local_prefill(),
                tenant_usage=self.quotas.report(time.monotonic()),
                tenant_cache_blocks=cache,
            )
            try:
                await self.bus.publish(self.bus.subjects.router_load(self.router_id), msg)
            except Exception as exc:
                if self._log.allow("load"):
                    log.warning("router load publish failed", error=repr(exc))
            await asyncio.sleep(0.005)  # coalesce bursts: at most ~200 load messages/s
