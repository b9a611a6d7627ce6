"""Streams are provisioned, never reconfigured, by services (issue 35).

A real nats-server runs the shipped per-role authorization. With ONE stolen service credential
an attacker tried to add a ``republish`` to KV_EVENTS (forged heartbeats, forged alerts, a stream
deleted through ``$JS.API.STREAM.DELETE``) or to add ``workers.control.*`` to its subjects. Here
every service role is refused every stream create / update / delete / purge, every consumer on a
name that is not its own and every write to the lease bucket it does not own; only the
provisioner (``kvgate bus provision``) configures streams; and a service that finds a stream
configured other than provisioned refuses it, counts it and raises a critical alert.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.js.api import RePublish

from services.common.bus import Bus, NatsAuth
from services.common.embedded import EmbeddedNats
from services.common.permissions import ROLES, default_grants, render_authorization
from services.common.schemas import Alert, decode
from services.common.streams import (
    STREAM_REFUSED,
    StreamUnavailable,
    all_specs,
    config_drift,
    kv_events_spec,
    provision,
    require_kv_events_stream,
    require_lease_bucket,
    require_outcomes_stream,
)
from services.common.subjects import Subjects
from tests.test_security_permissions import Conn

SERVICE_ROLES = [r for r in ROLES if r != "provisioner"]


@pytest.fixture
def prefix() -> str:
    return f"prov{uuid.uuid4().hex[:6]}"


@pytest.fixture
def passwords() -> dict[str, str]:
    return {role: uuid.uuid4().hex for role in ROLES}


@pytest.fixture
def server(tmp_path: Path, prefix: str, passwords: dict[str, str]) -> Iterator[EmbeddedNats]:
    conf = render_authorization(
        default_grants(("w1",)), Subjects(prefix), password=lambda g: passwords[g.role]
    )
    srv = EmbeddedNats(tmp_path / "nats", authorization=conf)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def buses(
    server: EmbeddedNats, passwords: dict[str, str], prefix: str
) -> AsyncIterator[dict[str, Bus]]:
    out = {
        role: Bus(
            server.url,
            role,
            Subjects(prefix),
            auth=NatsAuth(user=role, password=passwords[role]),
            role=role,
        )
        for role in ROLES
    }
    for b in out.values():
        await b.connect(max_wait_s=5)
    try:
        yield out
    finally:
        for b in out.values():
            await b.close()


async def test_only_the_provisioner_configures_streams(
    server: EmbeddedNats, passwords: dict[str, str], prefix: str, buses: dict[str, Bus]
) -> None:
    s = Subjects(prefix)
    created = dict(await provision(buses["provisioner"]))
    assert set(created) == {spec.name for spec in all_specs(s)}
    assert set(created.values()) == {"created"}
    assert set(dict(await provision(buses["provisioner"])).values()) == {"unchanged"}

    # the attack of issue 35: a republish of KV_EVENTS onto a heartbeat subject, and the
    # control subjects added to it; tried with every service role's credential
    attack = kv_events_spec(s)
    update = json.dumps(
        {
            "name": attack.name,
            "subjects": [s.kv_events_all, s.worker_control_all],
            "republish": {"src": ">", "dest": s.heartbeat("evil")},
        }
    ).encode()
    for role in SERVICE_ROLES:
        conn = await Conn().open(server.url, role, passwords[role], prefix)
        try:
            for spec in all_specs(s):
                for op in ("CREATE", "UPDATE", "DELETE", "PURGE"):
                    data = update if op == "UPDATE" else b"{}"
                    await conn.refused(f"$JS.API.STREAM.{op}.{spec.name}", data)
            # a stream of its own, outside kvgate's names, neither
            await conn.refused("$JS.API.STREAM.CREATE.EVIL", b"{}")
        finally:
            assert conn.nc is not None
            await conn.nc.close()

    info = await buses["provisioner"].js.stream_info(attack.name)
    assert info.config.republish is None
    assert info.config.subjects == [s.kv_events_all]


async def test_consumers_and_bucket_writes_stay_with_their_owners(
    server: EmbeddedNats, passwords: dict[str, str], prefix: str, buses: dict[str, Bus]
) -> None:
    s = Subjects(prefix)
    await provision(buses["provisioner"])
    bucket = s.indexer_lease_bucket
    tries = {
        # the api may consume OUTCOMES only as its canary evaluator's durable
        "api": [
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s.outcomes_stream}.evil",
            f"$JS.API.CONSUMER.CREATE.{s.kv_events_stream}.spy",
            f"$JS.API.CONSUMER.DELETE.{s.outcomes_stream}.{s.durable('api_canary_outcomes')}",
            f"$KV.{bucket}.leader",
        ],
        # a worker reads no stream: it could otherwise watch every worker's KV events
        "worker": [
            f"$JS.API.CONSUMER.CREATE.{s.kv_events_stream}.spy",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s.kv_events_stream}.spy",
            f"$KV.{bucket}.leader",
        ],
        "router": [
            f"$JS.API.CONSUMER.CREATE.{s.outcomes_stream}.spy",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s.alert_signals_stream}.spy",
            f"$KV.{bucket}.leader",
        ],
        "telemetry": [f"$JS.API.CONSUMER.CREATE.{s.alerts_stream}.spy", f"$KV.{bucket}.leader"],
        "operator": [f"$JS.API.CONSUMER.CREATE.{s.outcomes_stream}.spy", f"$KV.{bucket}.x"],
        "indexer": [f"$JS.API.CONSUMER.CREATE.{s.outcomes_stream}.spy"],
        "provisioner": [f"$KV.{bucket}.leader", s.heartbeat("w1"), s.policy_updated],
    }
    for role, subjects in tries.items():
        conn = await Conn().open(server.url, role, passwords[role], prefix)
        try:
            for subject in subjects:
                await conn.refused(subject, b"{}")
        finally:
            assert conn.nc is not None
            await conn.nc.close()


async def test_services_use_provisioned_streams_with_their_own_credentials(
    buses: dict[str, Bus], prefix: str
) -> None:
    """After provisioning, each role's job works: the api's durable consumer, the indexer's
    lease bucket and consumer, a worker's stored events."""
    s = Subjects(prefix)
    await provision(buses["provisioner"])
    worker, indexer = buses["worker"], buses["indexer"]
    await require_kv_events_stream(worker, timeout_s=5)
    await worker.client.publish(s.kv_events("w1"), b"batch")
    await require_lease_bucket(indexer, ttl_s=1.5, timeout_s=5)
    kv = await indexer.js.key_value(s.indexer_lease_bucket)
    await kv.create("leader", b"indexer-1")
    psub = await indexer.js.pull_subscribe(
        s.kv_events_all, durable=s.durable("kv_indexer_push"), stream=s.kv_events_stream
    )
    msgs = await psub.fetch(1, timeout=5)
    assert msgs[0].data == b"batch"
    await require_outcomes_stream(buses["api"], timeout_s=5)
    await buses["api"].js.pull_subscribe(
        s.router_outcomes, durable=s.durable("api_canary_outcomes"), stream=s.outcomes_stream
    )


