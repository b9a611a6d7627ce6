"""Time for the index to equal an engine's cache again after bridge-side faults.

    python -m bench.bench_bridge_converge [--runs 5] [--batches 50] [--cache-dir DIR]

Drives the real vLLM 0.33.0 ``ZmqEventPublisher`` (its wheel's kv_events.py, loaded as in
tests/tools/engine_conformance.py, downloaded once into --cache-dir) into the bridge that
`kvgate bridge vllm` runs and a real indexer over NATS (127.0.0.1:4222 or --nats-url), and
measures, per run, from the fault to the moment the indexer holds exactly the engine's blocks:

- ``restart_lost``: the engine restarts (seq from 0); the batches the new process publishes
  while the bridge's SUB socket reconnects are lost; then one batch arrives. Clock: from
  that batch's publish.
- ``restart_idle``: the engine restarts, the new process's batches are all lost and it goes
  idle; only its new ``process_start_time_seconds`` on ``/metrics`` (probed once per
  heartbeat, 1 s) tells. Clock: from the start-time change.
- ``idle_start``: the bridge starts next to an idle engine that has ``--batches`` batches (one
  block each) in its replay buffer. Clock: from the bridge's start.

Before these faults were handled, neither case converged at all (the old instance's blocks
stayed, the idle engine's blocks were never indexed); that is the figure to compare with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from tests.tools.engine_conformance import (
    ENGINES,
    BridgeHarness,
    LivePublisher,
    S,
    fetch_engine,
    keys,
    load_engine_module,
    stack,
    wait_for,
)
from tests.tools.engine_http import HttpEngine

# the bridge's defaults (`kvgate bridge`): heartbeat every 1 s, idle replay check every 2 s
DEFAULTS = {"heartbeat_s": 1.0, "tail_check_s": 2.0}


def held(svc, worker: str) -> set[int]:
    idx = svc.core.index
    return {k for k in idx.keys() if idx.holds(worker, k)}


async def restart_lost(module, bus, svc, run: int, batches: int) -> float:
    worker = f"bench-restart-{run}"
    pub = LivePublisher(module, "vllm-0.33.0", buffer_steps=10_000, bind_to=None)
    h = BridgeHarness(bus, worker, "vllm", pub.endpoint, pub.replay_endpoint, False, **DEFAULTS)
    await h.start()
    try:
        for b in range(batches):  # one block per batch, one chain
            await pub.publish([S([b], b - 1 if b else None, b)])
        await wait_for(lambda: len(held(svc, worker)) > 0, 10, "first instance indexed")
        await pub.restart()
        for i in range(5):  # published while the SUB socket reconnects: lost
            await pub.publish([S([1000 + i], 1000 + i - 1 if i else None, i)])
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await pub.publish([S([1005], 1004, 5)])
        truth = keys(0, 6)
        await wait_for(lambda: held(svc, worker) == truth, 30, "restart converged")
        return time.monotonic() - t0
    finally:
        await h.close()
        pub.close()


async def restart_idle(module, bus, svc, run: int, batches: int) -> float:
    """The engine restarts, every batch of the new process is lost and it goes idle: only
    its changed start time (``/metrics`` process_start_time_seconds) tells."""
    worker = f"bench-restart-idle-{run}"
    pub = LivePublisher(module, "vllm-0.33.0", buffer_steps=10_000, bind_to=None)
    async with HttpEngine(block_size=16) as http:
        h = BridgeHarness(
            bus,
            worker,
            "vllm",
            pub.endpoint,
            pub.replay_endpoint,
            False,
            engine_url=http.url,
            **DEFAULTS,
        )
        await h.start()
        try:
            for b in range(batches):
                await pub.publish([S([b], b - 1 if b else None, b)])
            await wait_for(lambda: held(svc, worker) == keys(0, batches), 10, "first instance")
            await h.pause()  # the new process's batches are lost to the bridge
            await pub.restart()
            for i in range(3):
                await pub.publish([S([1000 + i], 1000 + i - 1 if i else None, i)])
            await h.resume()
            t0 = time.monotonic()
            http.start_time = (http.start_time or 0) + 60  # the new process's start time
            await wait_for(lambda: held(svc, worker) == keys(0, 3), 30, "restart converged")
            return time.monotonic() - t0
        finally:
            await h.close()
            pub.close()


async def idle_start(module, bus, svc, run: int, batches: int) -> float:
    worker = f"bench-idle-{run}"
    pub = LivePublisher(module, "vllm-0.33.0", buffer_steps=10_000, bind_to=None)
    try:
        for b in range(batches):
            await pub.publish([S([b], b - 1 if b else None, b)])
        truth = keys(0, batches)
        t0 = time.monotonic()
        h = BridgeHarness(bus, worker, "vllm", pub.endpoint, pub.replay_endpoint, False, **DEFAULTS)
        await h.start()
        try:
            await wait_for(lambda: held(svc, worker) == truth, 30, "idle start converged")
            return time.monotonic() - t0
        finally:
            await h.close()
    finally:
        pub.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", type=int, default=50, help="engine batches before the fault")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/kvgate-conformance"))
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    args = ap.parse_args()
    name, version, member = next(e for e in ENGINES if e[1] == "0.33.0")
    module = load_engine_module(
        fetch_engine(Path(args.cache_dir), name, version, member), "vllm_0_33_0_bench"
    )
    batches = min(args.batches, 60)  # the token pool of the cases holds 64 blocks

    async def go() -> None:
        async with stack(args.nats_url) as (bus, svc):
            for label, fn in (
                ("restart_lost", restart_lost),
                ("restart_idle", restart_idle),
                ("idle_start", idle_start),
            ):
                times = [await fn(module, bus, svc, r, batches) for r in range(args.runs)]
                ms = [t * 1000 for t in times]
                print(
                    f"{label:13} runs={args.runs} batches={batches} "
                    f"median={statistics.median(ms):7.1f} ms  max={max(ms):7.1f} ms  "
                    f"(before: never converged)"
                )

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
