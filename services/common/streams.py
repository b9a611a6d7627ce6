"""JetStream streams: their provisioned configuration in one place, the admin step that applies
it, and the check every service makes before it uses a stream.

- KV_EVENTS (``kv.events.*``): file storage, 1 h / 2 GiB; the indexer's durable consumer
  replays from here after a restart, and a gap can be refilled from it.
- OUTCOMES (``router.outcomes``): 24 h; the canary evaluator's durable consumer.
- POLICY (``policy.updated``): keeps only the newest notice, so a router that starts later
  reads the active policy at once.
- TENANTS (``tenants.updated``): keeps only the newest tenant directory, like POLICY.
- ALERT_SIGNALS (``alerting.signals.*``): raw signals from detectors and routers, kept until
  the alert manager has consumed them (survives an API outage).
- ALERTS (``alerts.>``): managed alerts, 7 days, so late subscribers can replay.
- the HA indexers' lease bucket (JetStream key-value, stream ``KV_<bucket>``).

Invariant: streams are *provisioned, never reconfigured, by services*. Creating or updating a
stream is :func:`provision` (``kvgate bus provision``), run with a provisioning credential that no
long-running service holds (services.common.permissions' ``provisioner`` role). A service only
reads a stream's config (:func:`require_stream`) and refuses to use a stream whose
security-relevant settings (:func:`config_drift`: subjects, republish, mirror / sources,
subject transform, rollup, retention, age) differ from the provisioned ones: it counts, logs and
alerts, and keeps checking until an operator re-provisions. On a bus without credentials (a
development server open to anyone) a missing stream is created by the service itself, as there
is no credential to protect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from prometheus_client import Counter, Gauge

from services.common import settings as S
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import Alert, now
from services.common.subjects import Subjects

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
    " applied by `kvgate bus provision`",
)

# the HA indexers' lease lives this long without renewal: the lease bucket's max age, set by
# `kvgate bus provision` and checked by `kvgate indexer --lease-ttl` (one option for both)
LEASE_TTL = S.option(
    "lease_ttl",
    1.5,
    "high availability: seconds a lease lives without renewal (a standby takes over"
    " within about this long after the active indexer dies)",
    env="KVGATE_INDEXER_LEASE_TTL",
)

STREAM_REFUSED = Counter(
    "kvgate_bus_stream_refused_total",
    "Times a service found a stream it needs missing (not provisioned) or configured other than"
    " provisioned (drift), and did not use it",
    ["stream", "reason"],
)
STREAM_DRIFT = Gauge(
    "kvgate_bus_stream_config_drift",
    "1 while a stream this service needs differs from its provisioned configuration",
    ["stream"],
)


def _env_int(opt: S.Option) -> int:
    raw = os.environ.get(opt.env_var, "")
    try:
        return int(raw) if raw else opt.default
    except ValueError:
        raise SystemExit(f"invalid {opt.env_var}={raw!r}: an integer") from None


def _budget(fraction: float) -> int:
    return max(1 << 20, int(_env_int(STREAM_STORAGE_MB) * fraction) << 20)


def lease_ttl_s() -> float:
    return S.resolve(None, [LEASE_TTL]).lease_ttl


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


# --------------------------------------------------------------------------- what is provisioned
@dataclass(frozen=True)
class StreamSpec:
    """One stream as provisioned. ``max_bytes`` and the replica count are the operator's sizing
    (set at provisioning, not checked by services); the rest is checked by :func:`config_drift`."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int
    max_msgs_per_subject: int = -1
    storage: StorageType = StorageType.FILE
    lease_bucket: str = ""  # set for the lease bucket's stream: provisioned as a KV bucket


def kv_events_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(s.kv_events_stream, (s.kv_events_all,), HOUR, _budget(0.5))


def outcomes_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(s.outcomes_stream, (s.router_outcomes,), 24 * HOUR, _budget(0.25))


