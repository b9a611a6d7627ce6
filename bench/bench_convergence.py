"""How fast the global KV index converges to the workers' truth, and what it costs.

    python -m bench.bench_convergence                 # everything, 3 runs each (~6 minutes)
    python -m bench.bench_convergence --only dump --runs 5
    python -m bench.bench_convergence --only verify-cpu --window 120

Real parts: a NATS server (``--nats-url``; the outage class starts its own nats-server and
kills it), simulated workers (their real KV event path, faults and chunked dumps; caches
filled with services.worker_sim.cachefill), the real indexer service. Measures:

1. ``dump``: a 1,000,000-block worker's full dump fetched by the indexer's code (chunked
   request/reply): seconds, bytes, chunks; typical chains (64 blocks) and the worst case
   (one-block chains: an event per block). Beside it: the single-reply dump of before, which
   must fit in one NATS message (``max_payload``, 1 MB by default).
2. ``converge``: 5% of KV batches dropped + 5% duplicated while the caches churn, then the
   faults stop: seconds until ``kv.index.verify`` (the checker behind ``kvgate index verify``)
   reports every worker equal; at 27,000 blocks (2 workers) and 1,000,000 blocks (1 worker).
3. ``outage``: NATS killed for 10 s while the caches move on: workers expired by the indexer
   (must be 0) and seconds from NATS back until the index equals the workers' caches.
4. ``verify-cpu``: CPU of an indexer *process* (``kvgate indexer``) holding a 1 M-block
   worker, over ``--window`` seconds, background verifier on (default share) vs off.

Prints one table; writes JSON under bench/results/convergence/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.common.embedded import EmbeddedNats, free_port
from services.common.kvdump import fetch_kvdump
from services.common.schemas import (
    AllBlocksCleared,
    IndexVerifyReply,
    IndexVerifyRequest,
    KvEventBatch,
    encode,
)
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.common.tokenizer import ByteTokenizer
from services.core.engine import EngineConfig
from services.kv_indexer.app import IndexerService
from services.kv_indexer.divergence import apply_events
from services.worker_sim.app import _heartbeats
from services.worker_sim.cachefill import fill_cache
from services.worker_sim.worker import SimWorker, WorkerSettings

RESULTS = Path(__file__).parent / "results" / "convergence"
FAULTS = {"drop_kv": 0.05, "dup_kv": 0.05}


def _truth(w: SimWorker) -> dict[int, int]:
    return apply_events({}, w.engine.dump_cache())


@contextlib.asynccontextmanager
async def _bus(url: str, subjects: Subjects, name: str) -> AsyncIterator[Bus]:
    b = Bus(url, name, subjects)
    await b.connect(max_wait_s=10)
    try:
        yield b
    finally:
        await b.close()


@contextlib.asynccontextmanager
async def _workers(
    bus: Bus, n: int, blocks: int, prefix: str, beat_s: float = 1.0
) -> AsyncIterator[list[SimWorker]]:
    ws: list[SimWorker] = []
    try:
        for i in range(n):
            cfg = EngineConfig(num_gpu_blocks=blocks, max_num_seqs=16, max_model_len=4096)
            w = SimWorker(
                WorkerSettings(worker_id=f"{prefix}{i}", port=free_port()),
                cfg,
                ByteTokenizer(),
                bus,
            )
            await w.start()
            ws.append(w)
        beat = asyncio.create_task(_heartbeats(bus, ws, beat_s))
        try:
            yield ws
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
    finally:
        for w in ws:
            await w.close()


async def _churn(ws: list[SimWorker], blocks: int, seed: int, chain: int = 64) -> None:
    done, step = 0, 0
    while done < blocks:
        for w in ws:
            fill_cache(w, min(1024, blocks - done), chain_blocks=chain, seed=seed * 100_000 + step)
        done += 1024
        step += 1
        await asyncio.sleep(0.005)  # an engine step's pacing


@contextlib.asynccontextmanager
async def _indexer(url: str, subjects: Subjects, **kw: Any) -> AsyncIterator[IndexerService]:
    async with _bus(url, subjects, "indexer") as b:
        svc = IndexerService(b, **kw)
        await svc.start()
        await asyncio.wait_for(svc.consuming.wait(), 10)
        try:
            yield svc
        finally:
            await svc.stop()


async def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        await asyncio.sleep(0.01)


async def _until_equal(bus: Bus, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        reply = await bus.request(
            bus.subjects.kv_index_verify, IndexVerifyRequest(), IndexVerifyReply, timeout=120
        )
        if len(reply.workers) == n and all(r.status == "equal" for r in reply.workers):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"no convergence in {timeout}s: {reply}")


# --------------------------------------------------------------------------- 1. dump
async def bench_dump(url: str, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for chain in (64, 1):
        subjects = Subjects(f"bconv{uuid.uuid4().hex[:6]}")
        async with (
            _bus(url, subjects, "bench") as bus,
            _workers(bus, 1, 1_000_000, "d") as ws,
        ):
            await require_kv_events_stream(bus)
            t0 = time.perf_counter()
            fill_cache(ws[0], 1_000_000, chain_blocks=chain, chains_per_batch=1024 // chain)
            fill_s = time.perf_counter() - t0
            single = len(
                encode(
                    KvEventBatch(
                        worker_id="d0",
                        instance_id=ws[0].instance_id,
                        seq=0,
                        ts=0.0,
                        events=[AllBlocksCleared(), *ws[0].engine.dump_cache()],
                    )
                )
            )
            secs, sizes, chunks = [], [], []
            for _ in range(runs):
                f = await fetch_kvdump(bus, "d0", reason="bench", chunk_timeout_s=30)
                assert f.blocks == 1_000_000
                secs.append(f.seconds)
                sizes.append(f.bytes)
                chunks.append(f.chunks)
            out[f"chain{chain}"] = {
                "blocks": 1_000_000,
                "seconds": secs,
                "median_s": statistics.median(secs),
                "bytes": sizes[0],
                "chunks": chunks[0],
                "max_payload": bus.client.max_payload,
                "single_reply_bytes": single,
                "single_reply_fits": single <= bus.client.max_payload,
                "fill_s": fill_s,
            }
            await bus.js.delete_stream(subjects.kv_events_stream)
    return out


# --------------------------------------------------------------------------- 2. converge
async def bench_converge(url: str, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, blocks, churned in ((2, 27_000, 40_000), (1, 1_000_000, 60_000)):
        times: list[float] = []
        for run in range(runs):
            subjects = Subjects(f"bconv{uuid.uuid4().hex[:6]}")
            async with _bus(url, subjects, "bench") as bus:
                await require_kv_events_stream(bus)
                async with (
                    _indexer(url, subjects, verify_cpu_share=0.0) as svc,
                    _workers(bus, n, blocks, "c") as ws,
                ):
                    await _wait(lambda: len(svc.core.workers) == n, 10, "registration")  # noqa: B023
                    await _churn(ws, blocks, seed=run)
                    for w in ws:
                        await w.apply_faults(FAULTS)
                    await _churn(ws, churned, seed=100 + run)
                    for w in ws:
                        await w.apply_faults({"drop_kv": 0.0, "dup_kv": 0.0})
                    times.append(await _until_equal(bus, n, 60))
                await bus.js.delete_stream(subjects.kv_events_stream)
        out[f"{blocks}"] = {"workers": n, "seconds": times, "median_s": statistics.median(times)}
    return out


# --------------------------------------------------------------------------- 3. outage
async def bench_outage(runs: int, outage_s: float = 10.0) -> dict[str, Any]:
    times: list[float] = []
    expired: list[int] = []
    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            server = EmbeddedNats(Path(tmp))
            url = server.start()
            subjects = Subjects("bout")
            try:
                async with _bus(url, subjects, "bench") as bus:
                    await require_kv_events_stream(bus)
                    async with (
                        _indexer(url, subjects, verify_cpu_share=0.0) as svc,
                        _workers(bus, 2, 27_000, "o") as ws,
                    ):
                        await _wait(lambda: len(svc.core.workers) == 2, 10, "registration")  # noqa: B023
                        await _churn(ws, 20_000, seed=run)
                        await _until_equal(bus, 2, 30)
                        assert server.proc is not None
                        server.proc.kill()
                        server.proc.wait()
                        down = time.monotonic()
                        await _churn(ws, 5_000, seed=50 + run)
                        await asyncio.sleep(outage_s - (time.monotonic() - down))
                        server.start()
                        back = time.monotonic()

                        def equal() -> bool:
                            return all(
                                svc.core.index.pairs_of(w.worker_id) == _truth(w)
                                for w in ws  # noqa: B023
                            )

                        await _wait(equal, 30, "index equal after the outage")
                        times.append(time.monotonic() - back)
                        expired.append(svc.core.counts["expired"])
            finally:
                server.stop()
    return {
        "outage_s": outage_s,
        "seconds": times,
        "median_s": statistics.median(times),
        "expired": expired,
    }


# --------------------------------------------------------------------------- 4. verify CPU
def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _http_get(port: int, path: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as r:
        return await r.text()


async def bench_verify_cpu(url: str, window_s: float, share: float = 0.05) -> dict[str, Any]:
    """Indexer process CPU with the verifier off and on at ``share`` (higher than the
    default so that a window holds several 1 M-block checks), over ``window_s`` starting
    right after a check; then what that means at the default share (0.01): the verifier
    waits (its own CPU count per check) / share between checks."""
    out: dict[str, Any] = {}
    for s in (0.0, share):
        subjects = Subjects(f"bcpu{uuid.uuid4().hex[:6]}")
        port = free_port()
        async with _bus(url, subjects, "bench") as bus:
            await require_kv_events_stream(bus)
            proc = await asyncio.create_subprocess_exec(
                *[
                    sys.executable,
                    "-m",
                    "services.cli",
                    "indexer",
                    "--nats-url",
                    url,
                    "--subject-prefix",
                    subjects.prefix.rstrip("."),
                    "--port",
                    str(port),
                    "--verify-cpu-share",
                    str(s),
                    "--log-level",
                    "warning",
                ],
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            try:
                async with _workers(bus, 1, 1_000_000, "u") as ws:
                    await asyncio.sleep(2)  # registration
                    fill_cache(ws[0], 1_000_000, chains_per_batch=16)
                    deadline = time.monotonic() + 120
                    while True:
                        with contextlib.suppress(Exception):
                            h = json.loads(await _http_get(port, "/health"))
                            if h["blocks"] >= 1_000_000:
                                break
                        if time.monotonic() > deadline:
                            raise RuntimeError("indexer did not load 1M blocks")
                        await asyncio.sleep(0.2)
                    name = "kvgate_index_verify_checks_total"
                    if s > 0:  # start the window right after a check ended
                        first = _metric(await _http_get(port, "/metrics"), name)
                        while True:  # an HTTP-visible counter in another process: poll it
                            if _metric(await _http_get(port, "/metrics"), name) != first:
                                break
                            await asyncio.sleep(0.05)
                    else:
                        await asyncio.sleep(5)
                    m0 = await _http_get(port, "/metrics")
                    c0 = _proc_cpu_s(proc.pid)
                    await asyncio.sleep(window_s)  # the measurement window
                    c1 = _proc_cpu_s(proc.pid)
                    m1 = await _http_get(port, "/metrics")
                    out[f"share={s}"] = {
                        "window_s": window_s,
                        "cpu_s": c1 - c0,
                        "cpu_pct": 100 * (c1 - c0) / window_s,
                        "checks": _metric(m1, name) - _metric(m0, name),
                        "verifier_cpu_s": _metric(m1, "kvgate_index_verify_cpu_seconds_total")
                        - _metric(m0, "kvgate_index_verify_cpu_seconds_total"),
                    }
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
            await bus.js.delete_stream(subjects.kv_events_stream)
    on, off = out[f"share={share}"], out["share=0.0"]
    checks = max(on["checks"], 1.0)
    per_check = (on["cpu_s"] - off["cpu_s"]) / checks  # process CPU a 1M check adds
    own = on["verifier_cpu_s"] / checks  # what the verifier counts (its pacing input)
    out["per_check_cpu_s"] = per_check
    out["measured_share_pct"] = on["cpu_pct"] - off["cpu_pct"]
    out["default_interval_s"] = max(1.0, own / 0.01)
    out["verifier_pct"] = 100 * per_check / out["default_interval_s"]
    return out


# --------------------------------------------------------------------------- main
def _table(res: dict[str, Any]) -> str:
    rows = [f"{'measure':<52} {'ours (median of runs)':>24}  {'before / bound':>22}"]
    if "dump" in res:
        for k, d in res["dump"].items():
            rows.append(
                f"{'dump 1M blocks, ' + k + ': s / MB / chunks':<52} "
                f"{d['median_s']:>8.2f} s {d['bytes'] / 1e6:>6.1f} MB {d['chunks']:>4}  "
                f"{'single reply ' + format(d['single_reply_bytes'] / 1e6, '.1f') + ' MB':>18}"
                f" {'fits' if d['single_reply_fits'] else 'LOST'}"
            )
    if "converge" in res:
        for k, d in res["converge"].items():
            rows.append(
                f"{'5% drop + 5% dup, ' + k + ' blocks: s to equal':<52} "
                f"{d['median_s']:>22.2f} s  {'<= 10 s':>22}"
            )
    if "outage" in res:
        d = res["outage"]
        rows.append(
            f"{'NATS killed 10 s: s from back to equal':<52} {d['median_s']:>22.2f} s  "
            f"{'<= 2 s':>22}"
        )
        rows.append(f"{'NATS killed 10 s: workers expired':<52} {max(d['expired']):>24}  {0:>22}")
    if "verify_cpu" in res:
        d = res["verify_cpu"]
        rows.append(
            f"{'1M-block check: indexer CPU s per check':<52} {d['per_check_cpu_s']:>22.2f} s"
        )
        rows.append(
            f"{'verifier at share 0.05: indexer CPU on - off':<52} "
            f"{d['measured_share_pct']:>22.2f} %  {'<= 5 %':>22}"
        )
        rows.append(
            f"{'verifier at default 0.01: % of a core (1M blocks)':<52} "
            f"{d['verifier_pct']:>22.2f} %  {'<= 2 % of a core':>22}"
        )
    return "\n".join(rows)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"host_cpus": os.cpu_count(), "hostname": socket.gethostname()}
    only = set(args.only or ["dump", "converge", "outage", "verify-cpu"])
    if "dump" in only:
        res["dump"] = await bench_dump(args.nats_url, args.runs)
    if "converge" in only:
        res["converge"] = await bench_converge(args.nats_url, args.runs)
    if "outage" in only:
        res["outage"] = await bench_outage(args.runs)
    if "verify-cpu" in only:
        res["verify_cpu"] = await bench_verify_cpu(args.nats_url, args.window)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_convergence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nats-url", default=os.environ.get("KVGATE_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--runs", type=int, default=3, help="runs (seeds) per measurement")
    p.add_argument(
        "--only",
        action="append",
        choices=["dump", "converge", "outage", "verify-cpu"],
        help="run only this measurement (repeatable)",
    )
    p.add_argument("--window", type=float, default=60.0, help="verify-cpu window, seconds")
    args = p.parse_args(argv)
    from services.common.logging import configure_logging

    configure_logging("bench", "error", "console")
    res = asyncio.run(_run(args))
    print(_table(res))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"convergence-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
