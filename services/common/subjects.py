"""Every NATS subject and JetStream stream name kvgate uses, in one place.

A :class:`Subjects` instance carries an optional prefix (``KVGATE_SUBJECT_PREFIX``) that is put
in front of every subject and, sanitised, every stream and durable name, so two deployments
(or two test runs) on one NATS server never see each other's traffic.

Subject map (without prefix):

======================================  =========================================  ===========
subject                                 message (services.common.schemas)          transport
======================================  =========================================  ===========
kv.events.<worker>                      KvEventBatch                               JetStream KV_EVENTS
workers.heartbeat.<worker>              WorkerHeartbeat                            core
workers.kvdump.<worker>                 KvDumpRequest -> KvDumpChunk (req/reply,   core
                                        one request per chunk: services.common.kvdump)
workers.control.<worker>                WorkerControl (cordon / drain / uncordon)  core
telemetry.<worker>                      WorkerLoad                                 core
kv.index.delta                          IndexDelta (ordered)                       core
kv.index.snapshot                       SnapshotRequest -> snapshot (req/reply)    core
kv.query                                KvQuery -> KvQueryReply (req/reply)        core
kv.index.verify                         IndexVerifyRequest -> IndexVerifyReply     core
router.load.<router>                    RouterLoad (in-flight per worker)          core
router.outcomes                         RouterOutcome, or an array of them         JetStream OUTCOMES
policy.updated                          PolicyUpdated                              core + JetStream POLICY
policy.revision                         PolicyRevisionRequest -> Reply (req/reply) core (the api answers)
tenants.updated                         TenantsUpdated (the tenant directory)      core + JetStream TENANTS
alerting.signals.<source>               Alert (raw signal, not yet de-duplicated)  JetStream ALERT_SIGNALS
alerts.<severity>.<kind>                Alert (managed: firing / resolved)         JetStream ALERTS
======================================  =========================================  ===========
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def check_token(value: str, what: str = "subject token") -> str:
    """A worker id, router id or kind becomes one subject token: no dots, wildcards or spaces."""
    if not value or not _TOKEN_RE.match(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '_' and '-' only")
    return value


@dataclass(frozen=True)
class Subjects:
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.prefix and not self.prefix.endswith("."):
            object.__setattr__(self, "prefix", self.prefix + ".")

    def _s(self, subject: str) -> str:
        return self.prefix + subject

    def inbox_prefix(self, role: str) -> str:
        """Reply inbox of a role: only that role's credential may subscribe to it, so no other
        client reads its request replies (KV dumps, snapshots, JetStream acks)."""
        tag = re.sub(r"[^A-Za-z0-9_\-]", "_", self.prefix.rstrip("."))
        return (
            f"_INBOX_{tag}_{check_token(role, 'role')}"
            if tag
            else f"_INBOX_{check_token(role, 'role')}"
        )

    # -- streams: names may not contain '.', so the prefix is sanitised ------------------------
    def stream(self, base: str) -> str:
        tag = re.sub(r"[^A-Za-z0-9_\-]", "_", self.prefix.rstrip(".")).upper()
        return f"{tag}_{base}" if tag else base

    def durable(self, base: str) -> str:
        return self.stream(base).lower()

    @property
    def kv_events_stream(self) -> str:
        return self.stream("KV_EVENTS")

    @property
    def indexer_lease_bucket(self) -> str:
        """The JetStream key-value bucket of the HA indexers' lease (stream ``KV_<bucket>``,
        subjects ``$KV.<bucket>.>``)."""
        return self.stream("KV_INDEXER_LEASE")

    @property
    def outcomes_stream(self) -> str:
        return self.stream("OUTCOMES")

    @property
    def alerts_stream(self) -> str:
        return self.stream("ALERTS")

    @property
    def alert_signals_stream(self) -> str:
        return self.stream("ALERT_SIGNALS")

    @property
    def policy_stream(self) -> str:
        return self.stream("POLICY")

    @property
    def tenants_stream(self) -> str:
        return self.stream("TENANTS")

    # -- KV events and the index -----------------------------------------------------------
    def kv_events(self, worker_id: str) -> str:
        return self._s(f"kv.events.{check_token(worker_id, 'worker id')}")

    @property
    def kv_events_all(self) -> str:
        return self._s("kv.events.*")

    @property
    def kv_index_delta(self) -> str:
        return self._s("kv.index.delta")

    @property
    def kv_index_snapshot(self) -> str:
        return self._s("kv.index.snapshot")

    @property
    def kv_query(self) -> str:
        return self._s("kv.query")

    @property
    def kv_index_verify(self) -> str:
        return self._s("kv.index.verify")

    # -- workers ------------------------------------------------------------------------------
    def heartbeat(self, worker_id: str) -> str:
        return self._s(f"workers.heartbeat.{check_token(worker_id, 'worker id')}")

    @property
    def heartbeat_all(self) -> str:
        return self._s("workers.heartbeat.*")

    def kv_dump(self, worker_id: str) -> str:
        return self._s(f"workers.kvdump.{check_token(worker_id, 'worker id')}")

    def worker_control(self, worker_id: str) -> str:
        return self._s(f"workers.control.{check_token(worker_id, 'worker id')}")

    @property
    def worker_control_all(self) -> str:
        return self._s("workers.control.*")

    def telemetry(self, worker_id: str) -> str:
        return self._s(f"telemetry.{check_token(worker_id, 'worker id')}")

    @property
    def telemetry_all(self) -> str:
        return self._s("telemetry.*")

    # -- routers ------------------------------------------------------------------------------
    def router_load(self, router_id: str) -> str:
        return self._s(f"router.load.{check_token(router_id, 'router id')}")

    @property
    def router_load_all(self) -> str:
        return self._s("router.load.*")

    @property
    def router_outcomes(self) -> str:
        return self._s("router.outcomes")

    @property
    def policy_updated(self) -> str:
        return self._s("policy.updated")

    @property
    def policy_revision(self) -> str:
        return self._s("policy.revision")

    @property
    def tenants_updated(self) -> str:
        return self._s("tenants.updated")

    # -- alerts -------------------------------------------------------------------------------
    def alert_signal(self, source: str) -> str:
        return self._s(f"alerting.signals.{check_token(source, 'alert source')}")

    @property
    def alert_signals_all(self) -> str:
        return self._s("alerting.signals.*")

    def alert(self, severity: str, kind: str) -> str:
        return self._s(
            f"alerts.{check_token(severity, 'severity')}.{check_token(kind, 'alert kind')}"
        )

    @property
    def alerts_all(self) -> str:
        return self._s("alerts.>")