def policy_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(
        s.policy_stream, (s.policy_updated,), 365 * 24 * HOUR, 1 << 20, max_msgs_per_subject=1
    )


def tenants_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(
        s.tenants_stream, (s.tenants_updated,), 365 * 24 * HOUR, 64 << 20, max_msgs_per_subject=1
    )


def alert_signals_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(s.alert_signals_stream, (s.alert_signals_all,), 24 * HOUR, _budget(0.1))


def alerts_spec(s: Subjects) -> StreamSpec:
    return StreamSpec(s.alerts_stream, (s.alerts_all,), 7 * 24 * HOUR, _budget(0.1))


def lease_bucket_spec(s: Subjects, ttl_s: float | None = None) -> StreamSpec:
    """The HA indexers' lease bucket: file storage, so it outlives a NATS restart (in memory it
    vanished with the server, and no service credential may create it again: every indexer
    then failed every lease attempt and none published)."""
    bucket = s.indexer_lease_bucket
    return StreamSpec(
        f"KV_{bucket}",
        (f"$KV.{bucket}.>",),
        lease_ttl_s() if ttl_s is None else ttl_s,
        -1,
        max_msgs_per_subject=1,
        storage=StorageType.FILE,
        lease_bucket=bucket,
    )


def all_specs(s: Subjects) -> list[StreamSpec]:
    """Every stream kvgate uses, in provisioning order."""
    return [
        kv_events_spec(s),
        outcomes_spec(s),
        policy_spec(s),
        tenants_spec(s),
        alert_signals_spec(s),
        alerts_spec(s),
        lease_bucket_spec(s),
    ]


def config_drift(spec: StreamSpec, cfg: StreamConfig) -> list[str]:
    """The security-relevant settings in which ``cfg`` (a stream's live config) differs from
    ``spec``, as ``field: live (provisioned ...)`` texts; empty when it is as provisioned.

    Checked: where messages go or come from (subjects, republish, mirror, sources, subject
    transform), who may remove them (rollup headers, retention) and how long they stay (age,
    per-subject limit). Sizes and replicas are the operator's and not checked."""
    out: list[str] = []
    if sorted(cfg.subjects or []) != sorted(spec.subjects):
        out.append(f"subjects: {cfg.subjects} (provisioned {list(spec.subjects)})")
    if cfg.republish is not None:
        out.append(f"republish: {cfg.republish.src} -> {cfg.republish.dest}")
    if cfg.mirror is not None:
        out.append(f"mirror: {cfg.mirror.name}")
    if cfg.sources:
        out.append(f"sources: {[src.name for src in cfg.sources]}")
    transform = getattr(cfg, "subject_transform", None)
    if transform is not None:
        out.append(f"subject_transform: {transform.src} -> {transform.dest}")
    if cfg.allow_rollup_hdrs and not spec.lease_bucket:  # a KV bucket rolls up by design
        out.append("allow_rollup_hdrs: true (provisioned false)")
    retention = getattr(cfg.retention, "value", cfg.retention)
    if retention not in (None, "limits"):
        out.append(f"retention: {retention} (provisioned limits)")
    if cfg.max_age is None or abs(cfg.max_age - spec.max_age_s) > 1e-3:
        out.append(f"max_age: {cfg.max_age} s (provisioned {spec.max_age_s} s)")
    per_subject = -1 if cfg.max_msgs_per_subject is None else cfg.max_msgs_per_subject
    if per_subject != spec.max_msgs_per_subject:
        out.append(f"max_msgs_per_subject: {per_subject} (provisioned {spec.max_msgs_per_subject})")
    return out


