"""Scale mode of bench_indexer: a namespace of many workers and blocks (default 1,000 x 10 M).

    python -m bench.bench_indexer --scale 1000x10M [--runs 3] [--queries 2000]

1. builds the indexer's index (the compiled core, LRU-capped as the service runs it, cap
   above the blocks): every worker holds its own blocks (one holder per key), 64 system
   prompts of 32 blocks are held by 100 workers each, and 16 test prompts of 4096 tokens are
   held whole by one worker and their first 64 blocks by 8 more;
2. replica bootstrap, in process (each run): the indexer's export + chunks of 1 MB +
   msgpack encode, then what the router replica does: decode + reassemble + load into a
   fresh index (``IndexReplica._snapshot_once`` without the network);
3. replica bootstrap over NATS (each run): the indexer service holding that index on a
   private nats-server, a new ``IndexReplica`` started until ``ready`` (what a router does);
4. the decision on the replica's index: the router's ``Decider.decide_for`` (4096-token
   prompt matched + the default policy's decision over every worker), and its parts.

Prints each figure per run beside its target (bootstrap <= 5 s, decision p50 <= 200 us) and
the peak RSS; writes JSON under bench/results/indexer/.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BS = 16
PROMPTS = 16
PROMPT_CHARS = 4096  # the router's byte tokenizer: 4096 tokens


def parse_scale(spec: str) -> tuple[int, int]:
    w, _, b = spec.lower().partition("x")
    mult = {"k": 1_000, "m": 1_000_000}
    n = float(b[:-1]) * mult[b[-1]] if b and b[-1] in mult else float(b)
    return int(w), int(n)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(workers: int, blocks: int) -> tuple[Any, list[str], list[str]]:
    from services.core.index import PrefixIndex
    from services.core.keys import block_keys

    rng = np.random.default_rng(11)
    prng = random.Random(11)
    wids = [f"w{i:04d}" for i in range(workers)]
    index = PrefixIndex(max_blocks=2 * blocks)  # the indexer's: LRU order kept for its cap
    prompts = [
        "".join(prng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PROMPT_CHARS))
        for _ in range(PROMPTS)
    ]
    for p in prompts:
        keys = block_keys(list(p.encode()), BS)
        for w in prng.sample(wids, 8):
            index.apply_stored(w, keys[:64])
        index.apply_stored(prng.choice(wids), keys)
    for _ in range(64):  # shared system prompts: keys with many holders
        keys = rng.integers(1, 2**63, size=32, dtype=np.uint64).tolist()
        for w in prng.sample(wids, min(100, workers)):
            index.apply_stored(w, keys)
    per = max(0, (blocks - index.num_keys) // workers)
    for w in wids:
        own = rng.integers(1, 2**63, size=per, dtype=np.uint64)
        for i in range(0, per, 256):
            index.apply_stored(w, own[i : i + 256].tolist())
    return index, wids, prompts


def bootstrap_in_process(index: Any) -> dict[str, float]:
    from services.common.schemas import SnapshotChunk, decode, encode
    from services.core.index import PrefixIndex
    from services.core.snapshot import chunks_to_state, state_to_chunks

    gc.collect()
    t0 = time.perf_counter()
    raws = [encode(c) for c in state_to_chunks(index.export_state(), "e", "s", 0, 1 << 20)]
    t1 = time.perf_counter()
    replica = PrefixIndex()
    chunks = [decode(SnapshotChunk, r) for r in raws]
    state = chunks_to_state(chunks)
    # as IndexReplica.load does it: steps of rows, the event loop free between them
    steps = []
    t = time.perf_counter()
    for _ in replica.load_steps(state):
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
    steps.append(time.perf_counter() - t)
    t2 = time.perf_counter()
    ok = len(replica) == len(index) and replica.num_keys == index.num_keys
    return {
        "indexer_s": t1 - t0,
        "replica_s": t2 - t1,
        "load_s": sum(steps),
        "load_steps": len(steps),
        "longest_step_s": max(steps),
        "total_s": t2 - t0,
        "chunks": len(raws),
        "mbytes": sum(map(len, raws)) / 1e6,
        "equal": ok,
    }


async def bootstrap_nats(index: Any, runs: int) -> list[dict[str, Any]]:
    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats
    from services.common.index_replica import IndexReplica
    from services.common.streams import require_kv_events_stream
    from services.common.subjects import Subjects
    from services.kv_indexer.app import IndexerService

    tmp = tempfile.mkdtemp(prefix="bench-scale-")
    server = EmbeddedNats(Path(tmp))
    server.start()
    subjects = Subjects("benchscale")
    ib = Bus(server.url, "bench-indexer", subjects)
    await ib.connect(max_wait_s=10)
    svc = IndexerService(ib, max_blocks=None)
    svc.core.index = index
    out = []
    try:
        await require_kv_events_stream(ib)
        await svc.start()
        for _ in range(runs):
            rb = Bus(server.url, "bench-replica", subjects)
            await rb.connect(max_wait_s=10)
            rep = IndexReplica(rb, start_timeout_s=60, chunk_timeout_s=10)
            gc.collect()
            t0 = time.perf_counter()
            await rep.start()
            await asyncio.wait_for(rep.ready.wait(), 60)
            secs = time.perf_counter() - t0
            out.append({"seconds": secs, "equal": len(rep.index) == len(index)})
            await rep.stop()
            await rb.close()
            del rep
            gc.collect()
    finally:
        await svc.stop()
        await ib.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def decision(index: Any, wids: list[str], prompts: list[str], iters: int) -> dict[str, Any]:
    from bench.bench_router import offline_router
    from services.core.policy import RequestInfo, decide

    router = offline_router(index, wids, BS, random.Random(5))
    policy = router.policies.control
    bodies = [{"model": "m", "prompt": p, "max_tokens": 128} for p in prompts]

    async def run() -> dict[str, list[float]]:
        t: dict[str, list[float]] = {"parse": [], "decide_for": [], "match": [], "policy": []}
        for i in range(iters + 200):
            body = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            parsed = await router.parser.parse(body, chat=False)
            t1 = time.perf_counter()
            d, ov = router.decider.decide_for(parsed, f"r{i}", None, policy, set())
            t2 = time.perf_counter()
            overlaps = router.decider.overlaps(parsed, router.state.states)
            t3 = time.perf_counter()
            decide(
                policy,
                RequestInfo(f"q{i}", "m", len(parsed.token_ids), 128),
                router.state.snapshot,
                overlaps,
            )
            t4 = time.perf_counter()
            if i >= 200:
                t["parse"].append(t1 - t0)
                t["decide_for"].append(t2 - t1)
                t["match"].append(t3 - t2)
                t["policy"].append(t4 - t3)
        assert d.worker_id is not None and max(ov.values()) == PROMPT_CHARS // BS
        return t

    gc.collect()
    gc.disable()
    try:
        t = asyncio.run(run())
    finally:
        gc.enable()
    us = 1e6
    return {
        "policy": policy.name,
        **{f"{k}_p50_us": statistics.median(v) * us for k, v in t.items()},
        "decide_for_p99_us": sorted(t["decide_for"])[int(0.99 * len(t["decide_for"]))] * us,
    }


def main_scale(spec: str, runs: int, iters: int, out_dir: str) -> int:
    workers, blocks = parse_scale(spec)
    print(f"scale: {workers:,} workers, {blocks:,} blocks; {runs} runs", flush=True)
    t0 = time.perf_counter()
    index, wids, prompts = build(workers, blocks)
    print(
        f"built the indexer's index in {time.perf_counter() - t0:.1f} s: {len(index):,} pairs, "
        f"{index.num_keys:,} keys, {index.nbytes / len(index):.1f} B/pair in the table "
        f"(peak RSS {peak_rss_mb():,.0f} MB)",
        flush=True,
    )
    res: dict[str, Any] = {"workers": workers, "blocks": blocks, "pairs": len(index), "runs": []}
    for r in range(runs):
        b = bootstrap_in_process(index)
        print(
            f"run {r + 1}: bootstrap in process {b['total_s']:.2f} s (indexer export + chunks + "
            f"encode {b['indexer_s']:.2f} s, replica decode + load {b['replica_s']:.2f} s; "
            f"{b['chunks']} chunks, {b['mbytes']:.0f} MB) equal={b['equal']}  target <= 5 s; "
            f"the replica's load {b['load_s']:.2f} s in {b['load_steps']} steps, longest "
            f"{b['longest_step_s'] * 1000:.0f} ms (the router's event loop runs between them)",
            flush=True,
        )
        res["runs"].append({"in_process": b})
    nats = asyncio.run(bootstrap_nats(index, runs))
    for r, n in enumerate(nats):
        print(
            f"run {r + 1}: new IndexReplica over NATS ready in {n['seconds']:.2f} s "
            f"equal={n['equal']}  target <= 5 s",
            flush=True,
        )
        res["runs"][r]["nats"] = n
    for r in range(runs):
        d = decision(index, wids, prompts, iters)
        print(
            f"run {r + 1}: decision (decide_for: match + {d['policy']} over {workers:,} workers) "
            f"p50 {d['decide_for_p50_us']:.0f} us, p99 {d['decide_for_p99_us']:.0f} us "
            f"[match {d['match_p50_us']:.0f}, policy {d['policy_p50_us']:.0f}; parse + tokenize "
            f"{d['parse_p50_us']:.0f} us outside]  target p50 <= 200 us",
            flush=True,
        )
        res["runs"][r]["decision"] = d
    res["peak_rss_mb"] = peak_rss_mb()
    print(f"peak RSS {res['peak_rss_mb']:,.0f} MB; total {time.perf_counter() - t0:.0f} s")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_index_scale_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(
        main_scale(
            sys.argv[1] if len(sys.argv) > 1 else "1000x10M", 3, 2000, "bench/results/indexer"
        )
    )
