"""What a router spends on its workers' bus traffic at fleet scale, with no requests: every
worker's ``WorkerLoad`` at the telemetry agent's cadence (10 a second) and its heartbeat (one
a second), published from another process to a real NATS, received through the router's own
``Bus`` and ``ClusterFeed`` into a ``ClusterState`` that knows every worker. Prints the
router's CPU (``time.process_time``, all its threads) as a share of one core, and per
message; beside it the part that is decoding and applying the messages (the same samples
through msgspec and ``ClusterState.on_load`` in a loop, no bus): the rest is nats-py's own
handling of each message.

    python -m bench.router_intake                      # 100 and 1,000 workers
    python -m bench.router_intake --workers 200 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from services.common.bus import Bus
from services.common.embedded import nats_or_embedded
from services.common.schemas import (
    GpuSample,
    WorkerCapacity,
    WorkerHeartbeat,
    WorkerLoad,
    decode,
    encode,
)
from services.common.subjects import Subjects
from services.core.cluster import ClusterState
from services.router.cluster_feed import ClusterFeed
from services.router.signals import CapacitySignal

CAP = WorkerCapacity(block_size=16, num_gpu_blocks=27_000, max_num_seqs=256, max_model_len=8192)
LOAD_HZ = 10  # the telemetry agent's default interval_s = 0.1


def _wid(i: int) -> str:
    return f"w{i:05d}"


def _load(i: int) -> WorkerLoad:
    return WorkerLoad(
        worker_id=_wid(i),
        ts=time.time(),
        source="vllm",
        running=3,
        waiting=1,
        kv_usage=0.5,
        kv_blocks_total=27_000,
        kv_blocks_free=13_000,
        tokens_per_block=16,
        gpus=[
            GpuSample(index=0, sm_util_pct=50.0, mem_used_bytes=1 << 30, mem_total_bytes=80 << 30)
        ],
    )


def _heartbeat(i: int) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=_wid(i), instance_id="i", url="http://w", model="m", capacity=CAP
    )


async def _publish(url: str, prefix: str, workers: int, seconds: float) -> None:
    """The fleet: every worker's load LOAD_HZ times a second, its heartbeat once a second."""
    import nats

    nc = await nats.connect(url)
    subjects = Subjects(prefix)
    loads = [(subjects.telemetry(_wid(i)), encode(_load(i))) for i in range(workers)]
    beats = [(subjects.heartbeat(_wid(i)), encode(_heartbeat(i))) for i in range(workers)]
    start = time.perf_counter()
    tick = 0
    while time.perf_counter() - start < seconds:
        for subject, data in loads:
            await nc.publish(subject, data)
        if tick % LOAD_HZ == 0:
            for subject, data in beats:
                await nc.publish(subject, data)
        tick += 1
        await asyncio.sleep(max(0.0, start + tick / LOAD_HZ - time.perf_counter()))
    await nc.flush()
    await nc.close()


async def measure(url: str, workers: int, seconds: float) -> dict[str, float]:
    prefix = f"intake{uuid.uuid4().hex[:8]}"
    subjects = Subjects(prefix)
    bus = Bus(url, "bench-intake", subjects)
    await bus.connect(max_wait_s=10)
    state = ClusterState()
    now = time.monotonic()
    for i in range(workers):
        state.on_heartbeat(_heartbeat(i), now)
    feed = ClusterFeed(state, CapacitySignal([]))
    got = 0

    async def counted(handler, msg, raw) -> None:  # type: ignore[no-untyped-def]
        nonlocal got
        got += 1
        await handler(msg, raw)

    await bus.subscribe(
        subjects.telemetry_all, WorkerLoad, lambda m, r: counted(feed.on_load, m, r)
    )
    await bus.subscribe(
        subjects.heartbeat_all, WorkerHeartbeat, lambda m, r: counted(feed.on_heartbeat, m, r)
    )
    warmup = 2.0
    pub = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.router_intake",
        "--publish",
        url,
        prefix,
        str(workers),
        str(seconds + warmup + 1.0),
    )
    await asyncio.sleep(warmup)
    c0, g0, w0 = time.process_time(), got, time.perf_counter()
    await asyncio.sleep(seconds)
    c1, g1, w1 = time.process_time(), got, time.perf_counter()
    await pub.wait()
    await bus.close()
    msgs = g1 - g0
    # the same samples decoded and applied in a loop: the part that is not the bus client's
    datas = [encode(_load(i)) for i in range(workers)]
    t = time.perf_counter()
    for _ in range(3):
        for d in datas:
            state.on_load(decode(WorkerLoad, d), now)
    apply_us = (time.perf_counter() - t) / (3 * workers) * 1e6
    return {
        "msgs_per_s": msgs / (w1 - w0),
        "core_pct": 100 * (c1 - c0) / (w1 - w0),
        "us_per_msg": 1e6 * (c1 - c0) / max(1, msgs),
        "apply_us": apply_us,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--publish"]:  # the fleet's side, in its own process
        url, prefix, workers, seconds = argv[1:5]
        asyncio.run(_publish(url, prefix, int(workers), float(seconds)))
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m bench.router_intake",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workers", default="100,1000", help="comma-separated worker counts")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per count")
    ap.add_argument("--nats-url", default="", help="default: 127.0.0.1:4222, else embedded")
    a = ap.parse_args(argv)
    with nats_or_embedded(a.nats_url) as url:
        print(
            f"{'workers':>8s} {'msgs/s':>8s} {'% of a core':>12s} {'µs/msg':>8s} {'decode+apply µs':>16s}"
        )
        for w in (int(x) for x in a.workers.split(",")):
            r = asyncio.run(measure(url, w, a.seconds))
            print(
                f"{w:8d} {r['msgs_per_s']:8.0f} {r['core_pct']:12.1f} {r['us_per_msg']:8.1f} "
                f"{r['apply_us']:16.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
