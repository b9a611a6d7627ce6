"""Load check: can one ``kvgate sim-worker --count N`` process keep simulated time honest?

Starts the workers as a child process, drives every worker with ``--concurrency`` streaming
requests for ``--duration`` seconds, and prints the process's CPU use, the achieved output
token rate, and the measured inter-token latency next to what the step-time model says it
should be (a ratio near 1.0 means the process keeps up; well above 1 means it lags).

    python -m services.worker_sim.loadcheck --count 16 --concurrency 8 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import aiohttp

from services.common.embedded import free_port
from services.common.logging import configure_logging
from services.core.engine import EngineConfig

PREFIX = f"loadcheck{os.getpid()}"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(parts[11]) + int(parts[12])) / ticks


async def _client(url: str, stop_at: float, max_tokens: int, itls: list[float], seq: list[int]):
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < stop_at:
            seq[0] += 1
            body = {
                "prompt": f"shared system prompt {seq[0] % 4} " * 30 + f"user {seq[0]}",
                "max_tokens": max_tokens,
                "stream": True,
            }
            first = last = None
            n = 0
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    last = time.monotonic()
                    first = first or last
                    n += 1
            if n > 2 and first is not None and last is not None:
                # mean inter-token latency of the request (robust to client-side batching)
                itls.append((last - first) / (n - 2))  # n - 1 token chunks + 1 finish chunk
            seq[1] += n - 1


def _start_child(a: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    port = free_port()
    while any(_busy(port + i) for i in range(a.count)):
        port = free_port()
    env = {**os.environ, "KVGATE_NATS_URL": a.nats_url, "KVGATE_SUBJECT_PREFIX": PREFIX}
    cmd = [sys.executable, "-m", "services.cli", "sim-worker", "--count", str(a.count)]
    cmd += ["--port", str(port), "--speedup", str(a.speedup), "--log-level", "warning"]
    return subprocess.Popen(cmd, env=env), port


async def _run(a: argparse.Namespace, child: subprocess.Popen, port: int) -> dict:
    urls = [f"http://127.0.0.1:{port + i}" for i in range(a.count)]
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        for u in urls:
            while True:
                try:
                    async with s.get(u + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("workers did not start")
                await asyncio.sleep(0.1)
    cpu0, t0 = _cpu_seconds(child.pid), time.monotonic()
    itls: list[float] = []
    seq = [0, 0]
    stop_at = t0 + a.duration
    await asyncio.gather(
        *(_client(u, stop_at, a.max_tokens, itls, seq) for u in urls for _ in range(a.concurrency))
    )
    cpu1, t1 = _cpu_seconds(child.pid), time.monotonic()
    published, dropped = await _kv_counts(urls)
    c = EngineConfig()
    ctx = 30 * 24 + a.max_tokens // 2  # typical context during decode
    model_itl = (
        c.step_overhead_s + a.concurrency * (c.decode_seq_s + c.decode_kv_token_s * ctx)
    ) / a.speedup
    med = statistics.median(itls) if itls else float("nan")
    return {
        "workers": a.count,
        "concurrency_per_worker": a.concurrency,
        "speedup": a.speedup,
        "wall_s": round(t1 - t0, 2),
        "sim_process_cpu_percent": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "requests": len(itls),
        "tokens_streamed": seq[1],
        "tokens_per_s": round(seq[1] / (t1 - t0), 1),
        "itl_median_ms": round(1000 * med, 2),
        "itl_model_ms": round(1000 * model_itl, 2),
        "itl_ratio": round(med / model_itl, 2) if itls else None,
        "kv_batches_published": published,
        "kv_batches_dropped": dropped,
    }


async def _kv_counts(urls: list[str]) -> tuple[int, dict[str, int]]:
    """KV batches published on NATS and dropped (by reason), summed over the workers."""
    from prometheus_client.parser import text_string_to_metric_families

    published, dropped = 0, {}
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/metrics") as r:
                text = await r.text()
            for fam in text_string_to_metric_families(text):
                for sm in fam.samples:
                    if sm.name == "sim:kv_batches_published_total":
                        published += int(sm.value)
                    elif sm.name == "sim:kv_batches_dropped_total":
                        reason = sm.labels["reason"]
                        dropped[reason] = dropped.get(reason, 0) + int(sm.value)
    return published, dropped


async def _delete_stream(url: str) -> None:
    """Remove the KV events stream this run created (streams reserve JetStream storage)."""
    from services.common.bus import Bus
    from services.common.subjects import Subjects

    bus = Bus(url, "loadcheck", Subjects(PREFIX))
    try:
        await bus.connect(max_wait_s=3)
        await bus.js.delete_stream(bus.subjects.kv_events_stream)
    except Exception as exc:  # NATS gone or stream never made: nothing to clean
        print(f"(stream cleanup skipped: {exc!r})", file=sys.stderr)
    finally:
        await bus.close()


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="streams per worker")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the child is stopped too
    configure_logging("loadcheck", "warning", "console")  # stdout stays pure JSON
    child, port = _start_child(a)
    try:
        result = asyncio.run(_run(a, child, port))
    finally:
        ts = time.monotonic()
        child.terminate()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
    result["shutdown_s"] = round(time.monotonic() - ts, 2)
    asyncio.run(_delete_stream(a.nats_url))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
