"""The router's side of tenant cache budgets (the model: services.core.flow.cache_budget).

Each router sums the blocks held per tenant (its own cache ledger + the other routers' last
``RouterLoad.tenant_cache_blocks``), looks about once per ``--load-interval`` (with the
load share: services.router.load_share) which tenants exceed their ``cache_budget_blocks``,
and puts those tenants' new requests in the ``sheddable`` band until they are back within
it. It exports ``kvgate_tenant_cache_over_budget{tenant}`` (1 / 0, tenants with a budget).
The alert is the admin API's (services.api.tenant_cache), which hears the same reports.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Gauge

from services.common.tenancy import RequestTenancy
from services.core.flow.cache_budget import CacheHoldings, demote, over_tenants
from services.router.tenant_cache import TenantCacheLedger
from services.router.tenant_identity import TenantDirectory

OVER_BUDGET = Gauge(
    "kvgate_tenant_cache_over_budget",
    "1 while the tenant's KV blocks held (summed over the routers) exceed its cache budget "
    "(its new requests are then in the sheddable band), else 0; tenants with a budget only",
    ["tenant"],
)


class CacheBudgetGuard:
    def __init__(
        self, ledger: TenantCacheLedger, directory: TenantDirectory, peer_ttl_s: float = 10.0
    ) -> None:
        self.ledger = ledger
        self.directory = directory
        self.holdings = CacheHoldings(peer_ttl_s)
        self.over: frozenset[str] = frozenset()
        self._shown: dict[str, int] = {}  # tenant -> the gauge's value (set on change only)

    def on_peer(self, router_id: str, held: Mapping[str, int], now: float) -> None:
        self.holdings.on_peer(router_id, held, now)

    def report(self) -> dict[str, int]:
        """This router's blocks held per tenant (for its RouterLoad)."""
        return {t: n for t, n in self.ledger.held.items() if n > 0}

    def refresh(self, now: float) -> None:
        budgets = self.directory.cache_budgets()
        if not budgets and not self._shown:
            self.over = frozenset()
            return
        held = self.holdings.totals(self.ledger.held, now)
        self.over = over_tenants(held, budgets)
        for gone in self._shown.keys() - budgets.keys():
            OVER_BUDGET.remove(gone)
            del self._shown[gone]
        for tenant in budgets:
            v = 1 if tenant in self.over else 0
            if self._shown.get(tenant) != v:
                OVER_BUDGET.labels(tenant).set(v)
                self._shown[tenant] = v

    def demote(self, tenancy: RequestTenancy) -> RequestTenancy:
        return demote(tenancy, self.over)
