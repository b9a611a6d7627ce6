"""What a router believes from the bus (defence in depth behind NATS permissions).

- A heartbeat counts only when it arrives on its own worker's subject
  (``workers.heartbeat.<id>`` with payload ``worker_id == id``): a credential allowed to speak
  for one worker cannot announce another.
- ``policy.updated`` and ``workers.control.*`` count only when signed by a trusted key (the api's,
  services.common.signing), when the router is given trusted keys; and, when live, only once,
  fresh and in order (services.common.replay_guard: ``stale``, ``future``, ``replayed``,
  ``out_of_order``), so a captured drain cannot be replayed after an uncordon.
- The POLICY stream's newest notice, read at start, is exempt from the freshness window (it
  may rightly be days old: it is the api's last activation, and the stream keeps only the
  newest) but not from the signature: one that fails it is skipped and the api is asked to
  repair the stream (``policy.revision`` with ``repair``), whose re-published notice then
  arrives live.
- A policy notice counts only when its revision is not above the one the api stored (asked of
  the api; else the newest notice in the POLICY stream). A revision above the stored one is
  "from the future" (a forgery or a replay into a fresh stream): it is rejected rather than
  allowed to lock out every later legitimate revision.

Every rejection is counted in ``kvgate_router_rejected_messages_total{type,reason}``, logged
(rate-limited) and raised as a critical ``forged_message`` alert.

Invariant: the checks are functions of the message, its subject and headers, the stored
revision and the replay guard's record of accepted envelopes; nothing here changes router state
other than that record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import Counter

from services.common.logging import RateLimiter, get_logger
from services.common.replay_guard import ReplayGuard
from services.common.schemas import (
    Alert,
    PolicyRevisionReply,
    PolicyRevisionRequest,
    PolicyUpdated,
    SchemaError,
    WorkerControl,
    WorkerHeartbeat,
    decode,
)
from services.common.signing import Envelope, Verifier
from services.common.subjects import Subjects

log = get_logger("router.trust")

REJECTED = Counter(
    "kvgate_router_rejected_messages_total",
    "Bus messages the router refused to believe (forged or unverifiable)",
    ["type", "reason"],
)


_FORGERY_REMEDY = (
    "Someone with access to the bus published a message the api did not send. "
    "Check which NATS credential published it (nats-server logs, connection names), "
    "revoke it, and check the NATS authorization config (kvgate nats-config)."
)
_REPLAY_REMEDY = (
    "Someone with access to the bus re-published a message the api signed earlier (a "
    "captured order). Check which NATS credential published it (nats-server logs, connection "
    "names), revoke it, and check the NATS authorization config (kvgate nats-config)."
)
_CLOCK_REMEDY = (
    "A signed message was dated outside this router's window: either the api's and this "
    "router's clocks disagree (check NTP on both; the window is --signed-max-age-s / "
    "--signed-max-skew-s) or someone re-published an old api message: check which NATS "
    "credential published it (nats-server logs) and revoke it."
)
REMEDIES = {
    "stale": _CLOCK_REMEDY,
    "future": _CLOCK_REMEDY,
    "replayed": _REPLAY_REMEDY,
    "out_of_order": _REPLAY_REMEDY,
}


def heartbeat_reason(subjects: Subjects, subject: str, hb: WorkerHeartbeat) -> str:
    """ "" when the heartbeat came on its own worker's subject."""
    try:
        own = subjects.heartbeat(hb.worker_id)
    except ValueError:
        return "bad_worker_id"
    return "" if subject == own else "subject_mismatch"


def control_reason(subjects: Subjects, subject: str, ctl: WorkerControl) -> str:
    try:
        own = subjects.worker_control(ctl.worker_id)
    except ValueError:
        return "bad_worker_id"
    return "" if subject == own else "subject_mismatch"


def revision_reason(notice_revision: int, stored_revision: int | None) -> str:
    """Compare a notice with the api's stored revision (None: the stream has none to compare)."""
    if stored_revision is None:
        return ""
    if notice_revision > stored_revision:
        return "future_revision"
    return ""  # equal: the current one; lower: stale, dropped by the policy holder as before