async def test_a_service_waits_for_a_stream_nobody_provisioned(buses: dict[str, Bus]) -> None:
    worker = buses["worker"]
    name = worker.subjects.kv_events_stream
    before = STREAM_REFUSED.labels(name, "not_provisioned")._value.get()
    with pytest.raises(StreamUnavailable, match="not provisioned"):
        await require_kv_events_stream(worker, timeout_s=0.6)
    assert STREAM_REFUSED.labels(name, "not_provisioned")._value.get() > before
    # a credential creates nothing, even when the stream is missing
    with pytest.raises(Exception):  # noqa: B017 - refused by the server: no JetStream answer
        await worker.js.stream_info(name, timeout=0.5)


async def test_a_stream_changed_from_its_provisioned_config_is_refused_and_alerted(
    buses: dict[str, Bus], prefix: str
) -> None:
    """Someone holding an over-broad credential (or an old deploy's) added a republish to
    OUTCOMES: the router refuses the stream, counts it, and a critical alert is stored."""
    s = Subjects(prefix)
    prov = buses["provisioner"]
    await provision(prov)
    cfg = (await prov.js.stream_info(s.outcomes_stream)).config
    cfg.republish = RePublish(src=s.router_outcomes, dest=s.alert("critical", "gpu_fault"))
    await prov.js.update_stream(cfg)
    assert config_drift(all_specs(s)[1], cfg)  # the check sees what was done

    router = buses["router"]
    before = STREAM_REFUSED.labels(s.outcomes_stream, "drift")._value.get()
    with pytest.raises(StreamUnavailable, match="republish"):
        await require_outcomes_stream(router, timeout_s=0.6)
    assert STREAM_REFUSED.labels(s.outcomes_stream, "drift")._value.get() > before

    # the alert signal is stored for the alert manager (read with the api's own consumer)
    psub = await buses["api"].js.pull_subscribe(
        s.alert_signals_all, durable=s.durable("api_alert_manager"), stream=s.alert_signals_stream
    )
    msgs = await psub.fetch(1, timeout=5)
    alert = decode(Alert, msgs[0].data)
    assert alert.kind == "stream_config_drift" and alert.severity == "critical"
    assert alert.source == "router" and s.outcomes_stream in alert.summary

    # re-provisioning mends it, and the router takes the stream again
    assert dict(await provision(prov))[s.outcomes_stream] == "updated"
    assert await require_outcomes_stream(router, timeout_s=5) == s.outcomes_stream


