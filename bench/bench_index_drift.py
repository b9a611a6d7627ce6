"""Verifier repairs under load, before and after the fix of issue 36's index drift.

    python -m bench.bench_index_drift                     # 2 scenarios x 2 modes, 60 s each
    python -m bench.bench_index_drift --seconds 120 --only heavy-eviction --mode after

Real parts: a NATS server (``--nats-url``), simulated workers on real time (speedup 1, as
``kvgate up`` runs them: engine, HTTP API, KV event sink, chunked dumps), the real indexer
with its background verifier at its production pace (``--verify-share``, default 0.01 of a
core), load as streamed OpenAI completions over HTTP. Scenarios:

- ``ordinary``: 27,000-block workers, chat-like traffic (five shared system prompts, short
  questions);
- ``heavy-eviction``: 3,000-block workers, unique 200-800-token prompts that churn the cache.

Modes: ``before`` runs workers whose kvdump answers as before the fix (it reads the cache
while the running step's events are not yet published, and names the previous seq);
``after`` runs the workers as they are. Prints, per run: requests, conclusive checks,
divergent checks, repairs, repaired pairs (missing / extra), index_repaired alerts fired.
Writes JSON under bench/results/index_drift/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.bench_convergence import _bus
from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.schemas import Alert, AllBlocksCleared, KvDumpRequest, KvEventBatch, decode
from services.common.streams import require_alert_streams, require_kv_events_stream
from services.common.subjects import Subjects
from services.common.tokenizer import ByteTokenizer
from services.core.engine import EngineConfig
from services.kv_indexer.app import IndexerService
from services.kv_indexer.verifier import CHECKS, REPAIRED_BLOCKS, repairs_total
from services.worker_sim.app import _heartbeats
from services.worker_sim.worker import SimWorker, WorkerSettings

RESULTS = Path(__file__).parent / "results" / "index_drift"
SCENARIOS = {"ordinary": (27_000, False), "heavy-eviction": (3_000, True)}


class SkewedDumpWorker(SimWorker):
    """The worker's kvdump before the fix: the cache as it is now (the running step's changes
    included) under the seq of the batch before that step."""

    async def _on_kvdump(self, req: KvDumpRequest) -> KvEventBatch:
        return KvEventBatch(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            seq=max(self.kv_seq, 0),
            ts=time.time(),
            events=[AllBlocksCleared(), *self.engine.dump_cache()],
        )


@contextlib.asynccontextmanager
async def _workers(
    bus: Bus, n: int, blocks: int, prefix: str, skewed: bool
) -> AsyncIterator[list[SimWorker]]:
    cls = SkewedDumpWorker if skewed else SimWorker
    ws: list[SimWorker] = []
    try:
        for i in range(n):
            cfg = EngineConfig(num_gpu_blocks=blocks, max_num_seqs=64, max_model_len=4096)
            w = cls(
                WorkerSettings(worker_id=f"{prefix}{i}", port=free_port()),
                cfg,
                ByteTokenizer(),
                bus,
            )
            await w.start()
            ws.append(w)
        beat = asyncio.create_task(_heartbeats(bus, ws, 1.0))
        try:
            yield ws
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
    finally:
        for w in ws:
            await w.close()


def load_prompt(rng: random.Random, unique: bool) -> str:
    """One prompt of the load: chat-like (one of five shared system prompts, a short
    question), or ``unique`` (200-800 tokens that churn the cache)."""
    if unique:
        return f"{rng.random():.17f} " + "u" * rng.randint(200, 800)
    return f"system prompt {rng.randint(0, 4)}. " * 24 + f"question {rng.randint(0, 99)}"


async def _client(w: SimWorker, stop: asyncio.Event, rng: random.Random, unique: bool) -> int:
    done = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            body = {
                "model": "m",
                "prompt": load_prompt(rng, unique),
                "max_tokens": rng.randint(4, 64),
                "stream": True,
            }
            async with session.post(w.url + "/v1/completions", json=body) as r:
                async for _ in r.content:
                    pass
            done += 1
    return done


def _checks() -> dict[str, float]:
    return {k: CHECKS.labels(k)._value.get() for k in ("equal", "divergent")}


def _repaired(prefix: str) -> dict[str, float]:
    out = {"missing": 0.0, "extra": 0.0}
    for m in REPAIRED_BLOCKS.collect():
        for s in m.samples:
            if s.name.endswith("_total") and s.labels["worker"].startswith(prefix):
                out[s.labels["kind"]] += s.value
    return out


async def run_one(
    url: str, scenario: str, mode: str, seconds: float, n: int, clients: int, share: float
) -> dict[str, Any]:
    blocks, unique = SCENARIOS[scenario]
    subjects = Subjects(f"drift{uuid.uuid4().hex[:8]}")
    prefix = f"{scenario[:4]}-{mode}-"
    async with _bus(url, subjects, "bench") as bus:
        await require_kv_events_stream(bus)
        await require_alert_streams(bus)
        fired: list[Alert] = []

        async def on_alert(msg: Any) -> None:
            alert = decode(Alert, msg.data)
            if alert.kind == "index_repaired" and alert.state == "firing":
                fired.append(alert)

        await bus.client.subscribe(subjects.alert_signal("indexer"), cb=on_alert)
        async with _bus(url, subjects, "indexer") as ibus:
            svc = IndexerService(ibus, verify_cpu_share=share)
            await svc.start()
            try:
                async with _workers(bus, n, blocks, prefix, skewed=mode == "before") as ws:
                    deadline = time.monotonic() + 10
                    while len(svc.core.workers) < n:  # registered by their first heartbeat
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"only {len(svc.core.workers)} of {n} registered")
                        await asyncio.sleep(0.05)
                    repairs0, checks0 = repairs_total(), _checks()
                    stop = asyncio.Event()
                    rng = random.Random(36)
                    tasks = [
                        asyncio.create_task(_client(w, stop, random.Random(rng.random()), unique))
                        for w in ws
                        for _ in range(clients)
                    ]
                    await asyncio.sleep(seconds)  # the measurement window
                    stop.set()
                    requests = sum(await asyncio.gather(*tasks))
                    checks1 = _checks()
                    await bus.client.flush()
                    repaired = _repaired(prefix)
                    return {
                        "scenario": scenario,
                        "mode": mode,
                        "seconds": seconds,
                        "workers": n,
                        "num_gpu_blocks": blocks,
                        "requests": requests,
                        "checks": sum(checks1.values()) - sum(checks0.values()),
                        "divergent": checks1["divergent"] - checks0["divergent"],
                        "repairs": repairs_total() - repairs0,
                        "repaired_missing": repaired["missing"],
                        "repaired_extra": repaired["extra"],
                        "alerts_fired": len(fired),
                    }
            finally:
                await svc.stop()


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'scenario':<16} {'mode':<7} {'s':>5} {'requests':>9} {'checks':>7} "
        f"{'divergent':>9} {'repairs':>8} {'missing':>8} {'extra':>8} {'alerts':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['scenario']:<16} {r['mode']:<7} {r['seconds']:>5.0f} {r['requests']:>9} "
            f"{r['checks']:>7.0f} {r['divergent']:>9.0f} {r['repairs']:>8.0f} "
            f"{r['repaired_missing']:>8.0f} {r['repaired_extra']:>8.0f} {r['alerts_fired']:>7}"
        )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for scenario in args.only or list(SCENARIOS):
        for mode in args.mode or ["before", "after"]:
            row = await run_one(
                args.nats_url,
                scenario,
                mode,
                args.seconds,
                args.workers,
                args.clients,
                args.verify_share,
            )
            print(_table([row]).splitlines()[-1], flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_index_drift",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nats-url", default=os.environ.get("KVGATE_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--seconds", type=float, default=60.0, help="load window per run")
    p.add_argument("--workers", type=int, default=3, help="simulated workers")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients per worker")
    p.add_argument("--verify-share", type=float, default=0.01, help="the verifier's core share")
    p.add_argument("--only", action="append", choices=list(SCENARIOS), help="repeatable")
    p.add_argument("--mode", action="append", choices=["before", "after"], help="repeatable")
    args = p.parse_args(argv)
    from services.common.logging import configure_logging

    configure_logging("bench", "error", "console")
    rows = asyncio.run(_run(args))
    print()
    print(_table(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"index-drift-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"host_cpus": os.cpu_count(), "hostname": socket.gethostname(), "runs": rows}, indent=1
        )
    )
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
