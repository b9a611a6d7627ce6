"""JetStream streams, configured in one place; every publisher and consumer calls these
idempotent setup functions, so start order does not matter.

- KV_EVENTS (``kv.events.*``): file storage, 1 h / 2 GiB; the indexer's durable consumer
  replays from here after a restart, and a gap can be refilled from it.
- OUTCOMES (``router.outcomes``): 24 h; the canary evaluator's durable consumer.
- POLICY (``policy.updated``): keeps only the newest notice, so a router that starts later
  reads the active policy at once.
- ALERT_SIGNALS (``alerting.signals.*``): raw signals from detectors and routers, kept until
  the alert manager has consumed them (survives an API outage).
- ALERTS (``alerts.>``): managed alerts, 7 days, so late subscribers can replay.
"""

from __future__ import annotations

from services.common.bus import Bus
from services.common.schemas import Alert, now

HOUR = 3600.0


async def ensure_kv_events_stream(bus: Bus) -> str:
    s = bus.subjects
    await bus.ensure_stream(
        s.kv_events_stream, [s.kv_events_all], max_age_s=HOUR, max_bytes=2 << 30
    )
    return s.kv_events_stream


async def ensure_outcomes_stream(bus: Bus) -> str:
    s = bus.subjects
    await bus.ensure_stream(
        s.outcomes_stream, [s.router_outcomes], max_age_s=24 * HOUR, max_bytes=1 << 30
    )
    return s.outcomes_stream


async def ensure_policy_stream(bus: Bus) -> str:
    s = bus.subjects
    await bus.ensure_stream(
        s.policy_stream, [s.policy_updated], max_msgs_per_subject=1, max_age_s=365 * 24 * HOUR
    )
    return s.policy_stream


async def ensure_alert_streams(bus: Bus) -> tuple[str, str]:
    s = bus.subjects
    await bus.ensure_stream(
        s.alert_signals_stream, [s.alert_signals_all], max_age_s=24 * HOUR, max_bytes=256 << 20
    )
    await bus.ensure_stream(
        s.alerts_stream, [s.alerts_all], max_age_s=7 * 24 * HOUR, max_bytes=256 << 20
    )
    return s.alert_signals_stream, s.alerts_stream


async def raise_alert(bus: Bus, alert: Alert) -> None:
    """Send an alert signal (firing or resolved) to the alert manager, durably.

    Detectors call this on every state change; the manager de-duplicates by fingerprint,
    persists, and publishes ``alerts.<severity>.<kind>``.
    """
    if not alert.ts:
        alert.ts = now()
    await bus.js_publish(bus.subjects.alert_signal(alert.source), alert)
