"""Everything a request handler may use, in one object (built by services.api.app)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.api.db import Database
from services.api.publisher import PolicyPublisher
from services.api.tenant_cache import TenantCacheView
from services.api.tenants import TenantPublisher
from services.api.tokens import TokenAuth
from services.api.ui import DecisionFeed
from services.api.workers import WorkerRegistry
from services.common.bus import Bus


@dataclass
class ApiContext:
    db: Database
    bus: Bus
    publisher: PolicyPublisher
    auth: TokenAuth
    registry: WorkerRegistry
    policy_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    background: list[Any] = field(default_factory=list)  # things with async stop()
    decisions: DecisionFeed = field(default_factory=DecisionFeed)  # the operator page's feed
    token_max_ttl_s: float = 0.0  # > 0: longest lifetime of a new token (and its default)
    tenants: TenantPublisher = None  # type: ignore[assignment]  # set by services.api.app
    # blocks held per tenant, from the routers' reports (set by services.api.app)
    tenant_cache: TenantCacheView | None = None