# --------------------------------------------------------------------------- the admin step
async def provision(bus: Bus, specs: list[StreamSpec] | None = None) -> list[tuple[str, str]]:
    """Create each stream or bring it to its provisioned config (``kvgate bus provision``;
    needs the provisioner's credential). Returns (stream, "created" | "updated" | "unchanged")."""
    done: list[tuple[str, str]] = []
    replicas = stream_replicas(bus)
    for spec in specs if specs is not None else all_specs(bus.subjects):
        try:
            before = (await bus.js.stream_info(spec.name)).config
        except nats.js.errors.NotFoundError:
            before = None
        if before is None:
            if spec.lease_bucket:
                await bus.js.create_key_value(_bucket_config(spec, replicas))
            else:
                await bus.js.add_stream(_stream_config(spec, replicas))
            done.append((spec.name, "created"))
            continue
        if spec.lease_bucket:  # the bucket's own settings (nats-py's KV layout) stay as made
            config = dataclasses.replace(
                before,
                max_age=spec.max_age_s,
                num_replicas=replicas,
                republish=None,
                subjects=list(spec.subjects),
            )
        else:
            config = _stream_config(spec, replicas)
        drift = config_drift(spec, before)
        await bus.js.update_stream(config)
        done.append(
            (spec.name, "updated" if drift or _sized_apart(before, config) else "unchanged")
        )
    return done


def _stream_config(spec: StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=spec.storage,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        num_replicas=replicas,
    )


def _bucket_config(spec: StreamSpec, replicas: int) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=spec.lease_bucket,
        history=1,
        ttl=spec.max_age_s,
        storage=spec.storage,
        replicas=replicas,
    )


def _sized_apart(before: StreamConfig, after: StreamConfig) -> bool:
    return (before.max_bytes, before.num_replicas) != (after.max_bytes, after.num_replicas)


# --------------------------------------------------------------------------- the service side
VERIFIED_FOR_S = 30.0  # a stream found as provisioned is not asked about again this long
REQUIRE_TIMEOUT_S = 60.0  # how long a service waits for a stream to be provisioned / mended

_alerted: set[tuple[str, str]] = set()  # (stream, drift) already alerted by this process
_refusal_log = RateLimiter(30.0)


class StreamUnavailable(RuntimeError):
    """A stream a service needs is not provisioned, or differs from its provisioned config."""


