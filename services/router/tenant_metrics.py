"""Per-tenant metrics of finished requests (``kvgate_tenant_*``): requests by band and status,
prompt tokens, prompt tokens the engine served from its prefix cache (its own usage report,
the same figure the admin API bills: services.api.usage), and completion tokens.

Invariant: the ``tenant`` label takes at most ``MAX_TENANT_LABELS`` distinct values per
process (a trusted gateway may name any number of tenants); later ones share ``_other``.
Tenant-less requests are ``_default`` (services.common.tenancy.DEFAULT_TENANT). Updated from
the event loop only (services.common.loop_metrics: no lock per update).
"""

from __future__ import annotations

from typing import Any

from services.common.loop_metrics import LoopCounter
from services.common.tenancy import RequestTenancy

MAX_TENANT_LABELS = 1000
OTHER = "_other"

TENANT_REQUESTS = LoopCounter(
    "kvgate_tenant_requests_total",
    "Finished requests per tenant, priority band and status",
    ["tenant", "priority", "status"],
)
TENANT_PROMPT_TOKENS = LoopCounter(
    "kvgate_tenant_prompt_tokens_total",
    "Prompt tokens of successful requests per tenant",
    ["tenant"],
)
TENANT_CACHED_TOKENS = LoopCounter(
    "kvgate_tenant_cached_tokens_total",
    "Prompt tokens the engine reported served from its prefix cache, per tenant",
    ["tenant"],
)
TENANT_COMPLETION_TOKENS = LoopCounter(
    "kvgate_tenant_completion_tokens_total",
    "Completion tokens of successful requests per tenant",
    ["tenant"],
)


class TenantMetrics:
    def __init__(self, max_labels: int = MAX_TENANT_LABELS) -> None:
        self.max_labels = max_labels
        self._children: dict[tuple[str, str, str], Any] = {}
        self._tokens: dict[str, tuple[Any, Any, Any]] = {}

    def label(self, flow: str) -> str:
        """``flow`` as a ``tenant`` label value (bounded: module invariant)."""
        return self._label(flow)

    def _label(self, flow: str) -> str:
        if flow in self._tokens or len(self._tokens) < self.max_labels:
            return flow
        return OTHER

    def record(
        self,
        tenancy: RequestTenancy,
        status: str,
        prompt: int,
        cached: int | None,
        completion: int,
    ) -> None:
        tenant = self._label(tenancy.flow)
        key = (tenant, tenancy.priority.value, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = TENANT_REQUESTS.labels(*key)
        child.inc()
        if status != "ok":
            return
        tokens = self._tokens.get(tenant)
        if tokens is None:
            tokens = self._tokens[tenant] = (
                TENANT_PROMPT_TOKENS.labels(tenant),
                TENANT_CACHED_TOKENS.labels(tenant),
                TENANT_COMPLETION_TOKENS.labels(tenant),
            )
        tokens[0].inc(prompt)
        if cached:
            tokens[1].inc(cached)
        tokens[2].inc(completion)