def test_bus_cli_provisions_and_checks(
    server: EmbeddedNats, passwords: dict[str, str], prefix: str
) -> None:
    base = [sys.executable, "-m", "services.cli", "bus"]
    common = ["--nats-url", server.url, "--subject-prefix", prefix, "--nats-user"]

    def run(action: str, role: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, action, *common, role],
            env={**__import__("os").environ, "KVGATE_NATS_PASSWORD": passwords[role]},
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = run("check", "operator")
    assert missing.returncode == 1 and "MISSING" in missing.stdout
    refused = run("provision", "router")
    assert refused.returncode == 1, refused.stdout
    done = run("provision", "provisioner")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": created") == len(all_specs(Subjects(prefix)))
    assert passwords["provisioner"] not in done.stdout + done.stderr
    ok = run("check", "operator")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.count("as provisioned") == len(all_specs(Subjects(prefix)))


async def test_provisioning_waits_for_no_service(buses: dict[str, Bus]) -> None:
    """Services started before provisioning pick the streams up once they exist."""
    waiting = asyncio.create_task(require_kv_events_stream(buses["worker"], timeout_s=30))
    await provision(buses["provisioner"])
    assert await asyncio.wait_for(waiting, 30) == buses["worker"].subjects.kv_events_stream


async def test_the_provisioned_lease_bucket_outlives_a_nats_restart(
    server: EmbeddedNats, passwords: dict[str, str], prefix: str
) -> None:
    """The HA indexers' lease bucket survives a restart of the (single) NATS server: in memory it
    vanished with the server, and no service may create it again, so no indexer could ever
    take the lease (found by `python -m bench.fault_drill --scenarios nats-kill`)."""

    def bus(role: str) -> Bus:
        auth = NatsAuth(user=role, password=passwords[role])
        return Bus(server.url, role, Subjects(prefix), auth=auth, role=role)

    prov = bus("provisioner")
    await prov.connect(max_wait_s=5)
    try:
        await provision(prov)
    finally:
        await prov.close()
    server.stop()
    server.start()
    indexer = bus("indexer")
    await indexer.connect(max_wait_s=10)
    try:
        await require_lease_bucket(indexer, ttl_s=1.5, timeout_s=10)
        kv = await indexer.js.key_value(Subjects(prefix).indexer_lease_bucket)
        await kv.create("leader", b"indexer-1")
    finally:
        await indexer.close()


async def test_provisioning_reports_a_lease_bucket_it_brought_back_to_its_config(
    buses: dict[str, Bus], prefix: str
) -> None:
    """The lease bucket's drift was computed on the config already mended in place, so a
    re-provisioned bucket read "unchanged"."""
    prov = buses["provisioner"]
    await provision(prov)
    name = f"KV_{Subjects(prefix).indexer_lease_bucket}"
    cfg = (await prov.js.stream_info(name)).config
    cfg.max_age = 60.0
    await prov.js.update_stream(cfg)
    assert dict(await provision(prov))[name] == "updated"
    assert (await prov.js.stream_info(name)).config.max_age == pytest.approx(1.5)
    assert dict(await provision(prov))[name] == "unchanged"
