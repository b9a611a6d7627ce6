"""Highly available indexer: two real indexer processes in one namespace, one lease.

The test plays one worker (heartbeats + KV event batches on JetStream, the truth it knows)
and one router (an in-process IndexReplica, the router's copy of the index). It SIGKILLs the
active indexer under light event load and checks: exactly one indexer is active at a time, the
standby publishes deltas (a new epoch) within 3 s, and the router's index equals the worker's
truth within 5 s of the kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.index_replica import IndexReplica
from services.common.schemas import (
    BlockRemoved,
    BlockStored,
    IndexDelta,
    KvEventBatch,
    WorkerCapacity,
    WorkerHeartbeat,
    decode,
)
from services.common.streams import require_kv_events_stream

pytestmark = pytest.mark.slow

WORKER = "w0"
CAP = WorkerCapacity(block_size=16, num_gpu_blocks=4096, max_num_seqs=8, max_model_len=8192)


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:  # noqa: S310
            return json.loads(r.read())
    except OSError:
        return None


def _start_indexer(
    ha_id: str, port: int, nats_url: str, prefix: str, log: Path
) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        {
            "KVGATE_NATS_URL": nats_url,
            "KVGATE_SUBJECT_PREFIX": prefix,
            "KVGATE_INDEXER_HA_ID": ha_id,
            "KVGATE_INDEXER_PORT": str(port),
            "KVGATE_INDEXER_HEARTBEAT_TIMEOUT": "10",
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "indexer"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


async def _wait(cond, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        await asyncio.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_standby_takes_over_when_the_active_indexer_is_killed(
    bus: Bus, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    await require_kv_events_stream(bus)
    ports = {"a": free_port(), "b": free_port()}
    procs = {
        i: _start_indexer(i, ports[i], nats_url, subject_prefix, tmp_path / f"indexer-{i}.log")
        for i in ports
    }
    hb_task = replica = sub = None
    try:

        def one_active() -> dict | None:
            hs = {i: _health(p) for i, p in ports.items()}
            if all(hs.values()) and sum(h["active"] for h in hs.values()) == 1:
                return hs
            return None

        healths = await _wait(one_active, 60, "both indexers up, exactly one active")
        active = next(i for i, h in healths.items() if h["active"])
        standby = next(i for i in ports if i != active)

        truth: set[int] = set()
        seq = -1

        async def heartbeats() -> None:
            while True:
                await bus.publish(
                    bus.subjects.heartbeat(WORKER),
                    WorkerHeartbeat(
                        worker_id=WORKER,
                        instance_id="i1",
                        url="http://127.0.0.1:1",
                        model="m",
                        capacity=CAP,
                        kv_seq=seq,
                    ),
                )
                await asyncio.sleep(0.3)

        hb_task = asyncio.create_task(heartbeats())
        await _wait(
            lambda: all((_health(p) or {}).get("workers") == 1 for p in ports.values()),
            20,
            "both indexers registered the worker",
        )
        replica = IndexReplica(bus)
        await replica.start()
        await asyncio.wait_for(replica.ready.wait(), 20)

        new_epoch_at: list[float] = []
        old_epoch = replica.epoch

        async def on_delta(msg) -> None:
            d = decode(IndexDelta, msg.data)
            if d.epoch != old_epoch and not new_epoch_at:
                new_epoch_at.append(time.monotonic())

        sub = await bus.client.subscribe(bus.subjects.kv_index_delta, cb=on_delta)

        async def send(stored: list[int], removed: list[int]) -> None:
            nonlocal seq
            events: list = []
            if stored:
                events.append(BlockStored(keys=stored, block_size=16))
            if removed:
                events.append(BlockRemoved(keys=removed))
            seq += 1
            batch = KvEventBatch(worker_id=WORKER, instance_id="i1", seq=seq, ts=0.0, events=events)
            await bus.js_publish(bus.subjects.kv_events(WORKER), batch)
            truth.update(stored)
            truth.difference_update(removed)

        key = 1000

        async def light_load(seconds: float) -> None:
            nonlocal key
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                stored = list(range(key, key + 4))
                key += 4
                removed = sorted(truth)[:2] if len(truth) > 40 else []
                await send(stored, removed)
                await asyncio.sleep(0.05)

        await light_load(2.0)
        await _wait(lambda: len(replica.index) == len(truth), 10, "replica caught up before kill")

        procs[active].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        await light_load(1.0)  # events keep coming while the active one is dead

        await _wait(lambda: new_epoch_at, 10, "deltas of a new epoch")
        takeover_s = new_epoch_at[0] - killed_at
        assert (_health(ports[standby]) or {}).get("active") is True

        def equal_to_truth() -> bool:
            idx = replica.index
            return (
                replica.ready.is_set()
                and idx.blocks_of(WORKER) == len(truth)
                and all(idx.holds(WORKER, k) for k in truth)
            )

        await _wait(equal_to_truth, 15, "router index equal to the worker's truth")
        converged_s = time.monotonic() - killed_at
        print(
            f"\nstandby published {takeover_s:.2f}s after the kill; router index equal to truth {converged_s:.2f}s after it"
        )
        assert takeover_s <= 3.0, takeover_s
        assert converged_s <= 5.0, converged_s
    finally:
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if replica is not None:
            await replica.stop()
        if hb_task is not None:
            hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hb_task
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        with contextlib.suppress(Exception):
            await bus.js.delete_key_value(bus.subjects.stream("KV_INDEXER_LEASE"))


async def test_lease_is_held_by_one_candidate_and_handed_over_on_release(bus: Bus) -> None:
    from services.kv_indexer.lease import IndexerLease

    events: list[str] = []
    leases = [
        IndexerLease(
            bus,
            name,
            on_acquired=lambda n=name: events.append(f"+{n}"),
            on_lost=lambda n=name: events.append(f"-{n}"),
            ttl_s=1.0,
        )
        for name in ("x", "y")
    ]
    try:
        for lease in leases:
            await lease.start()
        await _wait(lambda: any(lease.held for lease in leases), 10, "a holder")
        await asyncio.sleep(1.5)  # longer than the ttl: renewals keep it, nobody else gets it
        assert [lease.held for lease in leases].count(True) == 1
        holder = next(lease for lease in leases if lease.held)
        other = next(lease for lease in leases if not lease.held)
        assert events == [f"+{holder.holder_id}"]
        released_at = time.monotonic()
        await holder.stop()  # a clean stop deletes the key: the other takes over at its next poll
        await _wait(lambda: other.held, 5, "the other candidate to take over")
        assert time.monotonic() - released_at < 1.0
        assert events == [f"+{holder.holder_id}", f"-{holder.holder_id}", f"+{other.holder_id}"]
    finally:
        for lease in leases:
            await lease.stop()
        with contextlib.suppress(Exception):
            await bus.js.delete_key_value(bus.subjects.stream("KV_INDEXER_LEASE"))


async def test_a_cold_candidate_does_not_take_a_free_lease(bus: Bus) -> None:
    """A member whose index is not warm yet (just restarted) must not win an expired lease
    over a warm standby: it competes only once warm() says so."""
    from services.kv_indexer.lease import IndexerLease

    warm = False
    acquired: list[float] = []
    lease = IndexerLease(
        bus,
        "cold",
        on_acquired=lambda: acquired.append(time.monotonic()),
        on_lost=lambda: None,
        ttl_s=1.0,
        warm=lambda: warm,
    )
    try:
        await lease.start()
        # the lease is free: a warm candidate would take it at its first poll (0.2 s)
        await _wait(lambda: lease.attempted_at > 0, 10, "the lease loop's first round")
        round_at = lease.attempted_at
        await _wait(lambda: lease.attempted_at > round_at + 0.5, 10, "more rounds")
        assert not lease.held and acquired == []
        warm = True
        warm_at = time.monotonic()
        await _wait(lambda: lease.held, 5, "the lease once warm")
        assert acquired[0] - warm_at < 1.0
    finally:
        await lease.stop()
        with contextlib.suppress(Exception):
            await bus.js.delete_key_value(bus.subjects.stream("KV_INDEXER_LEASE"))
