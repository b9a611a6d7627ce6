"""The index stays exact under ordinary load with no repair, and a repair is an alert.

Real parts: the dev NATS (JetStream), simulated workers (services.worker_sim: their engine on
real time, HTTP API, KV event sink and chunked dumps), the real indexer with its background
verifier, load sent as OpenAI completions over HTTP.

The drift of issue 36 was the check's, not the index's: a simulated worker's engine changes
its cache when it schedules a step, but publishes the step's KV events (and so gives them
their seq) only after the step's duration; a dump asked for in between read the new cache
and named the old seq, and the verifier "repaired" a difference that the next batch closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from bench.bench_index_drift import load_prompt
from services.common.bus import Bus
from services.common.schemas import (
    Alert,
    IndexVerifyReply,
    IndexVerifyRequest,
    WorkerDivergence,
    decode,
)
from services.common.streams import require_alert_streams, require_kv_events_stream
from services.common.subjects import Subjects
from services.kv_indexer.divergence import apply_events
from services.kv_indexer.repair_incidents import RepairIncidents
from services.kv_indexer.verifier import CHECKS, REPAIR_ALERTS, repairs_total
from services.worker_sim.app import _heartbeats
from services.worker_sim.worker import SimWorker
from tests.test_kv_support import indexer, wait_until
from tests.test_worker_sim_support import sim_worker


def truth(w: SimWorker) -> dict[int, int]:
    """The worker's own cache as (key -> tier bits) pairs."""
    return apply_events({}, w.engine.dump_cache())


def checks(result: str) -> float:
    return CHECKS.labels(result)._value.get()


@contextlib.asynccontextmanager
async def fleet(
    bus: Bus, n: int, prefix: str, speedup: float, **engine: Any
) -> AsyncIterator[list[SimWorker]]:
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                sim_worker(bus, worker_id=f"{prefix}{i}", speedup=speedup, engine=engine)
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


