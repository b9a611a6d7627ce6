"""KV indexer micro-benchmarks, ours side by side with Dynamo's Rust radix tree.

    python -m bench.bench_indexer            # full: 1 M stored blocks (about 2 minutes)
    python -m bench.bench_indexer --quick    # 250 k blocks, fewer queries (about 40 s)

Measures, on one core (the process pins itself to one CPU unless --no-pin):

1. ingest: canonical KvEventBatch msgpack bytes (one BlockStored of 16 blocks each) through
   the indexer core (decode, seq check, apply, delta journal) vs Dynamo ``RadixTree.
   apply_event`` of pre-serialised JSON events of 16 blocks (a ``find_matches`` call at the
   end waits for its background thread);
2. full vLLM path: vLLM-format batch bytes (map events, uint64 engine hashes, token ids) ->
   decode -> re-key from token ids -> index apply, vs Dynamo hashing the same tokens with
   ``compute_block_hash_for_seq`` + building + applying its event;
3. query: a 4096-token prompt's keys + per-worker overlap over 8 workers and N stored blocks
   (ours: ``PrefixIndex.match_prompt``; Dynamo: ``compute_block_hash_for_seq`` +
   ``find_matches``), p50 / p99, for prompts fully cached on one worker and for prompts that
   share only a 512-token system prefix (on the index class in use: the compiled core of
   services/core/cindex.py when built, else the pure-Python reference);
4. memory per stored (worker, block) pair (RSS delta of a fresh process, both sides; ours
   for the indexer's index and for a router replica's, which adds the mirror), and the
   memory cap (pairs stay <= cap);
5. a new router replica (IndexReplica over a real NATS) holding all N blocks: seconds.

Prints a table with our figure, the peer's, the ratio and the target; writes JSON under
bench/results/indexer/. If ``ai-dynamo-runtime`` is not installed it says so and prints ours (it need not be in the
project's venv: ``pip install --target DIR ai-dynamo-runtime==1.6.1`` and put DIR on
PYTHONPATH). Memory is measured at 8, 100, 200 and 1,000 workers (``--mem-workers``).

    python -m bench.bench_indexer --scale 1000x10M     # 1,000 workers, 10 M blocks, 3 runs

runs only the scale mode (bench/bench_index_scale.py): replica bootstrap and decision p50.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 16
PROMPT_BLOCKS = 256  # 4096 tokens
PREFIX_BLOCKS = 32  # 512-token system prompts
N_PREFIXES = 64
WORKERS = 8
INDEXER_DEFAULT_CAP = 2_000_000  # services.kv_indexer.app default max_blocks

try:  # the peer
    from dynamo.llm import RadixTree, compute_block_hash_for_seq  # type: ignore

    PEER = True
except Exception:  # pragma: no cover - depends on the optional install
    RadixTree = compute_block_hash_for_seq = None  # type: ignore
    PEER = False


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Sequences of 256 blocks: one of 64 shared 32-block system prefixes + 224 own blocks,
    each stored on one of 8 workers. ``tokens[i]`` is sequence i's token ids."""

    prefixes: np.ndarray  # (N_PREFIXES, PREFIX_BLOCKS*BLOCK)
    suffixes: np.ndarray  # (n_seq, (PROMPT_BLOCKS-PREFIX_BLOCKS)*BLOCK)
    prefix_of: np.ndarray  # (n_seq,)
    worker_of: np.ndarray  # (n_seq,)

    def tokens(self, i: int) -> list[int]:
        return np.concatenate([self.prefixes[self.prefix_of[i]], self.suffixes[i]]).tolist()

    @property
    def n(self) -> int:
        return len(self.suffixes)


