"""How far a replica set of routers over-admits a tenant's quota: R routers in this process,
each on its own NATS connection (a local nats-server), sharing per-tenant usage over the
load-share channel (services/router/load_share.py) as deployed routers do.

A tenant with an input-token quota sends requests faster than the quota allows, each to a
router drawn at random; every router runs the live admission path
(``Admission.decide_or_wait``: the quota check on the sum of its own usage and the others'
last reports, counting at dispatch); admitted requests hold their worker for ``--service``
seconds, then end. Reported: the most input tokens admitted in any 60 s window (sliding, 1 s
steps) over the quota, per run, for a Poisson stream and for bursts (``--burst`` requests
sent at once, spread over the routers, every 10 s: after the first, a burst finds 1/4 of
the quota left and asks every router for more than that), beside the same load with each router
counting only its own usage (no sharing: R x the quota).

    python -m bench.bench_quota                      # 3 routers, 75 s per scenario
    python -m bench.bench_quota --routers 3 --rate 3 --seconds 75 --nats-url nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import random
import sys
import time
from typing import Any

from services.common.bus import Bus, Subjects
from services.common.schemas import WorkerCapacity, WorkerHeartbeat
from services.common.tenancy import Priority, RequestTenancy, TenantQuota
from services.core.policy import Decision

PROMPT = 1000  # tokens per request (byte tokenizer: characters)
WINDOW_S = 60.0


async def start_routers(url: str, subjects: Subjects, n: int, share: bool) -> list[Any]:
    from services.router.app import Router
    from services.router.cli import settings

    routers = []
    for _ in range(n):
        st = settings(
            nats_url=url,
            subject_prefix=subjects.prefix.rstrip("."),
            port=0,
            load_interval=0.5,
            queue_timeout=5.0,
        )
        bus = Bus(url, "bench-quota", subjects)
        await bus.connect(max_wait_s=10)
        r = Router(st, bus)
        await r.start()
        if not share:  # each router counts only its own usage
            r.load.quotas = type(r.flow.quotas)()
        routers.append(r)
    return routers


async def beat(bus: Bus, stop: asyncio.Event) -> None:
    cap = WorkerCapacity(
        block_size=16, num_gpu_blocks=1_000_000, max_num_seqs=100_000, max_model_len=8192
    )
    while not stop.is_set():
        for i in range(4):
            hb = WorkerHeartbeat(
                worker_id=f"qw{i}",
                instance_id="i",
                url=f"http://127.0.0.1:{9 + i}",
                model="m",
                capacity=cap,
                ts=time.time(),
            )
            await bus.publish(bus.subjects.heartbeat(f"qw{i}"), hb)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def scenario(
    a: argparse.Namespace, subjects: Subjects, share: bool, bursty: bool, seed: int
) -> dict[str, Any]:
    from services.router.proxy import Ctx

    hb_bus = Bus(a.nats_url, "bench-quota-hb", subjects)
    await hb_bus.connect(max_wait_s=10)
    stop = asyncio.Event()
    hb = asyncio.create_task(beat(hb_bus, stop))
    routers = await start_routers(a.nats_url, subjects, a.routers, share)
    quota = TenantQuota(input_tokens_per_min=a.quota)
    ten = RequestTenancy("t", Priority.STANDARD, 1.0)
    for r in routers:
        r.flow.quota_of = lambda t: quota
    rng = random.Random(seed)
    admitted: list[float] = []
    refused = 0
    tasks: set[asyncio.Task] = set()
    try:
        deadline = time.monotonic() + 15
        while not all(
            r.state.routable_count() >= 4 and len(r.state.remote_routers) == a.routers - 1
            for r in routers
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("routers did not hear the workers and each other")
            await asyncio.sleep(0.05)

        async def one(r: Any, i: int) -> None:
            nonlocal refused
            parsed = await r.parser.parse(
                {"model": "m", "prompt": "x" * PROMPT, "max_tokens": 8}, False, "/v1/completions"
            )
            rid = f"q{i}"
            ctx = Ctx(
                rid, parsed, r.policies.arm(rid, None), None, time.perf_counter(), "/v1/completions"
            )
            ctx.tenancy = ten
            d = await r.admission.decide_or_wait(ctx)
            if not isinstance(d, Decision):
                refused += 1
                return
            admitted.append(time.monotonic())
            ticket = r.dispatcher.dispatch(ctx, d)
            await asyncio.sleep(a.service)
            ctx.completion_tokens = 8
            r.dispatcher.release(ctx, ticket)
            r.admission.ended(ctx)

        rate = a.rate * a.quota / WINDOW_S / PROMPT  # requests/s
        t0 = time.monotonic()
        i = 0
        next_burst = t0
        while time.monotonic() - t0 < a.seconds:
            if bursty:
                now = time.monotonic()
                if now >= next_burst:
                    for _ in range(a.burst):
                        i += 1
                        t = asyncio.create_task(one(routers[i % a.routers], i))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                    next_burst += 10.0
                await asyncio.sleep(max(0.0, next_burst - time.monotonic()))
                continue
            i += 1
            t = asyncio.create_task(one(rng.choice(routers), i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        stop.set()
        await hb
        for r in routers:
            bus = r.bus
            await r.stop()
            await bus.close()
        await hb_bus.close()
    admitted.sort()
    worst = 0.0
    if admitted:
        s = admitted[0]
        while s <= admitted[-1]:
            n = bisect.bisect_left(admitted, s + WINDOW_S) - bisect.bisect_left(admitted, s)
            worst = max(worst, n * PROMPT / a.quota)
            s += 1.0
    return {"worst_60s_over_quota": worst, "admitted": len(admitted), "refused": refused}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_quota",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--nats-url", default=os.environ.get("KVGATE_NATS_URL", "nats://127.0.0.1:4222")
    )
    ap.add_argument("--routers", type=int, default=3)
    ap.add_argument("--quota", type=int, default=600_000, help="input tokens per minute")
    ap.add_argument("--rate", type=float, default=3.0, help="offered load, x the quota")
    ap.add_argument("--seconds", type=float, default=75.0, help="per scenario")
    ap.add_argument("--service", type=float, default=0.5, help="seconds a request holds its worker")
    ap.add_argument(
        "--burst",
        type=int,
        default=0,
        help="requests per burst, every 10 s (0: 3/4 of the quota's: a burst that lands "
        "when 1/4 of the quota is left asks each router for more than it)",
    )
    ap.add_argument("--scenarios", default="poisson,burst,poisson-no-sharing,burst-no-sharing")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    a.burst = a.burst or int(0.75 * a.quota / PROMPT)
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    print(
        f"{a.routers} routers, quota {a.quota:,} input tokens/min, {PROMPT}-token requests, "
        f"offered {a.rate:g}x the quota, {a.seconds:g} s per scenario",
        file=sys.stderr,
    )
    rows = []
    for name in [s for s in a.scenarios.split(",") if s]:
        subjects = Subjects(f"bq{os.getpid()}{name.replace('-', '')}")
        res = asyncio.run(
            scenario(
                a,
                subjects,
                share="no-sharing" not in name,
                bursty=name.startswith("burst"),
                seed=a.seed,
            )
        )
        rows.append((name, res))
        print(f"{name}: {res}", file=sys.stderr)
    print(f"\n{'scenario':22s} {'worst 60 s / quota':>19s} {'admitted':>9s} {'refused':>8s}")
    for name, res in rows:
        print(
            f"{name:22s} {res['worst_60s_over_quota']:19.3f} {res['admitted']:9d} {res['refused']:8d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
