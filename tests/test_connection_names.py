"""``kvgate router`` and ``kvgate epp`` name their NATS connection by their replica id, the
same id their outcomes and load reports carry: ``router-<hex>`` / ``epp-<hex>`` when no
``--router-id`` is given, the given id otherwise (the server's ``/connz`` tells an operator
which replica holds which connection). Each runs its real ``serve`` against its own NATS
server with monitoring on."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from services.common.embedded import EmbeddedNats, free_port
from tests.test_router_support import wait_until


def _names(monitor: int) -> list[str]:
    """The named connections (a stray client of the shared machine, reconnecting to whatever
    now listens on its old server's port, may come unnamed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/connz", timeout=5) as r:
        return [c["name"] for c in json.load(r)["connections"] if c.get("name")]


async def _serve_and_name(kind: str, tmp_path: Path, router_id: str) -> str:
    """Serve ``kind`` until the server lists its connection; that connection's name."""
    monitor = free_port()
    nats = EmbeddedNats(tmp_path / "nats", monitor_port=monitor)
    nats.start()
    stop = asyncio.Event()
    task: asyncio.Task[Any] | None = None
    try:
        common: dict[str, Any] = {
            "nats_url": nats.url,
            "subject_prefix": f"names-{kind}",
            "port": free_port(),
            "router_id": router_id,
        }
        if kind == "router":
            from services.router.app import serve
            from services.router.cli import settings

            st = settings(**common)
        else:
            from services.epp.cli import settings as epp_settings
            from services.epp.server import serve

            st = epp_settings(**common)
        task = asyncio.create_task(serve(st, stop))
        names: list[str] = []

        def listed() -> bool:
            if task.done():  # serve ended before it connected: its error fails the test
                task.result()
                raise AssertionError(f"{kind} serve returned before connecting")
            names[:] = _names(monitor)
            return bool(names)

        await wait_until(listed, 20, f"{kind}'s connection in /connz")
        assert st.router_id in names, (st.router_id, names)  # the id its outcomes carry
        return str(st.router_id)
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 30)
        nats.stop()


@pytest.mark.parametrize("kind", ["router", "epp"])
async def test_connection_named_by_the_replica_id(kind: str, tmp_path: Path) -> None:
    name = await _serve_and_name(kind, tmp_path / "default", "")
    assert re.fullmatch(rf"{kind}-[0-9a-f]{{8}}", name), name
    assert await _serve_and_name(kind, tmp_path / "given", "edge-7") == "edge-7"
