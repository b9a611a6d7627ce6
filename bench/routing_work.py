"""The router's routing work per request, in-process: what one request costs the router
besides HTTP and sockets, step by step, for each policy on the same requests.

The proxy bench's request (``bench.bench_router.BODY``) goes through the live router's own
objects, without a network (``bench.bench_router.offline_router``): parse + tokenize, the
request's context (``Ctx``, its canary arm), the decision (``Decider.decide_for``: block keys,
prefix match, policy), dispatch (the worker's ticket, the policy's bookkeeping), first token,
release and the outcome (metrics + the bus message, queued for the publisher). ``--inflight``
requests are kept in flight (released oldest first), so per-worker state is as under load.
Timed with ``time.perf_counter`` around each step; several runs per policy, interleaved, and
the median run reported. ``round_robin`` is the floor: the same path with a trivial decision.

    python -m bench.routing_work                          # kv_aware, slo_aware, round_robin + peers' rules
    python -m bench.routing_work --workers 8 --inflight 256 --policies kv_aware,slo_aware
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from bench.bench_router import BODY, offline_router

STEPS = ("parse", "context", "decide", "dispatch", "first_token", "release", "record")
DEFAULT_POLICIES = (
    "kv_aware,slo_aware,round_robin,sglang_cache_aware,dynamo_kv,llmd_default,llmd_kv_util"
)


def run_once(policy: str, workers: int, inflight: int, requests: int) -> dict[str, float]:
    """One run: µs per request of each step (and ``total``, the loop's own wall time)."""
    from services.core.index import PrefixIndex
    from services.router.proxy import Ctx

    rng = random.Random(1)
    wids = [f"w{i:02d}" for i in range(workers)]
    router = offline_router(PrefixIndex(), wids, 16, rng, policy)
    for w in wids:  # idle workers: the load is what this loop keeps in flight
        s = router.state.states[w]
        s.inflight = 0
        s.pending_prefill_tokens = 0
    parser, decider, dispatcher = router.parser, router.decider, router.dispatcher
    recorder, policies, queue = router.recorder, router.policies, router.outcomes.queue
    pc = time.perf_counter
    spent = dict.fromkeys(STEPS, 0.0)
    path = "/v1/completions"

    async def loop() -> float:
        live: list[tuple[Any, Any]] = []
        t_start = pc()
        for i in range(requests):
            a = pc()
            parsed = await parser.parse(dict(BODY), False, path)
            b = pc()
            rid = f"r{i}"
            ctx = Ctx(rid, parsed, policies.arm(rid, None), None, pc(), path)
            c = pc()
            d, ctx.overlaps = decider.decide_for(parsed, rid, None, ctx.arm.policy, ctx.excluded)
            e = pc()
            ticket = dispatcher.dispatch(ctx, d)
            f = pc()
            spent["parse"] += b - a
            spent["context"] += c - b
            spent["decide"] += e - c
            spent["dispatch"] += f - e
            live.append((ctx, ticket))
            if len(live) > inflight:
                old, t = live.pop(0)
                a = pc()
                dispatcher.first_token(old, t)
                b = pc()
                dispatcher.release(old, t)
                c = pc()
                recorder.record(old)
                e = pc()
                spent["first_token"] += b - a
                spent["release"] += c - b
                spent["record"] += e - c
                # the publisher's side (off the request path): emptied untimed
                while not queue.empty():
                    queue.get_nowait()
                    queue.task_done()
        return pc() - t_start

    ev = asyncio.new_event_loop()
    try:
        wall = ev.run_until_complete(loop())
    finally:
        ev.close()
    out = {k: v / requests * 1e6 for k, v in spent.items()}
    out["total"] = wall / requests * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.routing_work",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policies")
    ap.add_argument("--workers", type=int, default=1, help="workers (the proxy bench has 1)")
    ap.add_argument("--inflight", type=int, default=64, help="requests kept in flight")
    ap.add_argument("--requests", type=int, default=30_000, help="requests per run")
    ap.add_argument("--runs", type=int, default=3, help="runs per policy (interleaved)")
    a = ap.parse_args(argv)
    names = [p.strip() for p in a.policies.split(",") if p.strip()]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(a.runs):
        for n in names:
            runs[n].append(run_once(n, a.workers, a.inflight, a.requests))
            print(f"run {r + 1}/{a.runs} {n}: {runs[n][-1]['total']:.1f} us/request", flush=True)
    print(
        f"\nrouting work per request, µs (median of {a.runs} runs; {a.workers} worker(s), "
        f"{a.inflight} in flight, the proxy bench's request)"
    )
    print(f"{'policy':20s} {'total':>7s} " + " ".join(f"{s:>11s}" for s in STEPS))
    # each policy's median run (by total): its row, and its total against round_robin's
    med = {n: sorted(runs[n], key=lambda x: x["total"])[len(runs[n]) // 2] for n in names}
    for n in names:
        print(f"{n:20s} {med[n]['total']:7.1f} " + " ".join(f"{med[n][s]:11.1f}" for s in STEPS))
    if "round_robin" in med:
        floor = med["round_robin"]["total"]
        print(
            "over round_robin: "
            + ", ".join(f"{n} {med[n]['total'] - floor:+.1f}" for n in names if n != "round_robin")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
