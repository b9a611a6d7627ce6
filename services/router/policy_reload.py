"""Policy hot reload: ``policy.updated`` notices applied to the router's :class:`PolicySet`.

At start the newest notice kept by the POLICY stream is applied (else ``--policy`` stays).
Invariants: an invalid notice is rejected, counted and logged, and the policies in force stay;
the request path only reads ``policies.arm(...)``, and a request keeps the policy it started
with; ``applied`` is set (then replaced by a fresh event) on each applied notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import PolicyUpdated, SchemaError, decode
from services.core.policy import PolicyError
from services.router import metrics as M
from services.router.canary import PolicySet, spec_of

log = get_logger("router")


class PolicyReload:
    def __init__(self, bus: Bus, policies: PolicySet) -> None:
        self.bus = bus
        self.policies = policies
        self.applied = asyncio.Event()  # set on each applied policy.updated (tests wait on it)

    async def on_policy(self, msg: PolicyUpdated, _raw: Any) -> None:
        self.apply(msg)

    def apply(self, msg: PolicyUpdated) -> bool:
        try:
            applied = self.policies.apply(msg)
        except PolicyError as exc:
            M.POLICY_UPDATES.labels("invalid").inc()
            log.error("policy.updated rejected", revision=msg.revision, error=str(exc))
            return False
        if applied:
            M.POLICY_UPDATES.labels("applied").inc()
            log.info(
                "policy applied",
                revision=msg.revision,
                policy=spec_of(msg.name, msg.spec),
                canary=msg.canary.canary_id if msg.canary else None,
            )
            self.applied.set()
            self.applied = asyncio.Event()
        else:
            M.POLICY_UPDATES.labels("stale").inc()
        return applied

    async def load_latest(self, accept: Callable[[Any], Awaitable[bool]] | None = None) -> None:
        """At start: the newest notice kept by the POLICY stream, if any (else --policy), when
        ``accept(raw)`` (its signature and revision check out: services.router.trust)."""
        try:
            # read-only: the api owns the POLICY stream (a router's credential may not change it)
            stream = self.bus.subjects.policy_stream
            raw = await self.bus.js.get_last_msg(stream, self.bus.subjects.policy_updated)
        except Exception as exc:  # no message yet, or JetStream unavailable
            log.info(
                "no published policy; using --policy",
                policy=self.policies.control.spec,
                why=type(exc).__name__,
            )
            return
        if accept is not None and not await accept(raw):
            return
        try:
            self.apply(decode(PolicyUpdated, raw.data))
        except SchemaError as exc:
            log.error("stored policy notice is invalid", error=str(exc))