async def stored_policy_revision(bus: Any, expected: int, router_id: str = "") -> int | None:
    """The policy revision the api stored: asked of the api (``policy.revision``); when no api
    answers, the newest notice in the POLICY stream; None when neither is there."""
    try:
        reply = await bus.request(
            bus.subjects.policy_revision,
            PolicyRevisionRequest(router_id=router_id),
            PolicyRevisionReply,
            timeout=1.0,
        )
        return reply.revision
    except (TimeoutError, SchemaError):
        pass
    except Exception as exc:  # disconnected: the stream may still answer after reconnecting
        log.debug("policy revision request failed", error=repr(exc))
    return await _stream_policy_revision(bus, expected)


async def _stream_policy_revision(bus: Any, expected: int, tries: int = 3) -> int | None:
    """The api publishes through JetStream, so its notice reaches subscribers while the stream
    stores it: a stored revision below the notice's is looked up again, briefly."""
    subjects = bus.subjects
    stored: int | None = None
    for attempt in range(tries):
        try:
            raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
            stored = decode(PolicyUpdated, raw.data).revision
        except SchemaError:
            return None
        except Exception:  # no stream or no message yet, JetStream away: nothing to compare
            return None
        if stored >= expected or attempt == tries - 1:
            return stored
        await asyncio.sleep(0.05 * (attempt + 1))
    return stored


def _describe(env: Envelope) -> str:
    return f"instance {env.instance} seq {env.seq} issued_at_ms {env.issued_at_ms}"


