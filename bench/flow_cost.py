"""What flow control costs a request when the fleet is not saturated, in-process.

The live router's admission (``Admission.decide_or_wait``: quota check, the line's verdict,
the decision, charging the tenant's counter and quota, then ``Admission.ended`` charging the
generated tokens) against the bare decision it wraps (``Decider.decide_for`` + its
histogram: the admission path before flow control), on the same router
(``bench.bench_router.offline_router``, no network, idle workers, ``round_robin`` so the
decision itself is cheap and steady). Both arms dispatch and release the same way, untimed.
Interleaved pairs: blocks of ``--block`` requests, A then B then A ..., each block's median
request time (robust to the process being preempted), and the median difference over the
pairs reported, for a tenant-less request, a
tenant without a quota and a tenant with one (every limit set: the whole check runs).

    python -m bench.flow_cost
    python -m bench.flow_cost --pairs 40 --block 2000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from bench.bench_router import BODY, offline_router
from services.common.tenancy import NO_TENANT, Priority, RequestTenancy, TenantQuota

QUOTA = TenantQuota(
    requests_per_min=10**9,
    input_tokens_per_min=10**12,
    output_tokens_per_min=10**12,
    concurrent_requests=10**6,
)
CASES = {
    "no tenant": NO_TENANT,
    "tenant, no quota": RequestTenancy("free", Priority.STANDARD, 1.0),
    "tenant with quota": RequestTenancy("metered", Priority.STANDARD, 2.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.flow_cost",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--pairs", type=int, default=30, help="interleaved (with, without) pairs")
    ap.add_argument("--block", type=int, default=1000, help="requests per arm per pair")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument(
        "--protect-prefill",
        action="store_true",
        help="with the router's --protect-prefill (the prefill room, at its default quantile)",
    )
    a = ap.parse_args(argv)

    from services.core.index import PrefixIndex
    from services.router import metrics as M
    from services.router.proxy import Ctx

    router = offline_router(
        PrefixIndex(), [f"w{i}" for i in range(a.workers)], 16, random.Random(1), "round_robin"
    )
    for s in router.state.states.values():  # idle: nothing waits, nothing is at capacity
        s.inflight = 0
        s.pending_prefill_tokens = 0
    router.flow.quota_of = lambda t: QUOTA if t == "metered" else TenantQuota()
    if a.protect_prefill:  # as FlowControl builds it with --protect-prefill
        from services.core.flow import Holdings, PrefillRoom
        from services.core.flow.prefill_room import DEFAULT_QUANTILE, DEFAULT_WINDOW_S

        router.flow.holdings = router.flow.holdings or Holdings()
        router.flow.room = PrefillRoom(DEFAULT_WINDOW_S, DEFAULT_QUANTILE)
        router.dispatcher.wake_on_first_token = True
    parser, decider, dispatcher = router.parser, router.decider, router.dispatcher
    admission, policies = router.admission, router.policies
    pc = time.perf_counter
    path = "/v1/completions"

    async def block(tenancy: RequestTenancy, with_flow: bool, n: int, tag: str) -> float:
        times = []
        for i in range(n):
            parsed = await parser.parse(dict(BODY), False, path)
            rid = f"{tag}{i}"
            ctx = Ctx(rid, parsed, policies.arm(rid, None), None, pc(), path)
            ctx.tenancy = tenancy
            ctx.completion_tokens = 16
            t0 = pc()
            if with_flow:
                d = await admission.decide_or_wait(ctx)
                admission.ended(ctx)
            else:
                td = pc()
                d, ctx.overlaps = decider.decide_for(
                    parsed, rid, None, ctx.arm.policy, ctx.excluded, ctx.slo
                )
                M.DECISION.observe(pc() - td)
            times.append(pc() - t0)
            ticket = dispatcher.dispatch(ctx, d)
            dispatcher.release(ctx, ticket)
        return statistics.median(times) * 1e6  # the median request: robust to preemption

    async def run() -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {c: [] for c in CASES}
        for ten in CASES.values():  # warm up
            await block(ten, True, a.block, "w")
            await block(ten, False, a.block, "w")
        for p in range(a.pairs):
            for name, ten in CASES.items():
                if p % 2:  # alternate which arm goes first
                    b_ = await block(ten, False, a.block, f"b{p}")
                    a_ = await block(ten, True, a.block, f"a{p}")
                else:
                    a_ = await block(ten, True, a.block, f"a{p}")
                    b_ = await block(ten, False, a.block, f"b{p}")
                out[name].append((a_, b_))
        return out

    ev = asyncio.new_event_loop()
    try:
        res = ev.run_until_complete(run())
    finally:
        ev.close()
    print(
        f"admission per request, µs ({a.pairs} interleaved pairs of {a.block} requests; "
        f"{a.workers} idle workers, round_robin"
        + (", --protect-prefill)" if a.protect_prefill else ")")
    )
    print(
        f"{'case':20s} {'with flow':>10s} {'decide only':>12s} {'flow control':>13s} {'p10-p90':>14s}"
    )
    for name, pairs in res.items():
        diffs = sorted(x - y for x, y in pairs)
        q = statistics.quantiles(diffs, n=10)
        print(
            f"{name:20s} {statistics.median(x for x, _ in pairs):10.2f} "
            f"{statistics.median(y for _, y in pairs):12.2f} {statistics.median(diffs):+13.2f} "
            f"{q[0]:+6.2f}..{q[-1]:+6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
