"""The api's view of the tenants' prefix cache: blocks held per tenant, summed over the
routers' reports (``router.load.<id>``, their ``tenant_cache_blocks``), for the usage
endpoint, and the ``tenant_cache_over_budget`` alert (the model:
services.core.flow.cache_budget).

Invariants:
- In memory, per replica, like the worker registry: a router's report is forgotten
  ``peer_ttl_s`` after it was heard; with no current report, blocks held are unknown (None).
- Every ``tick_s`` the tenants' budgets are read from Postgres and the over-budget set
  compared with the previous look; a change raises a ``tenant_cache_over_budget`` signal
  (firing, or resolved) through the alert manager, which de-duplicates the replicas' signals
  by fingerprint. The first look after a start compares with the open alerts of that kind in
  Postgres, so an alert opened before a restart (or by another replica) is closed once the
  tenant is back within its budget. No look is made while no router reports (nothing is
  known).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from sqlalchemy import select

from services.api.db import Database
from services.api.models import AlertRow, TenantRow
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import Alert, RouterLoad
from services.common.streams import raise_alert
from services.core.flow.cache_budget import ALERT_KIND, CacheHoldings, changes, over_tenants

log = get_logger("api.tenant_cache")


def budget_of(spec: dict[str, Any]) -> int | None:
    return (spec.get("quota") or {}).get("cache_budget_blocks")


def over_budget_alert(tenant: str, held: int, budget: int | None, firing: bool) -> Alert:
    if firing:
        summary = (
            f"tenant {tenant} holds {held} KV blocks, over its cache budget of {budget}: its "
            "new requests are in the sheddable band until it is back within it"
        )
    elif budget is None:
        summary = f"tenant {tenant} has no cache budget any more"
    else:
        summary = f"tenant {tenant} is back within its cache budget ({held} of {budget} blocks)"
    return Alert(
        fingerprint=f"{ALERT_KIND}:{tenant}",
        kind=ALERT_KIND,
        severity="warning",
        state="firing" if firing else "resolved",
        source="api",
        summary=summary,
        remedy=""
        if not firing
        else (
            "raise the tenant's quota.cache_budget_blocks (kvgate tenants update "
            f"{tenant} --cache-budget-blocks N), or have it send shorter or fewer distinct "
            "prompts"
        ),  # fmt: skip
        details={"tenant_id": tenant, "blocks_held": held, "cache_budget_blocks": budget},
    )


class TenantCacheView:
    def __init__(
        self, db: Database, bus: Bus, tick_s: float = 1.0, peer_ttl_s: float = 10.0
    ) -> None:
        self.db = db
        self.bus = bus
        self.tick_s = tick_s
        self.holdings = CacheHoldings(peer_ttl_s)
        self._over: frozenset[str] | None = None  # None: not looked yet
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._log = RateLimiter(60.0)

    def held(self, tenant: str) -> int | None:
        """Blocks the tenant holds on the fleet, as the routers last reported (None: no
        router reports)."""
        now = time.monotonic()
        if not self.holdings.reporters(now):
            return None
        return self.holdings.totals({}, now).get(tenant, 0)

    async def _on_load(self, rl: RouterLoad, _raw: Any) -> None:
        if rl.tenant_cache_blocks is not None:
            self.holdings.on_peer(rl.router_id, rl.tenant_cache_blocks, time.monotonic())

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(
            self.bus.subjects.router_load_all, RouterLoad, self._on_load
        )
        self._task = asyncio.create_task(self._run(), name="tenant-cache-budgets")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.check()
            except Exception as exc:
                if self._log.allow("check"):
                    log.warning("cache budget check failed", error=repr(exc)[:200])

    async def check(self) -> None:
        now = time.monotonic()
        if not self.holdings.reporters(now):
            return
        async with self.db.session() as s:
            rows = (await s.execute(select(TenantRow.id, TenantRow.spec))).all()
            before = self._over
            if before is None:  # the first look: what is open now
                fps = await s.execute(
                    select(AlertRow.fingerprint).where(
                        AlertRow.kind == ALERT_KIND, AlertRow.state != "resolved"
                    )
                )
                before = frozenset(fp.split(":", 1)[1] for (fp,) in fps if ":" in fp)
        budgets = {tid: b for tid, spec in rows if (b := budget_of(spec)) is not None}
        held = self.holdings.totals({}, now)
        over = over_tenants(held, budgets)
        fired, resolved = changes(before, over)
        for tenant in sorted(fired | resolved):
            await raise_alert(
                self.bus,
                over_budget_alert(
                    tenant, held.get(tenant, 0), budgets.get(tenant), tenant in fired
                ),
            )
        self._over = over  # only once every signal was sent: a failed one is sent again
