"""``python -m bench.latency_bound``: what no routing policy can beat on a workload, on the
simulator's engines: lower bounds of TTFT mean and p99 and of e2e mean.

A router decides only *where* and *when* a request goes; it cannot make an engine compute
less than the request's prompt minus the longest prefix any earlier request could have left in
a cache, nor faster than the engine's step-time model (:meth:`services.core.engine.Engine.step`)
allows. For every request, in arrival order:

- ``uncached`` = its prompt minus the leading full blocks seen in *any* earlier prompt (one
  shared cache that never evicts, as :func:`bench.workloads.infinite_cache_hit_rate`; the last
  prompt token is always computed);
- its prefill alone on an idle engine: ``ceil(uncached / max_num_batched_tokens)`` steps'
  overhead + ``prefill_token_s`` x uncached + ``prefill_attn_s`` x the attention it computes
  (each computed position attends to every position up to it): a bound on its TTFT whatever
  else runs there (other work only lengthens its steps);
- its decode alone: ``max_tokens - 1`` more steps of ``step_overhead_s + decode_seq_s +
  decode_kv_token_s`` x its context: with the prefill, a bound on its e2e.

TTFT p99 is bounded by the p99 of the per-request bounds (every TTFT is at least its own
bound, so every order statistic is too). TTFT mean also by queueing: the fleet computes at most
``workers`` engines' worth of prefill work a second, and shortest-remaining-work-first on one
engine ``workers`` times as fast gives the least total wait any schedule of that work can
(the requests' prefill work without step overheads, released at their arrivals); the bound is
the larger of the two means.

For a workload whose last arrivals are a burst sharing one prefix (the shared system prompt),
:func:`burst_copies` adds the trade between hits and TTFT there: per number of workers that
compute the prefix during the burst, the highest hit rate and the lowest TTFT mean any policy
can have.

They hold for any policy when every request completes (a run that refuses some averages over
fewer). The engines must generate what the workloads never put in a later prompt (true of every
workload here: the simulator's generated text is hashed, the workloads' turns are their own),
so a cache holds nothing a later prompt can use beyond earlier prompts.

    python -m bench.latency_bound -w multi-turn -p sessions=200 -p turns=8 -n 8
    python -m bench.latency_bound -w generated-shared-prefix -p groups=64 --out bound.json
    python -m bench.latency_bound -w shared-system-prompt -n 8   # + the burst's hit/TTFT trade

``bench.slo_table`` prints these beside the policies when a run directory has ``bound.json``
(``BOUNDS=1 bench/routing_v2_sweep.sh`` writes one per run).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import add_workload_arguments, list_workloads, workload_from_args
from bench.metrics import percentile
from bench.simcore import make_engine_config, request_keys
from bench.workloads import BenchRequest, parse_params
from services.core.engine import EngineConfig


@dataclass(frozen=True, slots=True)
class LatencyBound:
    """Lower bounds (seconds) of a workload's figures under any routing policy."""

    ttft_mean: float  # max(own_ttft_mean, queue_ttft_mean)
    ttft_p99: float
    e2e_mean: float
    own_ttft_mean: float  # each request's prefill alone on an idle engine
    queue_ttft_mean: float  # shortest-remaining-work-first on the pooled fleet
    requests: int
    workers: int


