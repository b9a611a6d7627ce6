"""Helpers (no tests) for the simulated-worker tests: run SimWorkers in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.tokenizer import ByteTokenizer
from services.core.engine import EngineConfig
from services.worker_sim.worker import SimWorker, WorkerSettings


@contextlib.asynccontextmanager
async def sim_worker(
    bus: Bus | None = None,
    worker_id: str = "w0",
    speedup: float = 200.0,
    engine: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[SimWorker]:
    cfg = EngineConfig(
        **{
            "num_gpu_blocks": 512,
            "max_num_seqs": 16,
            "max_model_len": 4096,
            **(engine or {}),
        }
    )
    ws = WorkerSettings(worker_id=worker_id, port=free_port(), speedup=speedup, **settings)
    w = SimWorker(ws, cfg, ByteTokenizer(), bus)
    await w.start()
    try:
        yield w
    finally:
        await w.close()


async def post(url: str, body: Any) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        return await r.text()


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition that has no event to await (an HTTP-visible state), with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.02)


def metric_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] parsed with prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def one(values: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    got = values[name]
    assert len(got) == 1, got
    return got[0][1]
