"""Who a request is for, and what that tenant may do: the shared vocabulary of tenancy.

Plain data, no I/O. The admin API stores these (Postgres), routers and the EPP receive them
over the bus and resolve each request to a :class:`RequestTenancy`; flow control and cache
accounting read only that.

Invariants:
- ``RequestTenancy.tenant_id`` is None only for requests admitted by a tenant-less static key
  (``--api-keys``) or with no key at all on an open router; such requests share the
  ``DEFAULT_TENANT`` flow.
- ``weight`` > 0; a tenant's share of a saturated fleet is its weight over the sum of the
  backlogged tenants' weights.
- A request's ``priority`` is the key's default unless the key may choose and the request
  names one (header ``x-kvgate-priority``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Priority(StrEnum):
    """Priority bands, served strictly in this order when the fleet is saturated."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 = served first."""
        return _RANK[self]


_RANK = {Priority.CRITICAL: 0, Priority.STANDARD: 1, Priority.SHEDDABLE: 2}

DEFAULT_TENANT = "_default"
TENANT_HEADER = "x-kvgate-tenant"
PRIORITY_HEADER = "x-kvgate-priority"
# llm-d's flow-control fairness id (llm-d-inference-scheduler, pkg/plugins ... fairness)
LLMD_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """Per-minute and concurrency limits; None = unlimited."""

    requests_per_min: int | None = None
    input_tokens_per_min: int | None = None
    output_tokens_per_min: int | None = None
    concurrent_requests: int | None = None
    cache_budget_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    weight: float = 1.0
    default_priority: Priority = Priority.STANDARD
    quota: TenantQuota = field(default_factory=TenantQuota)
    # give this tenant's prompts their own cache namespace (a per-tenant cache_salt)
    cache_isolation: bool = False


@dataclass(frozen=True, slots=True)
class RequestTenancy:
    """What flow control needs to know about one request."""

    tenant_id: str | None = None
    priority: Priority = Priority.STANDARD
    weight: float = 1.0
    # the tenant's private cache namespace (``Tenant.cache_isolation``): set on the request
    # as its ``cache_salt``, so its prompts share blocks with no other tenant's
    cache_salt: str | None = None

    @property
    def flow(self) -> str:
        """The fair-queueing flow this request belongs to."""
        return self.tenant_id or DEFAULT_TENANT


NO_TENANT = RequestTenancy()