def uncached_tokens(
    requests: Sequence[BenchRequest], keys: Sequence[Sequence[int]], block_size: int
) -> list[int]:
    """Per request, its prompt tokens not in a leading full block of any earlier prompt."""
    seen: set[int] = set()
    out: list[int] = []
    for r, ks in zip(requests, keys, strict=True):
        n_tok = r.prompt_tokens
        hit = 0
        for k in ks[: max(0, (n_tok - 1) // block_size)]:
            if k not in seen:
                break
            hit += 1
        seen.update(ks)
        out.append(n_tok - hit * block_size)
    return out


def prefill_work_s(cfg: EngineConfig, prompt: int, uncached: int) -> float:
    """Seconds of one engine's compute for ``uncached`` tokens at the end of a ``prompt``-token
    prompt, without step overheads (the engine's own sums: positions ``a..prompt-1`` attend to
    ``a + 1 .. prompt`` positions)."""
    a = prompt - uncached
    attn = (a + a + uncached + 1) * uncached // 2
    return cfg.prefill_token_s * uncached + cfg.prefill_attn_s * attn


def decode_alone_s(cfg: EngineConfig, prompt: int, max_tokens: int) -> float:
    """Seconds of the ``max_tokens - 1`` decode steps after the first token, each reading the
    request's own context only."""
    n = max(0, max_tokens - 1)
    # the step generating token k + 1 reads prompt + k tokens of KV (k = 1 .. n)
    kv = n * prompt + n * (n + 1) // 2
    return n * (cfg.step_overhead_s + cfg.decode_seq_s) + cfg.decode_kv_token_s * kv


def pooled_srpt_mean(jobs: Sequence[tuple[float, float]], speed: float) -> float:
    """Mean flow time of ``jobs`` (arrival, work) on one machine of ``speed``, shortest
    remaining work first (preemptive): the least mean any schedule of that work at that total
    rate can reach."""
    order = sorted(jobs)
    heap: list[tuple[float, int, float]] = []  # (remaining time, tie-break, arrival)
    t = flow = 0.0
    i, m = 0, len(order)
    while i < m or heap:
        if not heap and order[i][0] > t:
            t = order[i][0]
        while i < m and order[i][0] <= t:
            heapq.heappush(heap, (order[i][1] / speed, i, order[i][0]))
            i += 1
        rem, k, arrived = heapq.heappop(heap)
        nxt = order[i][0] if i < m else math.inf
        if t + rem <= nxt:
            t += rem
            flow += t - arrived
        else:
            heapq.heappush(heap, (rem - (nxt - t), k, arrived))
            t = nxt
    return flow / m if m else 0.0


def request_bounds(
    requests: Sequence[BenchRequest], keys: Sequence[Sequence[int]], cfg: EngineConfig
) -> list[tuple[float, float, float]]:
    """Per request: (its TTFT bound, its e2e bound, its prefill work in engine-seconds)."""
    budget = cfg.max_num_batched_tokens
    out: list[tuple[float, float, float]] = []
    for r, u in zip(requests, uncached_tokens(requests, keys, cfg.block_size), strict=True):
        work = prefill_work_s(cfg, r.prompt_tokens, u)
        ttft = -(-u // budget) * cfg.step_overhead_s + work
        out.append((ttft, ttft + decode_alone_s(cfg, r.prompt_tokens, r.max_tokens), work))
    return out


def latency_bound(
    requests: Sequence[BenchRequest],
    keys: Sequence[Sequence[int]],
    cfg: EngineConfig,
    workers: int,
) -> LatencyBound:
    """The bounds of ``requests`` (sorted by arrival) on ``workers`` engines of ``cfg``."""
    if not requests:
        raise ValueError("no requests")
    per = request_bounds(requests, keys, cfg)
    own = [b[0] for b in per]
    own_mean = sum(own) / len(own)
    queue_mean = pooled_srpt_mean(
        [(r.arrival_s, b[2]) for r, b in zip(requests, per, strict=True)], float(workers)
    )
    p99 = percentile(own, 99)
    assert p99 is not None
    return LatencyBound(
        ttft_mean=max(own_mean, queue_mean),
        ttft_p99=p99,
        e2e_mean=sum(b[1] for b in per) / len(per),
        own_ttft_mean=own_mean,
        queue_ttft_mean=queue_mean,
        requests=len(requests),
        workers=workers,
    )


@dataclass(frozen=True, slots=True)
class BurstCopies:
    """A burst that shares one prefix, with the prefix computed during the burst on ``copies``
    workers that did not hold it: the workload's hit rate is at most ``hit_rate_max`` and its
    TTFT mean (every request's) at least ``ttft_mean_min``, under any routing policy."""

    copies: int
    hit_rate_max: float
    ttft_mean_min: float


def burst_copies(
    requests: Sequence[BenchRequest],
    keys: Sequence[Sequence[int]],
    cfg: EngineConfig,
    workers: int,
) -> list[BurstCopies]:
    """The trade between cache hits and TTFT on a burst of requests that share a prefix (the
    requests arriving at the workload's last arrival instant, if there are two or more and
    they share at least one leading full block); [] for a workload without one.

    A worker serves a burst request only after the prefix is on it: it held the prefix when
    the burst came (at most one worker per earlier request that contains it) or it computes
    the prefix during the burst (a *copy*; an engine reuses only blocks computed in an
    earlier step, so every copy computes it at least once). Per worker, the j-th burst request
    to get its first token there waits at least one step's overhead plus the work the worker
    must have done by then (:func:`prefill_work_s`, no overheads): the prefix once on a copy,
    and j requests' own tokens after the prefix, at least the j smallest of the burst's. The
    fewest seconds in all are the burst-size smallest of those per-slot bounds over the
    holders and ``copies`` copies; earlier requests count their own prefill alone. Each copy
    costs the workload a prefix of hits against one shared cache that never evicts. Decoding
    and the step budget only add to these, so the bounds hold for every policy."""
    if not requests:
        return []
    t = max(r.arrival_s for r in requests)
    burst = [i for i, r in enumerate(requests) if r.arrival_s == t]
    if len(burst) < 2:
        return []
    bs = cfg.block_size
    depth = min(max(0, (requests[i].prompt_tokens - 1) // bs) for i in burst)
    first = keys[burst[0]]
    shared = 0
    while shared < depth and all(keys[i][shared] == first[shared] for i in burst):
        shared += 1
    if shared == 0:
        return []
    prefix = shared * bs
    head = first[0]
    earlier = [i for i, r in enumerate(requests) if r.arrival_s < t]
    holders = min(workers, sum(1 for i in earlier if keys[i][:1] == (head,)))
    own = request_bounds(requests, keys, cfg)
    before = sum(own[i][0] for i in earlier)
    # the j smallest own works after the prefix, summed, for every j
    cum = list(
        itertools.accumulate(
            sorted(
                prefill_work_s(cfg, requests[i].prompt_tokens, requests[i].prompt_tokens - prefix)
                for i in burst
            )
        )
    )
    a = cfg.step_overhead_s
    w_prefix = prefill_work_s(cfg, prefix, prefix)
    prompt_total = sum(r.prompt_tokens for r in requests)
    hits = prompt_total - sum(uncached_tokens(requests, keys, bs))
    out: list[BurstCopies] = []
    for copies in range(0 if holders else 1, workers - holders + 1):
        # the burst's smallest per-slot bounds: each worker's j-th slot is a + its start + cum[j]
        heap = [(a + cum[0], 0, 0.0)] * holders + [(a + w_prefix + cum[0], 0, w_prefix)] * copies
        heapq.heapify(heap)
        total = before
        for _ in burst:
            v, j, start = heapq.heappop(heap)
            total += v
            if j + 1 < len(cum):
                heapq.heappush(heap, (a + start + cum[j + 1], j + 1, start))
        # one shared cache computes the prefix once (before the burst when someone held it)
        lost = (copies - (0 if holders else 1)) * prefix
        out.append(BurstCopies(copies, (hits - lost) / prompt_total, total / len(requests)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.latency_bound",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(ap)
    ap.add_argument("--workers", "-n", type=int, default=8, help="engines (default 8)")
    ap.add_argument(
        "--engine",
        "-e",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EngineConfig setting, repeatable, as kvgate simulate takes it",
    )
    ap.add_argument("--out", type=Path, help="also write the bounds here (JSON)")
    a = ap.parse_args(argv)
    if a.list_workloads:
        print(list_workloads())
        return 0
    try:
        if a.concurrency:
            raise ValueError(
                "--concurrency: a closed loop's arrivals depend on the run; the bounds need "
                "the workload's open-loop arrivals"
            )
        if a.workers < 1:
            raise ValueError("--workers must be >= 1")
        workload = workload_from_args(a)
        cfg = make_engine_config({k: _number(v) for k, v in parse_params(a.engine).items()})
        if not workload.requests:
            raise ValueError("the workload has no requests")
    except (ValueError, OSError) as exc:
        print(f"latency_bound: {exc}", file=sys.stderr)
        return 2
    keys = request_keys(workload.requests, cfg.block_size, cfg.hash_seed)
    b = latency_bound(workload.requests, keys, cfg, a.workers)
    print(
        f"{workload.name}, {b.requests} requests, {b.workers} workers: TTFT mean >= "
        f"{b.ttft_mean:.4f} s (alone {b.own_ttft_mean:.4f}, queueing {b.queue_ttft_mean:.4f}), "
        f"TTFT p99 >= {b.ttft_p99:.4f} s, e2e mean >= {b.e2e_mean:.3f} s"
    )
    burst = burst_copies(workload.requests, keys, cfg, a.workers)
    if burst:
        print("a burst sharing one prefix, computed during it on C more workers (any policy):")
        print(f"{'C':>4s} {'hit rate <=':>12s} {'TTFT mean >=':>14s}")
        for row in burst:
            print(f"{row.copies:4d} {100 * row.hit_rate_max:11.2f}% {row.ttft_mean_min:13.4f}s")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        doc = asdict(b) | {"burst_copies": [asdict(r) for r in burst]}
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _number(v: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


if __name__ == "__main__":
    raise SystemExit(main())
