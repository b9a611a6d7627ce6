"""Tenant directory hot reload: ``tenants.updated`` notices applied to the router's
:class:`~services.router.tenant_identity.TenantDirectory`.

At start the newest directory kept by the TENANTS stream is applied (none: the router has no
tenants; static ``--api-keys`` and an open router work as before). Live notices count only
when signed by a trusted key (when the router has trusted keys) and fresh, new and in order
(services.router.trust, like policy notices); the stored one read at start only when signed.

Invariants: a rejected or stale notice changes nothing; the directory is replaced whole;
``applied`` is set (then replaced by a fresh event) on each applied directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import SchemaError, TenantsUpdated, decode
from services.router.tenant_identity import TenantDirectory
from services.router.trust import BusTrust

log = get_logger("router.tenants")

TENANT_UPDATES = Counter(
    "kvgate_router_tenant_updates_total",
    "tenants.updated notices by result (applied, stale, rejected)",
    ["result"],
)
TENANT_REVISION = Gauge(
    "kvgate_router_tenant_directory_revision", "Revision of the tenant directory in force"
)
TENANTS_KNOWN = Gauge("kvgate_router_tenants", "Tenants in the router's directory")


class TenantReload:
    def __init__(self, bus: Bus, directory: TenantDirectory, trust: BusTrust) -> None:
        self.bus = bus
        self.directory = directory
        self.trust = trust
        self.applied = asyncio.Event()  # set on each applied directory (tests wait on it)
        self.on_applied: Callable[[], None] | None = None

    async def on_tenants(self, msg: TenantsUpdated, raw: Any) -> None:
        if not self.trust.signed_ok("TenantsUpdated", raw):
            TENANT_UPDATES.labels("rejected").inc()
            return
        self.apply(msg)

    def apply(self, msg: TenantsUpdated) -> bool:
        if not self.directory.apply(msg):
            TENANT_UPDATES.labels("stale").inc()
            return False
        TENANT_UPDATES.labels("applied").inc()
        TENANT_REVISION.set(msg.revision)
        TENANTS_KNOWN.set(len(msg.tenants))
        log.info(
            "tenant directory applied",
            revision=msg.revision,
            tenants=len(msg.tenants),
            keys=len(msg.keys),
        )
        if self.on_applied is not None:
            self.on_applied()
        self.applied.set()
        self.applied = asyncio.Event()
        return True

    async def load_latest(self) -> None:
        """At start: the newest directory kept by the TENANTS stream, if any and signed."""
        s = self.bus.subjects
        try:  # read-only: the api owns the TENANTS stream
            raw = await self.bus.js.get_last_msg(s.tenants_stream, s.tenants_updated)
        except Exception as exc:  # no directory published yet, or JetStream unavailable
            log.info("no published tenant directory", why=type(exc).__name__)
            return
        headers: Mapping[str, str] | None = getattr(raw, "headers", None)
        verdict = self.trust.verifier.verify(raw.subject, raw.data, headers)
        if verdict.reason:
            TENANT_UPDATES.labels("rejected").inc()
            self.trust.reject("TenantsUpdated", verdict.reason, raw.subject, "stored directory")
            return
        try:
            msg = decode(TenantsUpdated, raw.data)
        except SchemaError as exc:
            TENANT_UPDATES.labels("rejected").inc()
            log.error("stored tenant directory is invalid", error=str(exc))
            return
        if verdict.envelope is not None:
            self.trust.replay.note_stored(raw.subject, verdict.envelope)
        self.apply(msg)
