"""Per-tenant cache budgets (``quota.cache_budget_blocks``): which tenants hold more KV blocks
than their budget across the fleet, and what that does to their new requests.

The model. A router cannot evict an engine's blocks; it decides only which requests go where
and when. So a budget is enforced on the tenant's *new* requests: while the blocks it holds
exceed its budget, its requests are put in the ``sheddable`` band. They are still served
while the fleet has room (engines then reuse the tenant's own cached prefixes as before),
but when the fleet is saturated they are shed first (429 + Retry-After) and never wait
ahead of, or take capacity from, another tenant's requests: an over-budget tenant no longer
adds cache pressure exactly when others' prefixes are being evicted for room. It is back in
its own band once its blocks fall to the budget (the engines evict its least recently used
blocks as others need the room, or it sends less).

Blocks held are the routers' per-tenant cache ledger (services/router/tenant_cache.py, an
approximation: each router counts the blocks its own requests made) summed over routers:
each router's own count plus what the others last reported (router.load.<id>), a report
forgotten ``peer_ttl_s`` after it was heard. Over: held > budget (held == budget is within).

Pure: no I/O, no clock (``now`` is an argument, monotonic seconds).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from services.common.tenancy import Priority, RequestTenancy

ALERT_KIND = "tenant_cache_over_budget"


def over_budget(held: int, budget: int | None) -> bool:
    """True when ``held`` blocks exceed ``budget`` (None: no budget, never over)."""
    return budget is not None and held > budget


def over_tenants(held: Mapping[str, int], budgets: Mapping[str, int | None]) -> frozenset[str]:
    """The tenants with a budget whose blocks held exceed it."""
    return frozenset(t for t, b in budgets.items() if over_budget(held.get(t, 0), b))


def demote(tenancy: RequestTenancy, over: AbstractSet[str]) -> RequestTenancy:
    """The request's tenancy with its band lowered to ``sheddable`` while its tenant is over
    its cache budget (unchanged otherwise)."""
    if (
        tenancy.tenant_id is None
        or tenancy.priority is Priority.SHEDDABLE
        or tenancy.tenant_id not in over
    ):
        return tenancy
    return dataclasses.replace(tenancy, priority=Priority.SHEDDABLE)


def changes(before: AbstractSet[str], after: AbstractSet[str]) -> tuple[set[str], set[str]]:
    """(newly over, newly back within) between two looks."""
    return set(after) - set(before), set(before) - set(after)


class CacheHoldings:
    """Blocks held per tenant across routers: one's own ledger + the others' last reports."""

    def __init__(self, peer_ttl_s: float = 10.0) -> None:
        self.peer_ttl_s = peer_ttl_s
        self._peers: dict[str, tuple[float, dict[str, int]]] = {}  # router -> (heard, held)

    def on_peer(self, router_id: str, held: Mapping[str, int], now: float) -> None:
        self._peers[router_id] = (now, {t: max(0, int(n)) for t, n in held.items()})

    def reporters(self, now: float) -> int:
        """Routers whose report is current (forgets the stale ones)."""
        for peer, (heard, _) in list(self._peers.items()):
            if now - heard > self.peer_ttl_s:
                del self._peers[peer]
        return len(self._peers)

    def totals(self, own: Mapping[str, int], now: float) -> Counter[str]:
        """Blocks held per tenant: ``own`` + every current report."""
        out: Counter[str] = Counter({t: n for t, n in own.items() if n > 0})
        self.reporters(now)
        for _, held in self._peers.values():
            out.update(held)
        return out
