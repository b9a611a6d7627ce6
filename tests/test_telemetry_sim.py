"""Seed 001 end to end: the real simulated worker configured with a KV cache of 2560 tokens,
max batch 64 and long requests; the telemetry agent discovers it by heartbeat, scrapes it and
raises ``kv_starved`` (and, seed 003, ``kv_capacity_config``) on real NATS."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import aiohttp
import pytest

from services.common import settings as S
from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.schemas import Alert, WorkerLoad
from services.telemetry.app import Agent, AgentConfig
from services.worker_sim import cli as sim_cli
from services.worker_sim.app import serve as sim_serve
from tests.test_telemetry_agent import collect, next_matching

PROMPT_TOKENS = 1000
MAX_NEW = 200


@pytest.mark.slow
async def test_sim_worker_like_seed_001_raises_kv_starved(bus: Bus, nats_url: str) -> None:
    port = free_port()
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--nats-url",
            nats_url,
            "--subject-prefix",
            bus.subjects.prefix.rstrip("."),
            "--port",
            str(port),
            "--worker-id",
            "seed001",
            "--block-size",
            "16",
            "--num-gpu-blocks",
            "160",  # 2560 tokens of KV
            "--max-num-seqs",
            "64",
            "--max-model-len",
            "4096",
            "--heartbeat-interval",
            "0.2",
        ]
    )
    st = S.resolve(args, sim_cli.OPTIONS)
    stop = asyncio.Event()
    alerts = await collect(bus, bus.subjects.alert_signal("telemetry"), Alert)
    loads = await collect(bus, bus.subjects.telemetry("seed001"), WorkerLoad)
    sim = asyncio.create_task(sim_serve(st, stop))
    agent = Agent(
        bus,
        AgentConfig(
            interval_s=0.1,
            detect_interval_s=0.2,
            use_nvml=False,
            typical_prompt_tokens=PROMPT_TOKENS,
            max_new_tokens=MAX_NEW,
            detectors={"kv_starved": {"window_s": 1.5}},
        ),
    )
    await agent.start()
    session = aiohttp.ClientSession()
    requests: list[asyncio.Task] = []
    try:
        # discovered from the sim worker's heartbeat, scraped, normalised
        first = await next_matching(loads, lambda m: not m.stale, timeout=15)
        assert first.source == "sim" and first.max_batch == 64
        assert first.kv_capacity_tokens == 2560 and first.tokens_per_block == 16
        assert first.gpus and first.gpus[0].mem_total_bytes
        # the simulated GPU is on the agent's /metrics too (new names and the seed's alias)
        from prometheus_client import REGISTRY, generate_latest

        text = generate_latest(REGISTRY).decode()
        assert 'kvgate_gpu_sm_utilization_ratio{gpu="0",worker="seed001"}' in text
        assert 'gpu_utilization_percent{gpu="0",worker="seed001"}' in text
        assert 'kvgate_gpu_memory_total_bytes{gpu="0",worker="seed001"}' in text

        async def one(i: int) -> None:
            body = {
                "model": "sim-llama-8b",
                "prompt": f"{i:04d} " + "long document " * (PROMPT_TOKENS // 14),
                "max_tokens": MAX_NEW,
            }
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                await r.read()

        requests = [asyncio.create_task(one(i)) for i in range(24)]
        busy = await next_matching(loads, lambda m: (m.waiting or 0) >= 8, timeout=15)
        assert (busy.running or 0) <= 3  # the cache holds ~2 such requests, not 64
        a = await next_matching(alerts, lambda m: m.kind == "kv_starved", timeout=20)
        assert a.state == "firing" and a.worker_id == "seed001"
        assert "gpu_memory_utilization" in a.remedy and "max_num_seqs" in a.remedy
        assert a.details["kv_capacity_tokens"] == 2560 and a.details["max_batch"] == 64
        assert a.details["active"] >= 8 and a.details["scheduled"] <= 3
        cfg = next(x for x in agent.alerts_sent if x.kind == "kv_capacity_config")
        need = 64 * (PROMPT_TOKENS + MAX_NEW)
        assert cfg.details["required_tokens"] == need
        assert cfg.details["minimum_tokens"] == -(-need // 16) * 16
    finally:
        for t in requests:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*requests, return_exceptions=True)
        await session.close()
        await agent.stop()
        stop.set()
        await asyncio.wait_for(sim, 10)
