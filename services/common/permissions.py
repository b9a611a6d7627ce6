"""Least privilege on the bus: what each kvgate role may publish and subscribe to, and the NATS
server authorization config generated from it.

Invariant: a role's permissions are derived only from :class:`~services.common.subjects.Subjects`
(so they follow the subject prefix and stream names), and every subject a role does not need is
denied by the server (allow lists only). In particular:

- a worker (simulated worker or engine bridge) publishes only its own ``kv.events.<id>`` and
  ``workers.heartbeat.<id>`` and answers only its own ``workers.kvdump.<id>``;
- only the api publishes ``policy.updated``, ``tenants.updated``, ``workers.control.*`` and managed ``alerts.>``;
- each role reads request replies only on its own inbox (:meth:`Subjects.inbox_prefix`), so no
  role snoops another's KV dumps, snapshots or JetStream acks;
- streams are provisioned, never reconfigured, by services: only the ``provisioner`` (the
  credential of ``kvgate bus provision``, held by no long-running service) may create or update
  kvgate's streams and its key-value bucket; a service role may only read a stream's info, publish
  to its subjects, and create / use consumers of its own names on the streams it reads; no role may
  delete or purge a stream, and only the indexer writes the lease bucket.

Roles: ``worker`` (also engine bridges), ``telemetry``, ``indexer``, ``router``, ``api``,
``operator`` (reads alerts, e.g. ``kvgate alerts tail``), ``provisioner``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.subjects import Subjects, check_token

ROLES: tuple[str, ...] = (
    "worker",
    "telemetry",
    "indexer",
    "router",
    "api",
    "operator",
    "provisioner",
)

# A responder may send this many messages to one request's reply subject (chunked KV dumps and
# index snapshots), within RESPONSE_WINDOW.
RESPONSE_MAX_MSGS = 100_000
RESPONSE_WINDOW = "5m"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may reply to requests it received (reply subjects only)

    def to_nats(self) -> dict[str, object]:
        out: dict[str, object] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            out["allow_responses"] = {"max": RESPONSE_MAX_MSGS, "expires": RESPONSE_WINDOW}
        return out


def _js_read(stream: str) -> list[str]:
    """Read a stream's info (its config, checked against the provisioned one)."""
    return [f"$JS.API.STREAM.INFO.{stream}"]


def _js_provision(stream: str) -> list[str]:
    """Create a stream or bring it to its provisioned config (``kvgate bus provision`` only)."""
    return [f"$JS.API.STREAM.{op}.{stream}" for op in ("INFO", "CREATE", "UPDATE")]


def _js_consume(stream: str, consumers: Sequence[str]) -> list[str]:
    """Durable consumers of the given names on one stream: create, info, fetch, ack, flow
    control. ``"*"`` names any consumer of the stream (the HA indexers name theirs after their
    ids; ordered consumers get random names and replace them, so ``"*"`` also grants delete)."""
    api = "$JS.API.CONSUMER"
    out: list[str] = []
    for name in consumers:
        out += [
            f"{api}.CREATE.{stream}.{name}",
            f"{api}.CREATE.{stream}.{name}.>",  # with a filter subject
            f"{api}.DURABLE.CREATE.{stream}.{name}",
            f"{api}.INFO.{stream}.{name}",
            f"{api}.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
            f"$JS.FC.{stream}.{name}.>",
        ]
    if "*" in consumers:
        out += [f"{api}.CREATE.{stream}", f"{api}.DELETE.{stream}.*"]
    return out


def _kv_bucket_use(bucket: str) -> list[str]:
    """Use one JetStream key-value bucket (put / update / delete keys, get a key); creating or
    configuring it is provisioning."""
    stream = f"KV_{bucket}"
    return [
        *_js_read(stream),
        f"$KV.{bucket}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def _js_read_last(stream: str) -> list[str]:
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}"]


def provisioned_streams(subjects: Subjects) -> list[str]:
    """Every JetStream stream kvgate provisions (the lease bucket as its stream)."""
    s = subjects
    return [
        s.kv_events_stream,
        s.outcomes_stream,
        s.policy_stream,
        s.tenants_stream,
        s.alert_signals_stream,
        s.alerts_stream,
        f"KV_{s.indexer_lease_bucket}",
    ]


