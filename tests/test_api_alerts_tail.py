"""`kvgate alerts tail` as an operator runs it, against alerts that went through the real
alert manager (signal -> API -> Postgres -> ALERTS stream)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from services.api.testing import start_api
from services.common.bus import Bus
from services.common.schemas import Alert
from services.common.streams import raise_alert, require_alert_streams


async def _tail(nats_url: str, prefix: str, *args: str) -> str:
    env = {**os.environ, "KVGATE_NATS_URL": nats_url, "KVGATE_SUBJECT_PREFIX": prefix}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "alerts",
        "tail",
        "--color",
        "never",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_tail_replays_and_filters(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    api = await start_api(fresh_database_url, nats_url, subject_prefix)
    try:
        await require_alert_streams(bus)
        starved = Alert(
            fingerprint="kv_starved:w1",
            kind="kv_starved",
            severity="warning",
            source="telemetry",
            worker_id="w1",
            summary="8 active, 1 scheduled",
            remedy="raise max_tokens_in_paged_kv_cache",
        )
        breaker = Alert(
            fingerprint="circuit_open:w2",
            kind="circuit_open",
            severity="critical",
            source="router",
            worker_id="w2",
            summary="breaker open",
        )
        await raise_alert(bus, starved)
        await raise_alert(bus, breaker)
        starved.state = "resolved"
        await raise_alert(bus, starved)
        out = await _tail(nats_url, subject_prefix, "--replay", "all", "--count", "3")
        lines = [x for x in out.splitlines() if not x.startswith("    ")]
        assert len(lines) == 3
        assert "WARNING  FIRING   kv_starved worker=w1  8 active, 1 scheduled" in lines[0]
        assert "remedy: raise max_tokens_in_paged_kv_cache" in out
        assert "CRITICAL FIRING   circuit_open worker=w2" in lines[1]
        assert "RESOLVED" in lines[2] and "kv_starved" in lines[2]
        only = await _tail(
            nats_url,
            subject_prefix,
            "--replay",
            "all",
            "--count",
            "1",
            "--state",
            "resolved",
            "--json",
        )
        obj = json.loads(only)
        assert (obj["kind"], obj["state"], obj["worker_id"]) == ("kv_starved", "resolved", "w1")
        crit = await _tail(
            nats_url, subject_prefix, "--since", "10m", "--count", "1", "--severity", "critical"
        )
        assert "circuit_open" in crit and "kv_starved" not in crit
    finally:
        await api.close()
