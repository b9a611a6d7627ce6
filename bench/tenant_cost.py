"""What tenancy costs a router, in CPU time (``time.process_time``), in-process:

- identity per request: the public port's key check (``TenantDirectory.key_refusal``) and the
  request path's tenancy (``TenantDirectory.tenancy_of``) with a tenant key among
  ``--keys`` keys of ``--tenants`` tenants, beside the same calls on a router without tenants;
- the cache ledger per request (services/router/tenant_cache.py): hashing the prompt's block
  chain, claiming its blocks after the reply, and applying the engine's KV event batch that
  stores them, for prompts of several lengths;
- the cache-budget check (services/router/cache_budget.py), once per load-share tick: the
  blocks held summed over this router and ``--peers`` others, for 10 / 100 / 1,000 tenants
  with a budget, and the size of the RouterLoad message that carries the counts.

Several runs each; the median is printed.

    python -m bench.tenant_cost
    python -m bench.tenant_cost --keys 20000 --tenants 500 --runs 7
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

BLOCK = 16


def _cpu_us(fn: Callable[[], object], n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def identity(keys: int, tenants: int, runs: int, n: int) -> None:
    from services.common.schemas import TenantKeyRecord, TenantRecord, TenantsUpdated
    from services.router.http_server import Headers
    from services.router.tenant_identity import TenantDirectory, key_digest

    secrets = [f"kvt_{i:043d}" for i in range(keys)]
    d = TenantDirectory()
    d.apply(
        TenantsUpdated(
            revision=1,
            tenants=[TenantRecord(tenant_id=f"t{i}") for i in range(tenants)],
            keys=[
                TenantKeyRecord(key_id=i, tenant_id=f"t{i % tenants}", digest=key_digest(k).hex())
                for i, k in enumerate(secrets)
            ],
        )
    )
    empty = TenantDirectory()

    class Req:
        headers = Headers({"authorization": "Bearer " + secrets[keys // 2]})

    key = secrets[keys // 2]
    rows = {
        "key check (public port)": lambda: d.key_refusal(key),
        "tenancy (request path)": lambda: d.tenancy_of(Req),
        "tenancy, router without tenants": lambda: empty.tenancy_of(Req),
    }
    print(f"identity, {keys} keys of {tenants} tenants: us of CPU per request (median of {runs})")
    for name, fn in rows.items():
        print(f"  {name:34s} {statistics.median(_cpu_us(fn, n) for _ in range(runs)):6.2f}")


def ledger(runs: int, prompts: list[int]) -> None:
    from services.common.schemas import BlockStored, KvEventBatch
    from services.core.keys import block_keys
    from services.router.tenant_cache import TenantCacheLedger

    rng = random.Random(0)
    print(f"cache ledger: us of CPU per request, every block new (median of {runs})")
    print(f"  {'prompt tokens':>13s} {'blocks':>6s} {'hash':>7s} {'claim':>7s} {'stored':>7s}")
    for tokens in prompts:
        ids = [rng.randrange(50_000) for _ in range(tokens)]
        n = max(50, 40_000 // tokens)
        hashes, claims, applies = [], [], []
        for run in range(runs):
            t = time.process_time()
            chains = [block_keys(ids, BLOCK, run * n + i) for i in range(n)]
            hashes.append((time.process_time() - t) / n * 1e6)
            led = TenantCacheLedger()
            claims.append(_cpu_us(lambda c=iter(chains), led=led: led.claim("w", "a", next(c)), n))
            batches = iter(
                [
                    KvEventBatch(
                        worker_id="w",
                        instance_id="i",
                        seq=i,
                        ts=0.0,
                        events=[BlockStored(keys=c, block_size=BLOCK)],
                    )
                    for i, c in enumerate(chains)
                ]
            )
            applies.append(_cpu_us(lambda b=batches, led=led: led.apply(next(b)), n))
        med = statistics.median
        print(
            f"  {tokens:13d} {tokens // BLOCK:6d} {med(hashes):7.1f} {med(claims):7.1f}"
            f" {med(applies):7.1f}"
        )


def budgets(runs: int, peers: int) -> None:
    from services.common.schemas import RouterLoad, TenantRecord, TenantsUpdated, encode
    from services.router.cache_budget import CacheBudgetGuard
    from services.router.tenant_cache import TenantCacheLedger
    from services.router.tenant_identity import TenantDirectory

    print(f"cache budgets: us of CPU per check, {peers} other routers reporting (median of {runs})")
    print(f"  {'tenants':>7s} {'check':>8s} {'RouterLoad bytes':>17s}")
    for n in (10, 100, 1000):
        names = [f"team-{i:04d}" for i in range(n)]
        d = TenantDirectory()
        d.apply(
            TenantsUpdated(
                revision=1,
                tenants=[TenantRecord(tenant_id=t, cache_budget_blocks=50_000) for t in names],
            )
        )
        led = TenantCacheLedger()
        led.held.update({t: 40_000 + i * 20 for i, t in enumerate(names)})  # some over
        g = CacheBudgetGuard(led, d)
        for p in range(peers):
            g.on_peer(f"r{p}", {t: 3_000 for t in names}, 0.0)
        g.refresh(1.0)  # the gauges' first values
        us = statistics.median(_cpu_us(lambda g=g: g.refresh(1.0), 50) for _ in range(runs))
        size = len(encode(RouterLoad(router_id="r-0", ts=0.0, tenant_cache_blocks=g.report())))
        print(f"  {n:7d} {us:8.0f} {size:17d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=5000, help="tenant keys in the directory")
    ap.add_argument("--tenants", type=int, default=100, help="tenants in the directory")
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (median printed)")
    ap.add_argument("--calls", type=int, default=100_000, help="calls per identity run")
    ap.add_argument("--peers", type=int, default=3, help="other routers, for the budget check")
    ap.add_argument(
        "--prompts", default="512,2048,8192", help="prompt lengths (tokens) for the ledger"
    )
    a = ap.parse_args()
    identity(a.keys, a.tenants, a.runs, a.calls)
    ledger(a.runs, [int(x) for x in a.prompts.split(",")])
    budgets(a.runs, a.peers)


if __name__ == "__main__":
    main()
