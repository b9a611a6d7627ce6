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

import asyncio
import os

import nats.errors
import nats.js.errors

from services.common import settings as S
from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import Alert, now

HOUR = 3600.0
log = get_logger("streams")

# JetStream reserves each file stream's max_bytes against the server's storage limit, so the
# sizes are a budget the operator sets once, split across the streams below (tests use a small
# one: many test namespaces share one server).
STREAM_STORAGE_MB = S.option(
    "stream_storage_mb",
    1024,
    "JetStream storage budget (MiB) for kvgate's streams: 50% KV events, 25% outcomes, 10% each alerts",
)


STREAM_REPLICAS = S.option(
    "stream_replicas",
    0,
    "replicas of each JetStream stream (0: 3 when the NATS cluster has 3 or more nodes, else 1);"
    " re-applied at every service start",
)


def _env_int(opt: S.Option) -> int:
    raw = os.environ.get(opt.env_var, "")
    try:
        return int(raw) if raw else opt.default
    except ValueError:
        raise SystemExit(f"invalid {opt.env_var}={raw!r}: an integer") from None


def _budget(fraction: float) -> int:
    return max(1 << 20, int(_env_int(STREAM_STORAGE_MB) * fraction) << 20)


def cluster_size(bus: Bus) -> int:
    """NATS servers this connection knows: the seed URLs plus the ones the cluster gossips
    (INFO ``connect_urls``), de-duplicated by host:port."""
    nc = bus.nc
    if nc is None:
        return 1
    return max(1, len({srv.netloc for srv in nc.servers}))  # nats-py: the pool as URLs


def stream_replicas(bus: Bus) -> int:
    """The replica count for kvgate's streams: the setting, or 3 on a cluster of >= 3 nodes
    (a stream at 3 replicas keeps its quorum with any one node down), else 1."""
    configured = _env_int(STREAM_REPLICAS)
    if configured > 0:
        return configured
    return 3 if cluster_size(bus) >= 3 else 1


ENSURE_TIMEOUT_S = 60.0  # total time to get a stream created, across retries


async def _ensure(bus: Bus, name: str, subjects: list[str], **config) -> str:
    """Create/update the stream, retrying while JetStream does not answer in time: on a
    cluster, a replicated stream needs its Raft group formed, and several services starting
    together all ask at once (a timeout here is "not yet", not a failure)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ENSURE_TIMEOUT_S
    delay = 0.25
    while True:
        try:
            await bus.ensure_stream(name, subjects, num_replicas=stream_replicas(bus), **config)
            return name
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
            if loop.time() + delay > deadline:
                raise
            log.warning("stream setup timed out, retrying", stream=name, error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)


async def ensure_kv_events_stream(bus: Bus) -> str:
    s = bus.subjects
    return await _ensure(
        bus, s.kv_events_stream, [s.kv_events_all], max_age_s=HOUR, max_bytes=_budget(0.5)
    )


async def ensure_outcomes_stream(bus: Bus) -> str:
    s = bus.subjects
    return await _ensure(
        bus, s.outcomes_stream, [s.router_outcomes], max_age_s=24 * HOUR, max_bytes=_budget(0.25)
    )


async def ensure_policy_stream(bus: Bus) -> str:
    s = bus.subjects
    return await _ensure(
        bus,
        s.policy_stream,
        [s.policy_updated],
        max_msgs_per_subject=1,
        max_age_s=365 * 24 * HOUR,
        max_bytes=1 << 20,
    )


async def ensure_alert_streams(bus: Bus) -> tuple[str, str]:
    s = bus.subjects
    signals = await _ensure(
        bus,
        s.alert_signals_stream,
        [s.alert_signals_all],
        max_age_s=24 * HOUR,
        max_bytes=_budget(0.1),
    )
    alerts = await _ensure(
        bus, s.alerts_stream, [s.alerts_all], max_age_s=7 * 24 * HOUR, max_bytes=_budget(0.1)
    )
    return signals, alerts


async def raise_alert(bus: Bus, alert: Alert) -> None:
    """Send an alert signal (firing or resolved) to the alert manager, durably.

    Detectors call this on every state change; the manager de-duplicates by fingerprint,
    persists, and publishes ``alerts.<severity>.<kind>``.
    """
    if not alert.ts:
        alert.ts = now()
    await bus.js_publish(bus.subjects.alert_signal(alert.source), alert)