def role_permissions(role: str, subjects: Subjects, worker_ids: Sequence[str] = ()) -> Permissions:
    """The permissions of one role. ``worker_ids``: for a worker credential, the worker ids it
    may speak for (empty: any worker id, for a fleet whose ids are not known in advance; prefer
    one credential per worker)."""
    s = subjects
    inbox = f"{s.inbox_prefix(role)}.>"
    js_info = "$JS.API.INFO"
    if role == "worker":
        ids = [check_token(w, "worker id") for w in worker_ids] or ["*"]
        return Permissions(
            publish=(
                *(s._s(f"kv.events.{w}") for w in ids),
                *(s._s(f"workers.heartbeat.{w}") for w in ids),
                js_info,
                *_js_read(s.kv_events_stream),
            ),
            subscribe=(*(s._s(f"workers.kvdump.{w}") for w in ids), inbox),
            allow_responses=True,
        )
    if role == "telemetry":
        return Permissions(
            publish=(
                s.telemetry_all,
                s.alert_signal("telemetry"),
                js_info,
                *_js_read(s.alert_signals_stream),
                *_js_read(s.alerts_stream),
            ),
            subscribe=(s.heartbeat_all, s.kv_events_all, s.router_outcomes, inbox),
        )
    if role == "indexer":
        return Permissions(
            publish=(
                s.kv_index_delta,
                s._s("workers.kvdump.*"),
                s.alert_signal("indexer"),
                js_info,
                *_js_read(s.kv_events_stream),
                *_js_consume(s.kv_events_stream, ["*"]),  # its only consumer: one per HA id
                *_kv_bucket_use(s.indexer_lease_bucket),  # the HA indexers' lease
            ),
            subscribe=(
                s.heartbeat_all,
                s.kv_index_snapshot,
                s.kv_query,
                s.kv_index_verify,
                inbox,
            ),
            allow_responses=True,
        )
    if role == "router":
        return Permissions(
            publish=(
                s.router_load_all,
                s.router_outcomes,
                s.kv_index_snapshot,
                s.kv_query,
                s.policy_revision,
                s.alert_signal("router"),
                js_info,
                *_js_read(s.outcomes_stream),
                *_js_read_last(s.policy_stream),
                *_js_read_last(s.tenants_stream),
            ),
            subscribe=(
                s.heartbeat_all,
                s.telemetry_all,
                s.worker_control_all,
                s.router_load_all,
                s.policy_updated,
                s.tenants_updated,
                s.kv_events_all,
                s.kv_index_delta,
                inbox,
            ),
        )
    if role == "api":
        return Permissions(
            publish=(
                s.policy_updated,
                s.tenants_updated,
                s.worker_control_all,
                s.alerts_all,
                s.alert_signal("api"),
                js_info,
                *_js_read_last(s.policy_stream),
                *_js_read_last(s.tenants_stream),
                *_js_read(s.outcomes_stream),
                *_js_consume(
                    s.outcomes_stream,
                    [s.durable("api_canary_outcomes"), s.durable("api_tenant_usage")],
                ),
                *_js_read(s.alert_signals_stream),
                *_js_consume(s.alert_signals_stream, [s.durable("api_alert_manager")]),
                *_js_read(s.alerts_stream),
            ),
            # router.outcomes: the operator page's live decision feed (services/api/ui);
            # router.load.*: the tenants' cache blocks held (services/api/tenant_cache)
            subscribe=(
                s.heartbeat_all,
                s.telemetry_all,
                s.router_outcomes,
                s.router_load_all,
                s.policy_revision,
                inbox,
            ),
            allow_responses=True,
        )
    if role == "operator":
        return Permissions(
            publish=(
                s.kv_index_verify,  # kvgate index verify
                js_info,
                *(api for st in provisioned_streams(s) for api in _js_read(st)),  # bus check
                *_js_consume(s.alerts_stream, ["*"]),  # kvgate alerts tail: ordered consumers
            ),
            subscribe=(s.alerts_all, inbox),
        )
    if role == "provisioner":
        return Permissions(
            publish=(
                js_info,
                *(api for st in provisioned_streams(s) for api in _js_provision(st)),
            ),
            subscribe=(inbox,),
        )
    raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")


@dataclass(frozen=True)
class Grant:
    """One NATS user: a name, its role, and (workers) the worker ids it may speak for."""

    user: str
    role: str
    worker_ids: tuple[str, ...] = field(default=())


def default_grants(worker_ids: Iterable[str] = ()) -> list[Grant]:
    """One user per role, named after it (the worker user speaks for ``worker_ids``)."""
    return [Grant(role, role, tuple(worker_ids) if role == "worker" else ()) for role in ROLES]


def password_env_var(grant: Grant) -> str:
    """The environment variable holding a user's password in the shipped config."""
    return "NATS_PASSWORD_" + grant.user.upper().replace("-", "_")


def _conf_value(value: object) -> str:
    # NATS config accepts JSON values; strings are quoted so '$' and '>' stay literal
    return json.dumps(value)


def render_authorization(
    grants: Sequence[Grant],
    subjects: Subjects,
    password: Callable[[Grant], str] | None = None,
) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server config.

    ``password(grant)`` gives a literal password; without it each password is the environment
    variable :func:`password_env_var` (resolved by nats-server at start, so no secret is in the
    file)."""
    lines = ["authorization {", "  users = ["]
    for g in grants:
        perms = role_permissions(g.role, subjects, g.worker_ids).to_nats()
        secret = _conf_value(password(g)) if password else "$" + password_env_var(g)
        lines.append(f"    # role {g.role}")
        lines.append(f"    {{user: {_conf_value(g.user)}, password: {secret},")
        lines.append(f"     permissions: {_conf_value(perms)}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