async def complete(session: aiohttp.ClientSession, w: SimWorker, prompt: str, n: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "stream": True}
    async with session.post(w.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content:
            pass


async def client(w: SimWorker, stop: asyncio.Event, rng: random.Random, unique: bool) -> int:
    """One client sending requests back to back until ``stop``: ordinary chat-like traffic (a
    few shared system prompts, short questions), or ``unique`` long prompts that churn the
    cache. Returns the prompt tokens sent."""
    sent = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            prompt = load_prompt(rng, unique)
            await complete(session, w, prompt, rng.randint(4, 48))
            sent += len(prompt)  # the byte tokenizer: one token per byte
    return sent


async def verify(bus: Bus, **kw: Any) -> IndexVerifyReply:
    return await bus.request(
        bus.subjects.kv_index_verify, IndexVerifyRequest(**kw), IndexVerifyReply, timeout=30
    )


async def test_a_dump_taken_while_a_step_runs_names_that_steps_seq(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """Deterministic core of the drift: one long step (a slow GPU), checked in the middle."""
    await require_kv_events_stream(bus)
    async with (
        indexer(nats_url, subjects, heartbeat_timeout_s=10.0) as svc,
        fleet(bus, 1, "mid", speedup=1.0, num_gpu_blocks=2_000) as [w],
    ):
        await wait_until(
            lambda: (
                "mid0" in svc.core.workers
                and svc.core.workers["mid0"].last_seq >= w.kv_seq
                and not svc.core.workers["mid0"].resyncing
            ),
            what="the index in step with the worker",
        )
        await w.apply_faults({"slow_factor": 2_000.0})  # the prefill step lasts ~1.5 min
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(complete(session, w, "p" * 1_000, 8))
            # the step is scheduled: its 62 prompt blocks are in the cache, its events not out
            await wait_until(
                lambda: w.engine.num_cached_blocks >= 62, what="prefill step scheduled"
            )
            reply = await verify(bus, repair=False)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await request
        [r] = reply.workers
        assert r.status == "equal", r  # was: divergent, 62 missing at the dump's stale seq
        assert r.worker_blocks == 62 and r.index_blocks == 62


@pytest.mark.parametrize(
    ("unique", "num_gpu_blocks"),
    [(False, 27_000), (True, 600)],
    ids=["ordinary-load", "heavy-eviction"],
)
async def test_load_needs_no_repair(
    bus: Bus, nats_url: str, subjects: Subjects, unique: bool, num_gpu_blocks: int
) -> None:
    """Three workers on real time under load while the background verifier checks them back
    to back: every conclusive check equal, no repair. Heavy eviction: 600-block caches that
    unique prompts of 12-50 blocks churn through many times over."""
    await require_kv_events_stream(bus)
    async with (
        indexer(
            nats_url, subjects, heartbeat_timeout_s=10.0, verify_cpu_share=1.0, max_blocks=None
        ) as svc,
        fleet(bus, 3, "load", speedup=1.0, num_gpu_blocks=num_gpu_blocks, max_num_seqs=32) as ws,
    ):
        svc.verifier.min_interval_s = 0.05
        await wait_until(lambda: len(svc.core.workers) == 3, what="registration")
        repairs, divergent, equal = repairs_total(), checks("divergent"), checks("equal")
        stop = asyncio.Event()
        rng = random.Random(36)
        clients = [
            asyncio.create_task(client(w, stop, random.Random(rng.random()), unique))
            for w in ws
            for _ in range(6)
        ]
        # run until the verifier has compared 90 times (each at a random point of the load)
        await wait_until(
            lambda: (
                checks("equal") + checks("divergent") - equal - divergent >= 90
                or any(t.done() for t in clients)
            ),
            timeout=60,
            what="90 conclusive checks",
        )
        stop.set()
        sent = sum(await asyncio.gather(*clients))
        assert checks("divergent") - divergent == 0, svc.verifier.status()
        assert repairs_total() - repairs == 0
        if unique:  # the caches were churned through several times
            assert sent // 16 > 3 * 3 * num_gpu_blocks
            assert all(w.engine.num_cached_blocks > num_gpu_blocks // 2 for w in ws)
        # and independently of the checker: once the sinks are drained, the index is exact
        await wait_until(lambda: all(w.kv_seq_done >= w.kv_seq for w in ws), what="drained")
        await wait_until(
            lambda: all(svc.core.index.pairs_of(w.worker_id) == truth(w) for w in ws),
            what="index equal to the workers' caches",
        )


class AlertInbox:
    """index_repaired alert signals the indexer sends, in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Alert] = asyncio.Queue()

    async def start(self, bus: Bus) -> AlertInbox:
        await require_alert_streams(bus)

        async def on(msg: Any) -> None:
            alert = decode(Alert, msg.data)
            if alert.kind == "index_repaired":
                self.queue.put_nowait(alert)

        await bus.client.subscribe(bus.subjects.alert_signal("indexer"), cb=on)
        await bus.client.flush()
        return self


async def test_repairs_raise_one_alert_per_incident(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    inbox = await AlertInbox().start(bus)
    async with (
        indexer(nats_url, subjects, heartbeat_timeout_s=10.0, verify_alert_quiet_s=1.0) as svc,
        fleet(bus, 1, "rep", speedup=200.0, num_gpu_blocks=2_000) as [w],
    ):
        await wait_until(lambda: "rep0" in svc.core.workers, what="registration")
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                await complete(session, w, f"prompt {i} " * 60, 4)
        await wait_until(lambda: svc.core.index.pairs_of("rep0") == truth(w), what="applied")
        repairs = repairs_total()
        sent = REPAIR_ALERTS.labels("firing", "sent")._value.get()

        async def lose_and_repair(n: int) -> WorkerDivergence:
            """The index loses pairs behind the indexer's back; a verify repairs them."""
            svc.core.index.apply_removed("rep0", list(truth(w))[:n])
            [r] = (await verify(bus, repair=True)).workers
            await wait_until(lambda: svc.core.index.pairs_of("rep0") == truth(w), what="repaired")
            return r

        first = await lose_and_repair(5)
        assert first.status == "divergent" and first.missing == 5 and first.repaired
        alert = await asyncio.wait_for(inbox.queue.get(), 10)
        assert (alert.state, alert.severity, alert.source) == ("firing", "warning", "indexer")
        assert alert.fingerprint == "index_repaired:rep0" and alert.worker_id == "rep0"
        assert alert.details["reason"] == "missing" and alert.details["missing"] == 5
        second = await lose_and_repair(3)  # the same incident: counted, not alerted again
        assert second.repaired and repairs_total() - repairs == 2
        # quiet for verify_alert_quiet_s and an equal check: the incident resolves, once
        t0 = time.monotonic()
        while inbox.queue.empty():
            [r] = (await verify(bus)).workers
            assert r.status == "equal" and time.monotonic() - t0 < 15
            await asyncio.sleep(0.1)  # the quiet period is time passing: nothing to await
        resolved = inbox.queue.get_nowait()
        assert resolved.state == "resolved" and resolved.fingerprint == "index_repaired:rep0"
        assert resolved.details["repairs"] == 2 and resolved.details["missing"] == 8
        assert REPAIR_ALERTS.labels("firing", "sent")._value.get() - sent == 1
        assert inbox.queue.empty()


def test_repair_incidents_alternate_firing_and_resolved() -> None:
    inc = RepairIncidents(quiet_s=60.0, indexer="ix")

    def div(missing: int, extra: int) -> WorkerDivergence:
        return WorkerDivergence(worker_id="w", status="divergent", missing=missing, extra=extra)

    fired = inc.repaired(div(2, 1), now=0.0)
    assert fired is not None and fired.state == "firing"
    assert fired.details["reason"] == "missing_and_extra" and fired.details["indexer"] == "ix"
    assert inc.repaired(div(0, 4), now=30.0) is None  # same incident
    assert inc.checked_equal("w", now=80.0) is None  # 50 s since the last repair
    done = inc.checked_equal("w", now=95.0)
    assert done is not None and done.state == "resolved"
    assert (done.details["repairs"], done.details["missing"], done.details["extra"]) == (2, 2, 5)
    assert inc.checked_equal("w", now=200.0) is None  # nothing open
    again = inc.repaired(div(1, 0), now=300.0)
    assert again is not None and again.state == "firing" and again.details["reason"] == "missing"
    gone = inc.worker_gone("w", now=301.0)
    assert gone is not None and gone.state == "resolved" and inc.open == {}
    with pytest.raises(ValueError):
        RepairIncidents(quiet_s=0.0)


def test_a_bad_alert_quiet_stops_the_indexer_naming_the_flag() -> None:
    import argparse

    from services.kv_indexer import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="--verify-alert-quiet"):
        cli.main(parser.parse_args(["--verify-alert-quiet", "0"]))
