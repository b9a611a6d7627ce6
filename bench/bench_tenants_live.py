"""bench.bench_tenants' heavy-vs-light and priority scenarios, live: real processes (simulated
workers on the wall clock, the kv_indexer, the telemetry agent, the kvgate router) over a
NATS server, driven over HTTP by ``bench.loadgen`` with each request's tenant and band in
the trusted gateway's headers.

kvgate = the router with ``--trust-tenant-header`` (flow control sees the tenants and
bands); kvgate_room = kvgate with its prefill room (``--protect-prefill true
--protect-quantile Q``, Q from ``--protect-quantile``); FCFS = the same router without the
header (every request tenant-less, one first-come line);
solo = the light (or critical) requests alone. Fleet capacity is taken from the simulator
on the same engine model (the workers run it).

    python -m bench.bench_tenants_live                      # heavy + priority, seed 1
    python -m bench.bench_tenants_live --scenarios heavy --seeds 1,2 --span 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import bench_tenants as B
from bench.loadgen import run_load
from bench.metrics import OK, REJECTED, percentile
from bench.stack import BenchStack
from bench.workloads import BenchRequest

MODEL = "m"


def p99_ttft(results, ids: set[str]) -> float | None:
    return percentile(
        [r.ttft_s for r in results if r.request_id in ids and r.status == OK and r.ttft_s], 99
    )


MODES = ("fcfs", "kvgate", "kvgate_room")


def router_args(a: argparse.Namespace, mode: str) -> list[str]:
    args = ["--queue-timeout", str(a.queue_timeout), "--log-level", "warning"]
    if mode != "fcfs":
        args += ["--trust-tenant-header", "true"]
    if mode == "kvgate_room":
        args += ["--protect-prefill", "true", "--protect-quantile", str(a.protect_quantile)]
    return args


def run(stack: BenchStack, a: argparse.Namespace, label: str, reqs: list[BenchRequest], mode: str):
    stack.router_args = router_args(a, mode)
    try:
        prefix, _ = stack.start_workers(label)
        base = stack.start_kvgate(label, prefix, B.policy(a))
        results, _ = asyncio.run(run_load(base, reqs, MODEL, timeout_s=a.queue_timeout + 60))
    finally:
        stack.stop_run()
    return results


def heavy(stack: BenchStack, a: argparse.Namespace, seed: int, cap: float) -> dict[str, Any]:
    names = [f"light{i}" for i in range(3)]
    share = cap / 4
    rng = random.Random(seed)
    lights = [
        B.stream(rng, t, B.CHAT, a.light_load * share / B.CHAT.cost, a.span, "standard")
        for t in names
    ]
    hv = B.stream(rng, "heavy", B.BATCH, 10 * share / B.BATCH.cost, a.span, "standard")
    ids = {r.request_id for s in lights for r in s}
    solo = p99_ttft(run(stack, a, f"s{seed}-solo", B.merged(*lights), "kvgate"), ids)
    out: dict[str, Any] = {"solo_light_ttft_p99_s": solo}
    for mode in MODES:
        res = run(stack, a, f"s{seed}-{mode}", B.merged(*lights, hv), mode)
        p = p99_ttft(res, ids)
        out[mode] = {
            "light_ttft_p99_s": p,
            "vs_solo": p / solo if p and solo else None,
            "light_refused": sum(r.status == REJECTED for r in res if r.request_id in ids),
        }
    return out


def priority(stack: BenchStack, a: argparse.Namespace, seed: int, cap: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    per: dict[tuple[str, float], float | None] = {}
    for mult in (1.0, 2.0):
        rng = random.Random(seed)
        crit = B.stream(rng, "crit", B.CHAT, 0.2 * cap / B.CHAT.cost, a.span, "critical")
        std = B.stream(rng, "std", B.BATCH, 0.5 * cap / B.BATCH.cost, a.span, "standard")
        rng2 = random.Random(seed * 7919 + int(mult))
        shd = B.stream(
            rng2, "shed", B.BATCH, mult * a.sheddable_load * cap / B.BATCH.cost, a.span, "sheddable"
        )
        ids = {r.request_id for r in crit}
        for mode in MODES:
            res = run(stack, a, f"s{seed}-{mode}-x{mult:g}", B.merged(crit, std, shd), mode)
            per[(mode, mult)] = p99_ttft(res, ids)
            out.setdefault(mode, {})[f"critical_refused_x{mult:g}"] = sum(
                r.status == REJECTED for r in res if r.request_id in ids
            )
    for mode in MODES:
        p1, p2 = per[(mode, 1.0)], per[(mode, 2.0)]
        out[mode].update(
            critical_ttft_p99_1x_s=p1,
            critical_ttft_p99_2x_s=p2,
            ratio=p2 / p1 if p1 and p2 else None,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_tenants_live",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--scenarios", default="heavy,priority")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=8, help="the workers' max_num_seqs")
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--span", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--queue-timeout", type=float, default=10.0, help="the router's")
    ap.add_argument("--light-load", type=float, default=0.3)
    ap.add_argument("--sheddable-load", type=float, default=0.3)
    ap.add_argument(
        "--protect-quantile",
        type=float,
        default=0.95,
        help="the router's, in kvgate_room (with --protect-prefill true)",
    )
    ap.add_argument(
        "--nats-url", default="", help="an existing NATS server (default: start an embedded one)"
    )
    a = ap.parse_args(argv)
    cap = B.capacity(argparse.Namespace(**{**vars(a), "queue_timeout": a.queue_timeout}), B.BATCH)
    print(
        f"fleet: {a.workers} workers x {a.max_inflight}; capacity {cap:.0f} cost units/s",
        file=sys.stderr,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-tenants-live-"))
    stack = BenchStack(
        workdir,
        a.workers,
        sim_args=[
            "--model",
            MODEL,
            "--max-num-seqs",
            str(a.max_inflight),
            "--max-num-batched-tokens",
            str(a.batched_tokens),
        ],  # fmt: skip
        nats_url=a.nats_url or os.environ.get("KVGATE_BENCH_NATS_URL", ""),
    )
    stack.start()
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for name in [s for s in a.scenarios.split(",") if s]:
            fn = {"heavy": heavy, "priority": priority}[name]
            results[name] = [fn(stack, a, int(s), cap) for s in a.seeds.split(",") if s]
            for i, r in enumerate(results[name]):
                print(f"{name} seed {a.seeds.split(',')[i]}: {r}")
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
