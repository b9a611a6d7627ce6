"""Which tenant a request is for (from its API key, or a trusted gateway's header), and its
priority band: one call per request, answering a :class:`RequestTenancy`.

The router holds a :class:`TenantDirectory`: the tenants and their client API keys as the
admin API published them (``tenants.updated``, services.router.tenant_reload). Identity, in
this order:

1. a tenant key (``Authorization: Bearer <key>``): the key's tenant. The directory holds only
   SHA-256 digests of keys (the admin API never stores or sends a key itself); a key is looked
   up by its digest, so the time taken does not depend on how much of a key matches. An
   expired key is refused at its ``expires_at`` exactly; a revoked key is absent from the
   directory and refused like an unknown one.
2. a static key (``--api-keys``): accepted as before, tenant-less (``NO_TENANT``).
3. a gateway's header (``x-kvgate-tenant``, or llm-d's ``x-gateway-inference-fairness-id``):
   believed only when the router runs with ``--trust-tenant-header`` (the gateway in front
   authenticates clients and sets it). Without the flag the header is ignored, never trusted.

The priority band is the key's (else its tenant's) default; the ``x-kvgate-priority`` header
changes it only when the key allows it (``allow_priority_header``) or the tenant came from a
trusted gateway's header. A band the request may not choose is ignored, not refused; a band
that is not one of critical / standard / sheddable is a 400.

Invariants: the directory is replaced whole (one attribute swap), so a request sees one
revision of it; nothing here does I/O; a key's secret is never logged or kept.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.common.schemas import TenantKeyRecord, TenantRecord, TenantsUpdated
from services.common.tenancy import (
    LLMD_FAIRNESS_HEADER,
    NO_TENANT,
    PRIORITY_HEADER,
    TENANT_HEADER,
    Priority,
    RequestTenancy,
    Tenant,
    TenantQuota,
)

MAX_TENANT_HEADER_CHARS = 64
UNLIMITED = TenantQuota()


class TenancyError(Exception):
    """A request whose tenancy cannot be given: answered ``status`` in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """A tenant key as the router holds it (no secret: its digest is the directory's index)."""

    key_id: int
    tenant_id: str
    priority: Priority | None
    allow_priority_header: bool
    expires_at: float | None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of ``Authorization: Bearer <key>``, or None."""
    auth = headers.get("Authorization", "") or headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def tenant_of(rec: TenantRecord) -> Tenant:
    return Tenant(
        tenant_id=rec.tenant_id,
        weight=rec.weight,
        default_priority=Priority(rec.default_priority),
        quota=TenantQuota(
            requests_per_min=rec.requests_per_min,
            input_tokens_per_min=rec.input_tokens_per_min,
            output_tokens_per_min=rec.output_tokens_per_min,
            concurrent_requests=rec.concurrent_requests,
            cache_budget_blocks=rec.cache_budget_blocks,
        ),
        cache_isolation=rec.cache_isolation,
    )


def key_of(rec: TenantKeyRecord) -> KeyEntry:
    return KeyEntry(
        rec.key_id,
        rec.tenant_id,
        Priority(rec.priority) if rec.priority else None,
        rec.allow_priority_header,
        rec.expires_at,
    )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    revision: int
    tenants: dict[str, Tenant]
    salts: dict[str, str]  # tenant id -> cache salt, isolated tenants only
    keys: dict[bytes, KeyEntry]  # sha256 digest -> key
    budgets: dict[str, int]  # tenant id -> cache_budget_blocks, tenants with one only


_EMPTY = _Snapshot(-1, {}, {}, {}, {})


class TenantDirectory:
    """The tenants and tenant keys a router knows (replaced whole by :meth:`apply`)."""

    def __init__(self, trust_header: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.trust_header = trust_header
        self.clock = clock
        self._snap = _EMPTY

    # ------------------------------------------------------------------ updates
    @property
    def revision(self) -> int:
        """The applied directory's revision (-1: none yet)."""
        return self._snap.revision

    def apply(self, msg: TenantsUpdated) -> bool:
        """Take ``msg`` if it is newer than the directory held; True when taken."""
        if msg.revision <= self._snap.revision:
            return False
        tenants = {r.tenant_id: tenant_of(r) for r in msg.tenants}
        salts = {r.tenant_id: r.cache_salt for r in msg.tenants if r.cache_isolation}
        keys: dict[bytes, KeyEntry] = {}
        for k in msg.keys:
            if k.tenant_id in tenants:  # a key of a tenant not in the message: not valid
                keys[bytes.fromhex(k.digest)] = key_of(k)
        budgets = {
            r.tenant_id: r.cache_budget_blocks
            for r in msg.tenants
            if r.cache_budget_blocks is not None
        }
        self._snap = _Snapshot(msg.revision, tenants, salts, keys, budgets)
        return True

    # ------------------------------------------------------------------ reads
    @property
    def has_keys(self) -> bool:
        return bool(self._snap.keys)

    def __len__(self) -> int:
        return len(self._snap.tenants)

    def tenant_ids(self) -> list[str]:
        return sorted(self._snap.tenants)

    def get(self, tenant_id: str) -> Tenant | None:
        """The registered tenant (quota, weight), or None."""
        return self._snap.tenants.get(tenant_id)

    def tenant(self, tenant_id: str) -> Tenant:
        """The registered tenant, or the defaults (weight 1, no quota) for an unregistered one
        (a trusted gateway may name tenants the admin API does not know)."""
        return self._snap.tenants.get(tenant_id) or Tenant(tenant_id=tenant_id)

    def quota_of(self, tenant_id: str) -> TenantQuota:
        """The tenant's quota (unlimited for an unregistered tenant)."""
        t = self._snap.tenants.get(tenant_id)
        return t.quota if t is not None else UNLIMITED

    def cache_budgets(self) -> dict[str, int]:
        """``cache_budget_blocks`` of the tenants that have one."""
        return self._snap.budgets

    def resolve_key(self, key: str) -> KeyEntry | None:
        """The tenant key ``key`` is (expired ones included: see :meth:`key_refusal`)."""
        return self._snap.keys.get(key_digest(key))

    def key_refusal(self, key: str) -> str:
        """Why a presented key is not a usable tenant key: "" (usable), ``unknown`` or
        ``expired``."""
        entry = self.resolve_key(key)
        if entry is None:
            return "unknown"
        return "expired" if entry.expired(self.clock()) else ""

    def request_tenancy(
        self, headers: Mapping[str, str], api_key: str | None = None
    ) -> RequestTenancy:
        """The tenancy of one request whose key (if any) the public surface accepted. Raises
        :class:`TenancyError` for an expired key (it may have expired since) or a bad band."""
        snap = self._snap
        if not snap.keys and not self.trust_header:  # no tenants can be named: the fast path
            return NO_TENANT
        if api_key is not None:
            entry = snap.keys.get(key_digest(api_key))
            if entry is not None:
                if entry.expired(self.clock()):
                    raise TenancyError(401, "API key expired")
                tenant = snap.tenants[entry.tenant_id]
                priority = entry.priority or tenant.default_priority
                if entry.allow_priority_header:
                    priority = _priority_header(headers, priority)
                return self._tenancy(snap, tenant, priority)
        if self.trust_header:
            named = headers.get(TENANT_HEADER) or headers.get(LLMD_FAIRNESS_HEADER)
            if named:
                if len(named) > MAX_TENANT_HEADER_CHARS or not named.isprintable():
                    raise TenancyError(
                        400, f"{TENANT_HEADER} must be 1..{MAX_TENANT_HEADER_CHARS} characters",
                        TENANT_HEADER,
                    )  # fmt: skip
                tenant = snap.tenants.get(named) or Tenant(tenant_id=named)
                priority = _priority_header(headers, tenant.default_priority)
                return self._tenancy(snap, tenant, priority)
        return NO_TENANT

    def tenancy_of(self, request: Any) -> RequestTenancy:
        """:meth:`request_tenancy` of a router request (its headers and bearer key)."""
        headers = request.headers
        return self.request_tenancy(headers, bearer_key(headers))

    @staticmethod
    def _tenancy(snap: _Snapshot, tenant: Tenant, priority: Priority) -> RequestTenancy:
        return RequestTenancy(
            tenant.tenant_id, priority, tenant.weight, snap.salts.get(tenant.tenant_id)
        )


def _priority_header(headers: Mapping[str, str], default: Priority) -> Priority:
    named = headers.get(PRIORITY_HEADER)
    if not named:
        return default
    try:
        return Priority(named.strip().lower())
    except ValueError:
        raise TenancyError(
            400,
            f"{PRIORITY_HEADER} must be one of {', '.join(p.value for p in Priority)}",
            PRIORITY_HEADER,
        ) from None


def request_tenancy(
    headers: Mapping[str, str],
    api_key: str | None = None,
    directory: TenantDirectory | None = None,
) -> RequestTenancy:
    """The tenancy of one request. Without a tenant directory every request is tenant-less."""
    if directory is None:
        return NO_TENANT
    return directory.request_tenancy(headers, api_key)