async def require_stream(bus: Bus, spec: StreamSpec, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    """Wait until ``spec``'s stream exists as provisioned; return its name.

    Missing: created here only on a bus without credentials, else waited for (`kvgate bus
    provision`). Drifted: counted, logged and alerted (once per drift), then waited for.
    Raises :class:`StreamUnavailable` after ``timeout_s``."""
    checked = bus.streams_verified
    if time.monotonic() - checked.get(spec.name, -1e18) < VERIFIED_FOR_S:
        return spec.name
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.25
    while True:
        reason = await _check_once(bus, spec)
        if not reason:
            STREAM_DRIFT.labels(spec.name).set(0)
            checked[spec.name] = time.monotonic()
            return spec.name
        if loop.time() + delay > deadline:
            raise StreamUnavailable(f"stream {spec.name}: {reason}")
        await asyncio.sleep(delay)  # backoff between checks of a server's state, no event to await
        delay = min(delay * 2, 5.0)


async def _check_once(bus: Bus, spec: StreamSpec) -> str:
    """ "" when the stream is usable, else why not (already counted, logged and alerted)."""
    try:
        info = await bus.js.stream_info(spec.name)
    except nats.js.errors.NotFoundError:
        if bus.auth.method == "none":
            try:
                await _create_unprovisioned(bus, spec)
                return ""
            except nats.js.errors.BadRequestError:
                return "created concurrently; checking again"  # another service won the race
        STREAM_REFUSED.labels(spec.name, "not_provisioned").inc()
        if _refusal_log.allow(("missing", spec.name)):
            log.warning(
                "stream not provisioned: run `kvgate bus provision`; waiting",
                stream=spec.name,
                suppressed=_refusal_log.take_suppressed(("missing", spec.name)),
            )
        return "not provisioned (run `kvgate bus provision`)"
    except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
        # on a cluster a replicated stream needs its Raft group formed: "not yet"
        if _refusal_log.allow(("timeout", spec.name)):
            log.warning("stream info timed out, retrying", stream=spec.name, error=repr(exc))
        return f"no answer from JetStream ({type(exc).__name__})"
    drift = config_drift(spec, info.config)
    if not drift:
        return ""
    await _refuse_drift(bus, spec.name, drift)
    return "configured other than provisioned: " + "; ".join(drift)


async def _create_unprovisioned(bus: Bus, spec: StreamSpec) -> None:
    """An open development server: the service provisions the one stream it needs."""
    if spec.lease_bucket:
        await bus.js.create_key_value(_bucket_config(spec, stream_replicas(bus)))
    else:
        await bus.js.add_stream(_stream_config(spec, stream_replicas(bus)))


async def _refuse_drift(bus: Bus, stream: str, drift: list[str]) -> None:
    STREAM_REFUSED.labels(stream, "drift").inc()
    STREAM_DRIFT.labels(stream).set(1)
    key = (stream, "; ".join(drift))
    if _refusal_log.allow(("drift", stream)):
        log.error(
            "stream configured other than provisioned: not using it",
            stream=stream,
            drift=drift,
            remedy="inspect it (nats stream info), re-run `kvgate bus provision`, rotate the"
            " credentials of the roles that could reach it",
            suppressed=_refusal_log.take_suppressed(("drift", stream)),
        )
    if key in _alerted:
        return
    _alerted.add(key)
    source = bus.role or "unknown"
    alert = Alert(
        fingerprint=f"stream_config_drift:{stream}",
        kind="stream_config_drift",
        severity="critical",
        source=source,
        summary=f"JetStream stream {stream} differs from its provisioned config: "
        + "; ".join(drift)[:1500],
        remedy="Someone changed the stream's configuration. Inspect it (`nats stream info`),"
        " re-run `kvgate bus provision` to restore it, and rotate the NATS credentials that"
        " could reach the JetStream API. Services refuse the stream until then.",
        details={"stream": stream, "drift": drift[:20]},
    )
    try:
        await raise_alert(bus, alert)
    except Exception as exc:  # no permission (workers) or the alert streams are the ones hit
        log.warning("stream drift alert not sent", stream=stream, error=repr(exc))


# --------------------------------------------------------------------------- per stream
async def require_kv_events_stream(bus: Bus, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    return await require_stream(bus, kv_events_spec(bus.subjects), timeout_s)


async def require_outcomes_stream(bus: Bus, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    return await require_stream(bus, outcomes_spec(bus.subjects), timeout_s)


async def require_policy_stream(bus: Bus, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    return await require_stream(bus, policy_spec(bus.subjects), timeout_s)


async def require_tenants_stream(bus: Bus, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    return await require_stream(bus, tenants_spec(bus.subjects), timeout_s)


async def require_alert_streams(bus: Bus, timeout_s: float = REQUIRE_TIMEOUT_S) -> tuple[str, str]:
    s = bus.subjects
    signals = await require_stream(bus, alert_signals_spec(s), timeout_s)
    alerts = await require_stream(bus, alerts_spec(s), timeout_s)
    return signals, alerts


async def require_lease_bucket(bus: Bus, ttl_s: float, timeout_s: float = REQUIRE_TIMEOUT_S) -> str:
    return await require_stream(bus, lease_bucket_spec(bus.subjects, ttl_s), timeout_s)


async def raise_alert(bus: Bus, alert: Alert) -> None:
    """Send an alert signal (firing or resolved) to the alert manager, durably.

    Detectors call this on every state change; the manager de-duplicates by fingerprint,
    persists, and publishes ``alerts.<severity>.<kind>``.
    """
    if not alert.ts:
        alert.ts = now()
    await bus.js_publish(bus.subjects.alert_signal(alert.source), alert)
