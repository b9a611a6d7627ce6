"""Fault convergence with real parts: a real NATS server (JetStream), real simulated workers
(their own KV event path, faults and chunked dumps), the real indexer service.

- 5% of KV batches dropped and 5% duplicated: the index equals every worker's own cache
  (the checker says 0 divergent blocks) within 10 s of the faults stopping, at 27,000 and at
  1,000,000 blocks per worker;
- NATS killed for 10 s: no worker is expired by the indexer, no "cleared" delta reaches the
  routers, and the index is equal again within 2 s of NATS coming back;
- ``kvgate index verify`` prints the difference per worker and exits non-zero when the index
  diverges; the background verifier finds and repairs divergence by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.embedded import EmbeddedNats
from services.common.schemas import (
    IndexCleared,
    IndexDelta,
    IndexVerifyReply,
    IndexVerifyRequest,
    decode,
)
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.kv_indexer.app import IndexerService
from services.kv_indexer.divergence import apply_events
from services.kv_indexer.verifier import CHECKS, DIVERGENT, repairs_total
from services.worker_sim.app import _heartbeats
from services.worker_sim.cachefill import fill_cache
from services.worker_sim.worker import SimWorker
from tests.test_kv_support import connected, indexer, wait_until
from tests.test_worker_sim_support import sim_worker

FAULTS = {"drop_kv": 0.05, "dup_kv": 0.05}
NO_FAULTS = {"drop_kv": 0.0, "dup_kv": 0.0}


def truth(w: SimWorker) -> dict[int, int]:
    """The worker's own cache as (key -> tier bits) pairs."""
    return apply_events({}, w.engine.dump_cache())


def index_equals(svc: IndexerService, workers: list[SimWorker]) -> bool:
    return all(svc.core.index.pairs_of(w.worker_id) == truth(w) for w in workers)


@contextlib.asynccontextmanager
async def fleet(bus: Bus, n: int, blocks: int, prefix: str = "c") -> AsyncIterator[list[SimWorker]]:
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                sim_worker(bus, worker_id=f"{prefix}{i}", engine={"num_gpu_blocks": blocks})
            )
            for i in range(n)
        ]
        beat = asyncio.create_task(_heartbeats(bus, workers, 0.5))
        try:
            yield workers
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat


async def churn(workers: list[SimWorker], blocks: int, seed: int) -> None:
    """New blocks in steps of ~1,000 (an engine step's worth of events per batch), letting
    the sinks publish between steps: the cache fills, then evicts its oldest blocks."""
    done = 0
    step = 0
    while done < blocks:
        for w in workers:
            fill_cache(w, min(1024, blocks - done), chains_per_batch=16, seed=seed * 100_000 + step)
        done += 1024
        step += 1
        await asyncio.sleep(0.005)  # pacing of the load, like an engine's step time


async def verify(bus: Bus, **kw) -> IndexVerifyReply:
    return await bus.request(
        bus.subjects.kv_index_verify, IndexVerifyRequest(**kw), IndexVerifyReply, timeout=60
    )


async def converged_within(bus: Bus, workers: list[SimWorker], seconds: float) -> float:
    """Seconds until the checker reports every worker equal (0 divergent blocks)."""
    t0 = time.monotonic()
    while True:
        reply = await verify(bus)
        if {r.worker_id for r in reply.workers} == {w.worker_id for w in workers} and all(
            r.status == "equal" for r in reply.workers
        ):
            assert reply.divergent_blocks == 0
            return time.monotonic() - t0
        assert time.monotonic() - t0 < seconds, f"not converged after {seconds}s: {reply}"


async def _drop_dup_convergence(
    bus: Bus, nats_url: str, subjects: Subjects, n: int, blocks: int, fill: int, churned: int
) -> None:
    await require_kv_events_stream(bus)
    async with (
        indexer(nats_url, subjects, heartbeat_timeout_s=10.0) as svc,
        fleet(bus, n, blocks) as workers,
    ):
        await wait_until(lambda: len(svc.core.workers) == n, what="registration")
        await churn(workers, fill, seed=1)  # warm caches, no faults
        for w in workers:
            await w.apply_faults(FAULTS)
        await churn(workers, churned, seed=2)
        for w in workers:
            await w.apply_faults(NO_FAULTS)
        stopped = time.monotonic()
        # the sinks count what the faults decided once they reach those batches
        await wait_until(
            lambda: all(w.kv_seq_done >= w.kv_seq for w in workers), what="sinks drained"
        )
        # the faults happened: batches lost (seen as gaps, resynced) and duplicated (skipped)
        assert sum(w.kv_dropped.get("fault", 0) for w in workers) > 0
        await converged_within(bus, workers, 10.0 - (time.monotonic() - stopped))
        assert time.monotonic() - stopped <= 10.0
        assert svc.core.counts["duplicates"] > 0 and svc.core.counts["resyncs"] > 0
        # checked independently of the checker: the index holds exactly the workers' caches
        assert index_equals(svc, workers)
        assert all(len(truth(w)) == min(blocks, fill + churned) for w in workers)


