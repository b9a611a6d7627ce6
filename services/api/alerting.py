"""The alert manager: raw signals in, de-duplicated persisted alerts out.

Flow: detectors and routers ``raise_alert`` -> JetStream ALERT_SIGNALS
(``alerting.signals.<source>``) -> this manager (durable consumer shared by API replicas) ->
Postgres ``alerts`` -> JetStream ALERTS (``alerts.<severity>.<kind>``) for operators.

Invariants:
- At most one open alert (firing or acknowledged) per fingerprint (unique partial index); a
  repeated firing signal only bumps ``count`` / ``last_seen`` and is not re-published unless
  its severity changed.
- A resolved signal (or a resolve by hand) closes the open alert and publishes the
  resolution; a resolved signal for a fingerprint with no open alert is ignored.
- An alert matching an active silence is persisted (``silenced = true``) but not published.
- A signal is acknowledged to JetStream only after its Postgres transaction committed;
  while Postgres is down signals are redelivered later, so none is lost.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter
from sqlalchemy import and_, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.db import Database, is_unavailable
from services.api.models import AlertRow, Silence
from services.api.pull import PullLoop
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import Alert, SchemaError, decode
from services.common.streams import require_alert_streams

log = get_logger("api.alerts")

SIGNALS = Counter("kvgate_api_alert_signals_total", "Alert signals handled", ["result"])
PUBLISHED = Counter("kvgate_api_alerts_published_total", "Managed alerts published", ["state"])


def alert_dict(a: AlertRow) -> dict[str, Any]:
    return {
        "id": a.id,
        "fingerprint": a.fingerprint,
        "kind": a.kind,
        "severity": a.severity,
        "state": a.state,
        "source": a.source,
        "worker_id": a.worker_id,
        "summary": a.summary,
        "remedy": a.remedy,
        "details": a.details,
        "count": a.count,
        "silenced": a.silenced,
        "first_seen": a.first_seen.isoformat() if a.first_seen else None,
        "last_seen": a.last_seen.isoformat() if a.last_seen else None,
        "acked_by": a.acked_by,
        "acked_at": a.acked_at.isoformat() if a.acked_at else None,
        "resolved_by": a.resolved_by,
        "resolved_at": a.resolved_at.isoformat() if a.resolved_at else None,
    }


def silence_dict(s: Silence) -> dict[str, Any]:
    return {
        "id": s.id,
        "fingerprint": s.fingerprint,
        "kind": s.kind,
        "worker_id": s.worker_id,
        "severity": s.severity,
        "comment": s.comment,
        "created_by": s.created_by,
        "created_at": s.created_at.isoformat() if s.created_at else None,
        "ends_at": s.ends_at.isoformat() if s.ends_at else None,
    }


def resolution_summary(a: AlertRow) -> str:
    """What a resolved alert says: the source's resolution text, else who resolved what.
    (The row keeps the opening text as its summary, for the record.)"""
    text = (a.details or {}).get("resolution")
    if isinstance(text, str) and text:
        return text
    return f"resolved by {a.resolved_by or 'unknown'}; was: {a.summary}"[:2000]


def to_message(a: AlertRow) -> Alert:
    state = "resolved" if a.state == "resolved" else "firing"
    return Alert(
        fingerprint=a.fingerprint,
        kind=a.kind,
        severity=a.severity,  # type: ignore[arg-type]
        state=state,
        source=a.source,
        worker_id=a.worker_id,
        summary=resolution_summary(a) if state == "resolved" else a.summary,
        remedy="" if state == "resolved" else a.remedy,
        details=a.details or {},
        ts=datetime.now(UTC).timestamp(),
        alert_id=a.id,
    )


async def is_silenced(s: AsyncSession, a: AlertRow, now: datetime | None = None) -> bool:
    now = now or datetime.now(UTC)

    def match(col, value):
        return or_(col.is_(None), col == value) if value is not None else col.is_(None)

    q = (
        select(Silence.id)
        .where(
            Silence.ends_at > now,
            match(Silence.fingerprint, a.fingerprint),
            match(Silence.kind, a.kind),
            match(Silence.worker_id, a.worker_id),
            match(Silence.severity, a.severity),
        )
        .limit(1)
    )
    return (await s.execute(q)).first() is not None


async def open_alert(s: AsyncSession, fingerprint: str) -> AlertRow | None:
    return (
        await s.execute(
            select(AlertRow)
            .where(
                AlertRow.fingerprint == fingerprint,
                AlertRow.state.in_(("firing", "acknowledged")),
            )
            .with_for_update()
        )
    ).scalar_one_or_none()


async def apply_signal(s: AsyncSession, sig: Alert) -> AlertRow | None:
    """Persist one signal; returns the alert to publish (None: nothing to publish)."""
    now = datetime.now(UTC)
    existing = await open_alert(s, sig.fingerprint)
    if sig.state == "resolved":
        if existing is None:
            return None
        existing.state = "resolved"
        existing.resolved_at = now
        existing.resolved_by = f"source:{sig.source}"
        existing.last_seen = now
        existing.details = {
            **(existing.details or {}),
            "resolution": sig.summary or f"{sig.kind} resolved",
        }
        return None if existing.silenced else existing
    if existing is not None:
        severity_changed = existing.severity != sig.severity
        existing.count += 1
        existing.last_seen = now
        existing.severity = sig.severity
        existing.summary = sig.summary
        existing.remedy = sig.remedy
        existing.details = sig.details
        if severity_changed:
            existing.silenced = await is_silenced(s, existing, now)
            return None if existing.silenced else existing
        return None
    row = AlertRow(
        id=str(uuid.uuid4()),
        fingerprint=sig.fingerprint,
        kind=sig.kind,
        severity=sig.severity,
        state="firing",
        source=sig.source,
        worker_id=sig.worker_id,
        summary=sig.summary,
        remedy=sig.remedy,
        details=sig.details,
        count=1,
        first_seen=now,
        last_seen=now,
    )
    row.silenced = await is_silenced(s, row, now)
    s.add(row)
    await s.flush()
    return None if row.silenced else row


class AlertManager:
    def __init__(self, db: Database, bus: Bus, retry_s: float = 1.0) -> None:
        self.db = db
        self.bus = bus
        self.retry_s = retry_s
        self._log = RateLimiter(30.0)
        self.handled = asyncio.Event()  # set after each handled signal (tests await it)

    async def start(self) -> None:
        await require_alert_streams(self.bus)
        s = self.bus.subjects
        self._loop = PullLoop(
            self.bus,
            s.alert_signals_stream,
            s.alert_signals_all,
            s.durable("api_alert_manager"),
            self._handle,
            batch=64,
            retry_s=self.retry_s,
        )
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _handle(self, raw) -> bool:
        """True: ack (done, or can never succeed); False: nak (Postgres down, retry later)."""
        try:
            sig = decode(Alert, raw.data)
        except SchemaError as exc:
            SIGNALS.labels("invalid").inc()
            if self._log.allow(("invalid", raw.subject)):
                log.warning("invalid alert signal dropped", subject=raw.subject, error=str(exc))
            return True
        try:
            await self.handle_signal(sig)
        except Exception as exc:
            if is_unavailable(exc):
                SIGNALS.labels("retry_db_down").inc()
                if self._log.allow("db"):
                    log.warning(
                        "database down; alert signal will be redelivered", error=repr(exc)[:200]
                    )
                return False
            SIGNALS.labels("error").inc()
            log.exception("alert signal failed", fingerprint=sig.fingerprint)
        self.handled.set()
        return True

    async def handle_signal(self, sig: Alert) -> AlertRow | None:
        for attempt in range(3):
            try:
                async with self.db.transaction() as s:
                    to_publish = await apply_signal(s, sig)
                break
            except IntegrityError:  # another replica opened the same fingerprint: re-read
                if attempt == 2:
                    raise
        SIGNALS.labels("ok").inc()
        if to_publish is not None:
            await self.publish(to_publish)
        return to_publish

    async def publish(self, a: AlertRow) -> None:
        msg = to_message(a)
        try:
            await self.bus.js_publish(self.bus.subjects.alert(a.severity, a.kind), msg)
            PUBLISHED.labels(msg.state).inc()
        except Exception as exc:
            if self._log.allow("publish"):
                log.warning("alert publish failed", error=repr(exc), alert=a.id)


def alert_filters(q: dict[str, Any]) -> list[Any]:
    conds = []
    if "severity" in q:
        conds.append(AlertRow.severity == q["severity"])
    if "kind" in q:
        conds.append(AlertRow.kind == q["kind"])
    if "worker" in q:
        conds.append(AlertRow.worker_id == q["worker"])
    if "state" in q:
        conds.append(AlertRow.state == q["state"])
    return conds


def open_breakers_query():
    return select(AlertRow.worker_id).where(
        and_(
            AlertRow.kind.in_(("circuit_open", "breaker_open")),
            AlertRow.state.in_(("firing", "acknowledged")),
            AlertRow.worker_id.is_not(None),
        )
    )