def make_workload(pairs: int, seed: int = 1, workers: int = WORKERS) -> Workload:
    rng = np.random.default_rng(seed)
    own = PROMPT_BLOCKS - PREFIX_BLOCKS
    n_seq = max(8, pairs // own)
    return Workload(
        prefixes=rng.integers(0, 50_000, size=(N_PREFIXES, PREFIX_BLOCKS * BLOCK), dtype=np.int64),
        suffixes=rng.integers(0, 50_000, size=(n_seq, own * BLOCK), dtype=np.int64),
        prefix_of=rng.integers(0, N_PREFIXES, size=n_seq),
        worker_of=rng.integers(0, workers, size=n_seq),
    )


def our_events(w: Workload) -> list[tuple[str, list[int], int | None]]:
    """(worker, 16 keys, parent) per event, in store order (prefix blocks repeated per
    sequence, like an engine that stores a prompt's blocks; duplicates are idempotent)."""
    from services.core.keys import block_keys

    out = []
    for i in range(w.n):
        keys = block_keys(w.tokens(i), BLOCK)
        wid = f"w{w.worker_of[i]}"
        for j in range(0, len(keys), 16):
            out.append((wid, keys[j : j + 16], keys[j - 1] if j else None))
    return out


# --------------------------------------------------------------------------- helpers


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def row(
    name: str,
    ours: float,
    peer: float | None,
    unit: str,
    target: str,
    ok: bool | None,
    better: str = "higher",
) -> dict[str, Any]:
    ratio = None
    if peer:
        ratio = ours / peer if better == "higher" else peer / ours
    return {
        "name": name,
        "ours": ours,
        "peer": peer,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": ok,
        "better": better,
    }


# --------------------------------------------------------------------------- 1. ingest


def encode_batches(events) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """Our events as KvEventBatch msgpack bytes, one BlockStored of 16 keys per batch."""
    from services.common.schemas import BlockStored, KvEventBatch, encode

    seqs: dict[str, int] = {}
    raws = []
    for wid, keys, parent in events:
        s = seqs.get(wid, -1) + 1
        seqs[wid] = s
        ev = BlockStored(keys=keys, parent_key=parent, block_size=BLOCK)
        raws.append(
            (wid, encode(KvEventBatch(worker_id=wid, instance_id="i", seq=s, ts=0.0, events=[ev])))
        )
    return raws, seqs


def register(core, workers) -> None:
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat

    cap = WorkerCapacity(block_size=BLOCK, num_gpu_blocks=1, max_num_seqs=1, max_model_len=1)
    for wid in workers:
        core.heartbeat(
            WorkerHeartbeat(worker_id=wid, instance_id="i", url="", model="", capacity=cap), 0.0
        )


def bench_ingest(events, pairs_expected: int) -> tuple[float, float | None, int, list[bytes]]:
    """Indexer core: decode, seq check, apply, journal, and encode the deltas (all timed)."""
    from services.common.schemas import IndexDelta, encode
    from services.kv_indexer.app import split_ops
    from services.kv_indexer.core import IndexerCore, decode_batch

    pairs, seqs = encode_batches(events)
    raws = [r for _, r in pairs]
    blocks = sum(len(k) for _, k, _ in events)
    core = IndexerCore(max_blocks=None)
    register(core, seqs)
    deltas: list[bytes] = []
    gc.collect()
    t0 = time.perf_counter()
    batch = core.batch
    take = core.take_ops
    dseq = 0

    def flush() -> None:
        nonlocal dseq
        for group in split_ops(take()):
            deltas.append(encode(IndexDelta(epoch="e", seq=dseq, ts=0.0, ops=group)))
            dseq += 1

    for i, raw in enumerate(raws):
        batch(decode_batch(raw))
        if i % 64 == 63:
            flush()  # the service flushes deltas once per burst of messages
    flush()
    ours = blocks / (time.perf_counter() - t0)
    peer = None
    if PEER:
        wid_int = {w: i for i, w in enumerate(sorted(seqs))}
        jraws = []
        for n, (wid, keys, parent) in enumerate(events):
            blocks_j = [{"block_hash": k, "tokens_hash": k} for k in keys]
            ev = {"event_id": n, "data": {"stored": {"parent_hash": parent, "blocks": blocks_j}}}
            jraws.append((wid_int[wid], json.dumps(ev).encode()))
        tree = RadixTree()
        gc.collect()
        t0 = time.perf_counter()
        apply = tree.apply_event
        for w, raw in jraws:
            apply(w, raw)
        tree.find_matches([events[-1][1][0]])  # barrier: its worker thread has applied all
        peer = blocks / (time.perf_counter() - t0)
        del tree
    return ours, peer, len(core.index), deltas


def bench_replica_apply(deltas: list[bytes], blocks: int) -> float:
    """A router replica decoding and applying the indexer's deltas: blocks/s."""
    from services.common.index_replica import apply_ops
    from services.common.schemas import IndexDelta, decode
    from services.core.index import PrefixIndex

    index = PrefixIndex()
    gc.collect()
    t0 = time.perf_counter()
    for raw in deltas:
        apply_ops(index, decode(IndexDelta, raw).ops)
    return blocks / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- 2. vLLM path


def bench_vllm_path(w: Workload, max_seq: int) -> tuple[float, float | None]:
    import msgpack

    from services.core.index import PrefixIndex
    from services.kv_indexer.bridges.engine_formats import VllmDecoder
    from services.kv_indexer.bridges.rekey import Rekeyer

    payloads: list[tuple[str, bytes]] = []
    peer_in: list[tuple[int, list[int], int]] = []
    n_seq = min(w.n, max_seq)
    ehash_base = 1 << 40
    for i in range(n_seq):
        toks = w.tokens(i)
        wid = int(w.worker_of[i])
        for j in range(0, PROMPT_BLOCKS, 16):
            hashes = [ehash_base + i * PROMPT_BLOCKS + j + b for b in range(16)]
            parent = ehash_base + i * PROMPT_BLOCKS + j - 1 if j else None
            ev = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": toks[j * BLOCK : (j + 16) * BLOCK],
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
            payloads.append((f"w{wid}", msgpack.packb([time.time(), [ev], 0])))
            peer_in.append((wid, toks[j * BLOCK : (j + 16) * BLOCK], i * 1000 + j))
    blocks = len(payloads) * 16
    decoders = {f"w{k}": VllmDecoder() for k in range(WORKERS)}
    rekeyers = {f"w{k}": Rekeyer() for k in range(WORKERS)}
    index = PrefixIndex()
    gc.collect()
    t0 = time.perf_counter()
    for wid, payload in payloads:
        batch = decoders[wid].decode(payload)
        for ev in rekeyers[wid].vllm_events(batch.events):
            index.apply_stored(wid, ev.keys, ev.tier)
    ours = blocks / (time.perf_counter() - t0)
    peer = None
    if PEER:
        tree = RadixTree()
        gc.collect()
        t0 = time.perf_counter()
        for n, (wid, toks, _) in enumerate(peer_in):
            hs = compute_block_hash_for_seq(toks, BLOCK)
            blocks_j = [{"block_hash": h, "tokens_hash": h} for h in hs]
            ev = {"event_id": n, "data": {"stored": {"parent_hash": None, "blocks": blocks_j}}}
            tree.apply_event(wid, json.dumps(ev).encode())
        tree.find_matches([0])
        peer = blocks / (time.perf_counter() - t0)
    return ours, peer


# --------------------------------------------------------------------------- 3. queries


def bench_queries(w: Workload, events, n_queries: int) -> dict[str, Any]:
    from services.core.index import PrefixIndex

    index = PrefixIndex()
    for wid, keys, _ in events:
        index.apply_stored(wid, keys)
    rng = np.random.default_rng(7)
    full = [w.tokens(int(i)) for i in rng.integers(0, w.n, size=n_queries)]
    shared = []
    for i in rng.integers(0, N_PREFIXES, size=n_queries):
        own = rng.integers(0, 50_000, size=(PROMPT_BLOCKS - PREFIX_BLOCKS) * BLOCK)
        shared.append(np.concatenate([w.prefixes[i], own]).tolist())
    out: dict[str, Any] = {"stored_pairs": len(index)}
    tree = None
    if PEER:
        tree = RadixTree()
        for i in range(w.n):
            hs = compute_block_hash_for_seq(w.tokens(i), BLOCK)
            for j in range(0, len(hs), 16):
                bl = [{"block_hash": h, "tokens_hash": h} for h in hs[j : j + 16]]
                parent = hs[j - 1] if j else None
                ev = {
                    "event_id": i * 100 + j,
                    "data": {"stored": {"parent_hash": parent, "blocks": bl}},
                }
                tree.apply_event(int(w.worker_of[i]), json.dumps(ev).encode())
        tree.find_matches([0])
    check_ours = index.match_prompt(full[0], BLOCK, 0)
    out["example_match"] = check_ours
    for label, prompts in (("full", full), ("shared_prefix", shared)):
        lat: list[float] = []
        gc.collect()
        gc.disable()
        try:
            mp = index.match_prompt
            for toks in prompts:
                t = time.perf_counter_ns()
                mp(toks, BLOCK, 0)
                lat.append((time.perf_counter_ns() - t) / 1000)
        finally:
            gc.enable()
        out[f"ours_{label}_p50_us"] = statistics.median(lat)
        out[f"ours_{label}_p99_us"] = pct(lat, 99)
        if tree is not None:
            plat: list[float] = []
            gc.collect()
            gc.disable()
            try:
                for toks in prompts:
                    t = time.perf_counter_ns()
                    tree.find_matches(compute_block_hash_for_seq(toks, BLOCK))
                    plat.append((time.perf_counter_ns() - t) / 1000)
            finally:
                gc.enable()
            out[f"peer_{label}_p50_us"] = statistics.median(plat)
            out[f"peer_{label}_p99_us"] = pct(plat, 99)
    return out


# --------------------------------------------------------------------------- 4. memory


def _memory_child(side: str, pairs: int, cap: int, workers: int) -> None:
    """Run in a fresh process: build the index, print JSON with the RSS delta."""
    w = make_workload(pairs, workers=workers)
    events = our_events(w)
    if side == "peer":
        feed = []
        for i in range(w.n):
            hs = compute_block_hash_for_seq(w.tokens(i), BLOCK)
            for j in range(0, len(hs), 16):
                bl = [{"block_hash": h, "tokens_hash": h} for h in hs[j : j + 16]]
                ev = {
                    "event_id": j,
                    "data": {"stored": {"parent_hash": hs[j - 1] if j else None, "blocks": bl}},
                }
                feed.append((int(w.worker_of[i]), json.dumps(ev).encode()))
        del w, events
        gc.collect()
        before = rss_bytes()
        tree = RadixTree()
        for wid, raw in feed:
            tree.apply_event(wid, raw)
        tree.find_matches([0])
        gc.collect()
        after = rss_bytes()  # before freeing the feed: its pages going back must not count
        del feed
        print(json.dumps({"rss_delta": after - before}))
        return
    import tracemalloc

    import msgspec

    from services.core.index import PrefixIndex

    # keys arrive as bytes and are decoded one event at a time, as in the service: the index
    # must pay for its own key objects (not reuse ones the benchmark keeps alive)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[int])
    feed = [(wid, enc.encode(keys)) for wid, keys, _ in events]
    del w, events
    gc.collect()
    tracemalloc.start()
    before = rss_bytes()
    # "ours": the indexer's index (capped, as the service runs it by default: LRU order kept);
    # "replica": a router's (no cap, no LRU order)
    if side == "replica":
        index = PrefixIndex()
    else:
        index = PrefixIndex(max_blocks=cap or INDEXER_DEFAULT_CAP)
    for wid, raw in feed:
        index.apply_stored(wid, dec.decode(raw))
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    after = rss_bytes()  # before freeing the feed: its pages going back must not count
    del feed
    tracemalloc.stop()
    print(
        json.dumps(
            {
                "rss_delta": after - before,
                "traced": traced,
                "pairs": len(index),
                "evicted": index.evicted_pairs,
                "keys": index.num_keys,
            }
        )
    )


def bench_memory(pairs: int, cap: int, workers: int = WORKERS, capped: bool = True) -> dict:
    def child(side: str, c: int) -> dict[str, Any]:
        cmd = [
            sys.executable,
            "-m",
            "bench.bench_indexer",
            "--_memory-child",
            side,
            "--pairs",
            str(pairs),
            "--cap",
            str(c),
            "--workers",
            str(workers),
        ]
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    res = {"ours": child("ours", 0), "workers": workers}
    if capped:
        res["ours_capped"] = child("ours", cap)
    res["replica"] = child("replica", 0)
    if PEER:
        res["peer"] = child("peer", 0)
    return res


# --------------------------------------------------------------------------- 5. replica


async def _bench_nats(events) -> dict[str, Any]:
    """On a private nats-server: KV batches published to JetStream, then the indexer service
    consuming them (wall time until every batch is applied); then a new IndexReplica
    bootstrapping from that indexer (wall time until it holds every pair)."""
    import tempfile

    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats
    from services.common.index_replica import IndexReplica
    from services.common.streams import require_kv_events_stream
    from services.common.subjects import Subjects
    from services.kv_indexer.app import IndexerService

    tmp = tempfile.mkdtemp(prefix="bench-nats-")
    server = EmbeddedNats(Path(tmp))
    server.start()
    subjects = Subjects("benchidx")
    ib = Bus(server.url, "bench-indexer", subjects)
    rb = Bus(server.url, "bench-replica", subjects)
    await ib.connect(max_wait_s=10)
    await rb.connect(max_wait_s=10)
    svc = IndexerService(ib, max_blocks=None)
    try:
        raws, seqs = encode_batches(events)
        await require_kv_events_stream(ib)
        nc = rb.client
        for wid, raw in raws:
            await nc.publish(subjects.kv_events(wid), raw)
        await nc.flush()
        info = await ib.js.stream_info(subjects.kv_events_stream)
        while info.state.messages < len(raws):
            await asyncio.sleep(0.05)
            info = await ib.js.stream_info(subjects.kv_events_stream)
        register(svc.core, seqs)
        for ws in svc.core.workers.values():
            ws.last_hb = float("inf")  # no expiry during the run
        t0 = time.perf_counter()
        await svc.start()
        while any(svc.core.workers[w].last_seq < s for w, s in seqs.items()):  # noqa: ASYNC110
            await asyncio.sleep(0.005)  # polling the core's state: no event to await
        ingest_s = time.perf_counter() - t0
        blocks = sum(len(k) for _, k, _ in events)
        rep = IndexReplica(rb, start_timeout_s=30)
        t1 = time.perf_counter()
        await rep.start()
        await asyncio.wait_for(rep.ready.wait(), 30)
        seconds = time.perf_counter() - t1
        equal = len(rep.index) == len(svc.core.index)
        chunks = svc.snapshot_chunks(ib.client.max_payload)
        await rep.stop()
        return {
            "e2e_blocks_per_s": blocks / ingest_s,
            "e2e_seconds": ingest_s,
            "messages": len(raws),
            "seconds": seconds,
            "pairs": len(rep.index),
            "equal": equal,
            "chunks": len(chunks),
            "max_payload": ib.client.max_payload,
        }
    finally:
        await svc.stop()
        await ib.close()
        await rb.close()
        server.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- main


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "blocks/s":
        return f"{v / 1e6:.2f} M/s"
    if unit == "us":
        return f"{v:.1f} us"
    if unit == "B/pair":
        return f"{v:.0f} B"
    if unit == "s":
        return f"{v:.2f} s"
    return f"{v:g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_indexer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="250 k blocks, fewer queries")
    ap.add_argument("--pairs", type=int, default=0, help="stored (worker, block) pairs")
    ap.add_argument("--queries", type=int, default=0, help="queries per kind")
    ap.add_argument("--cap", type=int, default=0, help="memory cap for the capped run")
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    ap.add_argument(
        "--mem-workers",
        default="8,100,200,1000",
        help="worker counts the memory per pair is measured at (comma-separated)",
    )
    ap.add_argument("--workers", type=int, default=WORKERS, help=argparse.SUPPRESS)
    ap.add_argument(
        "--scale",
        default="",
        metavar="WORKERSxBLOCKS",
        help="only the scale mode, e.g. 1000x10M: replica bootstrap and decision p50 at that "
        "size (targets: bootstrap <= 5 s, decision p50 <= 200 us)",
    )
    ap.add_argument("--runs", type=int, default=3, help="scale mode: runs")
    ap.add_argument("--skip", default="", help="comma-separated: ingest,vllm,query,memory,nats")
    ap.add_argument("--out", default="bench/results/indexer", help="results directory")
    ap.add_argument("--_memory-child", dest="memory_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    pairs = args.pairs or (250_000 if args.quick else 1_000_000)
    if args.memory_child:
        _memory_child(args.memory_child, pairs, args.cap, args.workers)
        return 0
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        cpu = sorted(os.sched_getaffinity(0))[-1]
        os.sched_setaffinity(0, {cpu})
    if args.scale:
        from bench.bench_index_scale import main_scale

        return main_scale(args.scale, args.runs, args.queries or 2000, args.out)
    skip = set(filter(None, args.skip.split(",")))
    mem_workers = [int(x) for x in args.mem_workers.split(",") if x]
    n_queries = args.queries or (300 if args.quick else 1000)
    cap = args.cap or pairs // 2
    if not PEER:
        print(
            "peer: ai-dynamo-runtime is not installed (pip install ai-dynamo-runtime==1.6.1);"
            " printing our figures only"
        )
    print(
        f"workload: {pairs:,} stored pairs target, {WORKERS} workers, block {BLOCK}, "
        f"prompts {PROMPT_BLOCKS * BLOCK} tokens"
    )
    from services.core.index import PrefixIndex

    print(f"index class: {PrefixIndex.__module__}.{PrefixIndex.__name__}")
    t_all = time.perf_counter()
    w = make_workload(pairs)
    events = our_events(w)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    if "ingest" not in skip:
        ours, peer, stored, deltas = bench_ingest(events, pairs)
        extra["stored_pairs"] = stored
        rows.append(
            row(
                "ingest canonical events (16 blocks/event)",
                ours,
                peer,
                "blocks/s",
                ">= 1.0x peer",
                ours >= peer if peer else None,
            )
        )
        blocks = sum(len(k) for _, k, _ in events)
        rows.append(
            row(
                "router replica applies the indexer's deltas",
                bench_replica_apply(deltas, blocks),
                None,
                "blocks/s",
                "-",
                None,
            )
        )
        del deltas
        print(f"  ingest done ({stored:,} pairs)", flush=True)
    if "vllm" not in skip:
        ours, peer = bench_vllm_path(w, max_seq=w.n)
        rows.append(
            row(
                "vLLM batch bytes -> decode, re-key, apply",
                ours,
                peer,
                "blocks/s",
                ">= 0.5 M/s",
                ours >= 0.5e6,
            )
        )
        print("  vLLM path done", flush=True)
    if "query" not in skip:
        q = bench_queries(w, events, n_queries)
        extra["query"] = q
        for label in ("full", "shared_prefix"):
            for p in ("p50", "p99"):
                ours = q[f"ours_{label}_{p}_us"]
                peer_q = q.get(f"peer_{label}_{p}_us")
                rows.append(
                    row(
                        f"4096-token prompt keys + overlap, {label}, {p}",
                        ours,
                        peer_q,
                        "us",
                        "<= 0.8x peer" if p == "p50" else "-",
                        (ours <= 0.8 * peer_q if peer_q else None) if p == "p50" else None,
                        better="lower",
                    )
                )
        print("  queries done", flush=True)
    if "memory" not in skip:
        extra["memory"] = {}
        for n_w in mem_workers:
            m = bench_memory(pairs, cap, n_w, capped=n_w == mem_workers[0])
            extra["memory"][n_w] = m
            o = m["ours"]
            per = o["rss_delta"] / o["pairs"]
            peer_per = m["peer"]["rss_delta"] / o["pairs"] if "peer" in m else None
            tr = o["traced"] / o["pairs"]
            rows.append(
                row(
                    f"memory per pair, indexer, {n_w} workers (RSS)",
                    per,
                    peer_per,
                    "B/pair",
                    "<= 71 B",
                    per <= 71,
                    better="lower",
                )
            )
            rows.append(
                row(
                    f"memory per pair, indexer, {n_w} workers (tracemalloc)",
                    tr,
                    None,
                    "B/pair",
                    "<= 71 B",
                    tr <= 71,
                    better="lower",
                )
            )
            r = m["replica"]
            rr, rt = r["rss_delta"] / r["pairs"], r["traced"] / r["pairs"]
            rows.append(
                row(
                    f"memory per pair, router replica, {n_w} workers (RSS)",
                    rr,
                    peer_per,
                    "B/pair",
                    "<= 100 B",
                    rr <= 100,
                    better="lower",
                )
            )
            rows.append(
                row(
                    f"memory per pair, router replica, {n_w} workers (tracemalloc)",
                    rt,
                    None,
                    "B/pair",
                    "<= 100 B",
                    rt <= 100,
                    better="lower",
                )
            )
            if "ours_capped" in m:
                c = m["ours_capped"]
                rows.append(
                    row(
                        f"pairs kept with cap {cap:,} (evicted {c['evicted']:,})",
                        c["pairs"],
                        None,
                        "pairs",
                        f"<= {cap:,}",
                        c["pairs"] <= cap,
                    )
                )
            print(f"  memory at {n_w} workers done", flush=True)
    if "nats" not in skip:
        r = asyncio.run(_bench_nats(events))
        extra["nats"] = r
        rows.append(
            row(
                f"service: JetStream -> indexer, {r['messages']:,} batches",
                r["e2e_blocks_per_s"],
                None,
                "blocks/s",
                "-",
                None,
            )
        )
        rows.append(
            row(
                f"new replica holds {r['pairs']:,} pairs ({r['chunks']} chunks)",
                r["seconds"],
                None,
                "s",
                "<= 2 s",
                r["seconds"] <= 2 and r["equal"],
                better="lower",
            )
        )
    print()
    print(f"{'measure':58s} {'ours':>12s} {'dynamo':>12s} {'ratio':>7s}  {'target':>10s}  met")
    for r_ in rows:
        ratio = f"{r_['ratio']:.2f}x" if r_["ratio"] else "   -"
        met = {True: "yes", False: "NO", None: "-"}[r_["met"]]
        print(
            f"{r_['name']:58s} {fmt(r_['ours'], r_['unit']):>12s} "
            f"{fmt(r_['peer'], r_['unit']):>12s} {ratio:>7s}  {r_['target']:>10s}  {met}"
        )
    print("(ratio > 1: ours better)")
    print(f"total {time.perf_counter() - t_all:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_indexer_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"pairs": pairs, "quick": args.quick, "peer": PEER, "rows": rows, "extra": extra},
            indent=1,
            default=str,
        )
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