async def test_drop_and_duplicate_faults_converge_at_27k_blocks(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await _drop_dup_convergence(bus, nats_url, subjects, 2, 27_000, 27_000, 40_000)


@pytest.mark.slow
async def test_drop_and_duplicate_faults_converge_at_1m_blocks(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await _drop_dup_convergence(bus, nats_url, subjects, 1, 1_000_000, 1_000_000, 60_000)


async def test_nats_killed_for_10s_no_expiry_and_equal_within_2s(
    tmp_path: Path, subjects: Subjects
) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    try:
        async with (
            connected(url, subjects, "workers") as wbus,
            connected(url, subjects, "watcher") as watcher,
        ):
            await require_kv_events_stream(wbus)
            async with (
                indexer(url, subjects, heartbeat_timeout_s=3.0) as svc,
                fleet(wbus, 2, 27_000, prefix="n") as workers,
            ):
                await wait_until(lambda: len(svc.core.workers) == 2, what="registration")
                await churn(workers, 20_000, seed=3)
                await converged_within(watcher, workers, 10.0)
                cleared: list[str] = []

                async def on_delta(msg) -> None:  # what a router's replica receives
                    d = decode(IndexDelta, msg.data)
                    cleared.extend(op.worker_id for op in d.ops if isinstance(op, IndexCleared))

                await watcher.client.subscribe(subjects.kv_index_delta, cb=on_delta)
                await watcher.client.flush()
                server.proc.kill()  # type: ignore[union-attr]
                server.proc.wait()  # type: ignore[union-attr]
                down_at = time.monotonic()
                await wait_until(lambda: not wbus.is_connected, what="workers see NATS down")
                await churn(workers, 5_000, seed=4)  # the caches move on; events are lost
                await asyncio.sleep(10.0 - (time.monotonic() - down_at))  # the outage itself
                assert set(svc.core.workers) == {"n0", "n1"}
                assert svc.core.counts["expired"] == 0
                assert not index_equals(svc, workers)  # the index missed the outage's events
                server.start()
                back = time.monotonic()
                await wait_until(
                    lambda: index_equals(svc, workers), timeout=2.0, what="index equal again"
                )
                took = time.monotonic() - back
                await converged_within(watcher, workers, 10.0)  # and the checker agrees
                assert svc.core.counts["expired"] == 0 and cleared == []
                assert svc.core.counts["resync:reconnect"] >= 1
                print(f"equal again {took:.2f}s after NATS came back")
    finally:
        server.stop()


async def test_background_verifier_finds_and_repairs_divergence(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    async with (
        indexer(nats_url, subjects, verify_cpu_share=1.0) as svc,
        fleet(bus, 1, 4_000, prefix="v") as workers,
    ):
        svc.verifier.min_interval_s = 0.05
        w = workers[0]
        await wait_until(lambda: "v0" in svc.core.workers)
        await churn(workers, 3_000, seed=5)
        await wait_until(lambda: index_equals(svc, workers), what="events applied")
        repairs = repairs_total()
        # the index loses pairs behind the indexer's back (nothing a seq number would show)
        lost = list(truth(w))[:25]
        svc.core.index.apply_removed("v0", lost)
        await wait_until(lambda: repairs_total() > repairs, timeout=15, what="divergence found")
        assert svc.core.counts["resync:verify"] >= 1
        await wait_until(lambda: index_equals(svc, workers), what="repaired")
        await wait_until(
            lambda: DIVERGENT.labels("v0")._value.get() == 0, timeout=15, what="gauge back to 0"
        )
        assert CHECKS.labels("divergent")._value.get() >= 1


async def test_index_verify_cli_prints_the_difference_and_exits_nonzero(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    async with (
        indexer(nats_url, subjects) as svc,
        fleet(bus, 2, 2_000, prefix="k") as workers,
    ):
        await wait_until(lambda: len(svc.core.workers) == 2)
        await churn(workers, 1_500, seed=6)
        await wait_until(lambda: index_equals(svc, workers), what="events applied")

        async def cli(*args: str) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.cli",
                "index",
                "verify",
                "--nats-url",
                nats_url,
                "--subject-prefix",
                subjects.prefix.rstrip("."),
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            out, _ = await proc.communicate()
            return proc.returncode or 0, out.decode()

        code, out = await cli()
        assert code == 0, out
        assert "k0" in out and "k1" in out and "divergent blocks: 0" in out
        lost = list(truth(workers[1]))[:7]
        svc.core.index.apply_removed("k1", lost)
        code, out = await cli("--sample", "3")
        assert code == 1, out
        row = next(line.split() for line in out.splitlines() if line.startswith("k1 "))
        assert row[1] == "divergent" and row[5:7] == ["7", "0"]  # 7 missing, 0 extra
        assert f"{lost[0]:#018x}" in out or any(f"{k:#018x}" in out for k in lost)
        assert "divergent blocks: 7" in out
        code, out = await cli("--repair")
        assert code == 1 and "(repair started)" in out
        await wait_until(lambda: index_equals(svc, workers), what="repaired")
        code, out = await cli("--worker", "k1")
        assert code == 0 and "k0" not in out, out
