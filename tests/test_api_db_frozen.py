"""Postgres frozen (SIGSTOP: connections stay open, nothing answers) under a running API:
every request is answered within about a second, with a 503 in the API's error shape (not
after the 15 s command timeout), and the API recovers by itself once Postgres thaws."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from services.api.testing import start_api
from services.common.embedded import EmbeddedPostgres, ensure_database
from services.common.stackfile import postmaster_pid

pytestmark = pytest.mark.slow


def _postgres_pids(pgdata: Path) -> list[int]:
    """The postmaster and every backend it forked."""
    top = postmaster_pid(pgdata)
    assert top is not None
    pids = [top]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == top:
            pids.append(int(entry))
    return pids


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def test_frozen_postgres_gives_fast_503s_and_recovers(
    tmp_path: Path, nats_url: str, subject_prefix: str
) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")
    await asyncio.to_thread(pg.start)
    url = pg.sqlalchemy_url("kvgate")
    await ensure_database(url)
    api = await start_api(url, nats_url, subject_prefix)
    frozen: list[int] = []
    try:
        # warm the pool (and the token cache) so frozen pooled connections are what we meet
        for _ in range(3):
            assert (await api.call("GET", "/api/v1/policies"))[0] == 200
        frozen = _postgres_pids(tmp_path / "pg")
        _signal_all(frozen, signal.SIGSTOP)
        slowest = 0.0
        for path, token in [
            ("/api/v1/health", None),
            ("/api/v1/policies", "admin"),
            ("/api/v1/alerts", "viewer"),
            ("/api/v1/policies", "admin"),
            ("/api/v1/health", None),
        ]:
            t0 = time.monotonic()
            status, body = await asyncio.wait_for(api.call("GET", path, token=token), 20)
            took = time.monotonic() - t0
            slowest = max(slowest, took)
            if path == "/api/v1/health":
                assert status == 200 and body["database"] == "unavailable", body
            else:
                assert status == 503, body
                assert body["error"]["code"] == "database_unavailable"
        assert slowest < 1.5, f"slowest answer took {slowest:.1f}s"
        t0 = time.monotonic()
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
        )
        assert status == 503 and time.monotonic() - t0 < 1.5
        _signal_all(frozen, signal.SIGCONT)
        frozen = []
        deadline = time.monotonic() + 20
        while (await api.call("GET", "/api/v1/policies"))[0] != 200:
            assert time.monotonic() < deadline, "API did not recover"
            await asyncio.sleep(0.1)  # polling recovery of an external server; no event
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
        )
        assert status == 201
    finally:
        _signal_all(frozen, signal.SIGCONT)
        await api.close()
        await asyncio.to_thread(pg.stop)