class BusTrust:
    def __init__(
        self,
        subjects: Subjects,
        verifier: Verifier,
        router_id: str,
        raise_alert: Callable[[Alert], Awaitable[None]],
        spawn: Callable[[Awaitable[None]], Any],
        replay: ReplayGuard | None = None,
    ) -> None:
        self.subjects = subjects
        self.verifier = verifier
        self.replay = replay or ReplayGuard()
        self.router_id = router_id
        self._raise_alert = raise_alert
        self._spawn = spawn
        self._log = RateLimiter(60.0)

    def reject(self, type_name: str, reason: str, subject: str, detail: str = "") -> None:
        REJECTED.labels(type_name, reason).inc()
        key = (type_name, reason)
        if not self._log.allow(key):
            return
        log.warning(
            "bus message rejected",
            type=type_name,
            reason=reason,
            subject=subject,
            detail=detail,
            suppressed=self._log.take_suppressed(key),
        )
        alert = Alert(
            fingerprint=f"forged_message:{type_name}:{reason}:{self.router_id}",
            kind="forged_message",
            severity="critical",
            source="router",
            summary=f"router {self.router_id} rejected a {type_name} on {subject} ({reason})",
            remedy=REMEDIES.get(reason, _FORGERY_REMEDY),
            details={"router_id": self.router_id, "type": type_name, "reason": reason},
        )
        self._spawn(self._send(alert))

    async def _send(self, alert: Alert) -> None:
        try:
            await self._raise_alert(alert)
        except Exception as exc:
            log.warning("alert not sent", kind=alert.kind, error=repr(exc))

    # ------------------------------------------------------------------ checks
    def heartbeat_ok(self, hb: WorkerHeartbeat, raw: Any) -> bool:
        reason = heartbeat_reason(self.subjects, raw.subject, hb)
        if reason:
            self.reject("WorkerHeartbeat", reason, raw.subject, f"payload worker {hb.worker_id}")
        return not reason

    def _signed_ok(self, type_name: str, raw: Any) -> bool:
        """A live message: signed (when keys are configured), fresh, new and in order."""
        headers: Mapping[str, str] | None = getattr(raw, "headers", None)
        verdict = self.verifier.verify(raw.subject, raw.data, headers)
        if verdict.reason:
            self.reject(type_name, verdict.reason, raw.subject)
            return False
        if verdict.envelope is None:  # no trusted keys: nothing is signed to check
            return True
        reason = self.replay.check(raw.subject, verdict.envelope)
        if reason:
            self.reject(type_name, reason, raw.subject, _describe(verdict.envelope))
        return not reason

    def signed_ok(self, type_name: str, raw: Any) -> bool:
        """Any other api message (e.g. ``tenants.updated``): signed as configured, fresh, new
        and in order."""
        return self._signed_ok(type_name, raw)

    def control_ok(self, ctl: WorkerControl, raw: Any) -> bool:
        reason = control_reason(self.subjects, raw.subject, ctl)
        if reason:
            self.reject("WorkerControl", reason, raw.subject, f"payload worker {ctl.worker_id}")
            return False
        return self._signed_ok("WorkerControl", raw)

    def policy_signed_ok(self, raw: Any) -> bool:
        return self._signed_ok("PolicyUpdated", raw)

    async def stored_policy_ok(self, bus: Any, raw: Any) -> bool:
        """The POLICY stream's newest notice, read at start: signed (no freshness window: it
        is the api's last activation, however old) and not above the api's revision. When it
        fails, the api is asked to re-publish its own notice, which then arrives live."""
        headers: Mapping[str, str] | None = getattr(raw, "headers", None)
        verdict = self.verifier.verify(raw.subject, raw.data, headers)
        if verdict.reason:
            self.reject("PolicyUpdated", verdict.reason, raw.subject, "stored notice")
            self._spawn(self.request_policy_repair(bus))
            return False
        try:
            msg = decode(PolicyUpdated, raw.data)
        except SchemaError:
            return True  # the loader reports an invalid stored notice itself
        stored = await stored_policy_revision(bus, msg.revision, self.router_id)
        if not self.policy_revision_ok(msg, stored, raw.subject):
            self._spawn(self.request_policy_repair(bus))
            return False
        if stored is not None and msg.revision < stored:  # a lost publish (or an old replay):
            self._spawn(self.request_policy_repair(bus))  # apply it until the api's arrives
        if verdict.envelope is not None:
            self.replay.note_stored(raw.subject, verdict.envelope)
        return True

    async def request_policy_repair(self, bus: Any) -> None:
        """Ask the api to re-publish its notice over the one the stream holds (best effort: its
        periodic resync does the same)."""
        try:
            await bus.request(
                bus.subjects.policy_revision,
                PolicyRevisionRequest(router_id=self.router_id, repair=True),
                PolicyRevisionReply,
                timeout=2.0,
            )
        except Exception as exc:  # no api now: its resync repairs the stream when it runs
            log.warning("policy repair request not answered", error=repr(exc)[:200])

    def policy_revision_ok(self, msg: PolicyUpdated, stored: int | None, subject: str) -> bool:
        reason = revision_reason(msg.revision, stored)
        if reason:
            self.reject(
                "PolicyUpdated", reason, subject, f"revision {msg.revision} > stored {stored}"
            )
        return not reason

    # ------------------------------------------------------------------ handler guards
    def guard_heartbeat(self, handler: Callable[[WorkerHeartbeat, Any], Awaitable[None]]):
        """``handler`` for heartbeats that came on their own worker's subject only."""

        async def on(hb: WorkerHeartbeat, raw: Any) -> None:
            if self.heartbeat_ok(hb, raw):
                await handler(hb, raw)

        return on

    def guard_control(self, handler: Callable[[WorkerControl, Any], Awaitable[None]]):
        async def on(ctl: WorkerControl, raw: Any) -> None:
            if self.control_ok(ctl, raw):
                await handler(ctl, raw)

        return on

    def guard_policy(self, bus: Any, handler: Callable[[PolicyUpdated, Any], Awaitable[None]]):
        """``handler`` for notices signed as configured and not above the api's revision."""

        async def on(msg: PolicyUpdated, raw: Any) -> None:
            if not self.policy_signed_ok(raw):
                return
            stored = await stored_policy_revision(bus, msg.revision, self.router_id)
            if self.policy_revision_ok(msg, stored, raw.subject):
                await handler(msg, raw)

        return on
