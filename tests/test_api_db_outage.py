"""Postgres goes away under a running API (real server: the database stops accepting
connections and existing ones are terminated): the API answers 503 with a clear error,
keeps alert signals for later, and recovers by itself when Postgres is back."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import asyncpg

from services.api.testing import start_api
from services.common.bus import Bus
from services.common.schemas import Alert
from services.common.streams import raise_alert, require_alert_streams


async def _set_reachable(admin_dsn: str, dbname: str, reachable: bool) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(
            f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS {str(reachable).lower()}'
        )
        if not reachable:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                dbname,
            )
    finally:
        await conn.close()


async def test_postgres_down_gives_503_and_recovers(
    fresh_database_url: str, pg_admin_dsn: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    dbname = urlparse(fresh_database_url).path.lstrip("/")
    api = await start_api(fresh_database_url, nats_url, subject_prefix)
    try:
        assert (await api.call("GET", "/api/v1/policies"))[0] == 200
        # the bootstrap path needs no database; a stored token does
        await _set_reachable(pg_admin_dsn, dbname, False)
        status, body = await api.call("GET", "/api/v1/policies")
        assert status == 503
        assert body["error"]["code"] == "database_unavailable"
        assert "PostgreSQL" in body["error"]["message"]
        status, health = await api.call("GET", "/api/v1/health", token=None)
        assert status == 200 and health["database"] == "unavailable"
        # alert signals raised during the outage are kept and handled later
        await require_alert_streams(bus)
        await raise_alert(
            bus,
            Alert(
                fingerprint="during-outage",
                kind="kv_starved",
                severity="warning",
                source="telemetry",
            ),
        )
        assert api.service is not None and api.service.alerts is not None
        api.service.alerts.handled.clear()
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
        )
        assert status == 503
        await _set_reachable(pg_admin_dsn, dbname, True)
        deadline = time.monotonic() + 15
        while (await api.call("GET", "/api/v1/policies"))[0] != 200:
            assert time.monotonic() < deadline, "API did not recover"
            await asyncio.sleep(0.1)  # polling recovery of an external server; no event
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
        )
        assert status == 201
        await asyncio.wait_for(api.service.alerts.handled.wait(), 15)
        _, alerts = await api.call("GET", "/api/v1/alerts?kind=kv_starved")
        assert [a["fingerprint"] for a in alerts["alerts"]] == ["during-outage"]
    finally:
        await _set_reachable(pg_admin_dsn, dbname, True)
        await api.close()
