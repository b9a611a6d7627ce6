"""Helpers (no tests) for the KV indexer / bridge tests: in-process indexer and replicas."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from services.common.bus import Bus
from services.common.index_replica import IndexReplica
from services.common.schemas import (
    BlockStored,
    KvEventBatch,
    WorkerCapacity,
    WorkerHeartbeat,
)
from services.common.subjects import Subjects
from services.core.keys import block_keys
from services.kv_indexer.app import IndexerService


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``cond`` (state held by another component, no event to await) with a deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.01)


def caught_up(svc, rep) -> bool:
    """The replica has every delta of the indexer's applied state: the indexer's journal is
    flushed into deltas (a batch is applied at once, its deltas go out at the burst's end or
    the next tick) and the replica has applied the last one. Comparing on delta seqs alone
    races that flush: both seqs are equal while the last batch's ops are still journaled."""
    return not svc.core.ops and rep.delta_seq == svc.delta_seq


def hb(worker: str, inst: str = "i1", kv_seq: int = -1, block_size: int = 16) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        instance_id=inst,
        url="http://127.0.0.1:1",
        model="m",
        capacity=WorkerCapacity(
            block_size=block_size, num_gpu_blocks=1000, max_num_seqs=8, max_model_len=4096
        ),
        kv_seq=kv_seq,
    )


def batch(worker: str, seq: int, events: list, inst: str = "i1") -> KvEventBatch:
    return KvEventBatch(worker_id=worker, instance_id=inst, seq=seq, ts=time.time(), events=events)


def stored(keys: list[int], parent: int | None = None, tier: str = "gpu") -> BlockStored:
    return BlockStored(keys=keys, parent_key=parent, block_size=16, tier=tier)


def chain(n_blocks: int, salt: int = 0) -> list[int]:
    return block_keys([salt * 7919 + i for i in range(16 * n_blocks)], 16)


@contextlib.asynccontextmanager
async def connected(nats_url: str, subjects: Subjects, name: str) -> AsyncIterator[Bus]:
    b = Bus(nats_url, name, subjects)
    await b.connect(max_wait_s=10)
    try:
        yield b
    finally:
        await b.close()


@contextlib.asynccontextmanager
async def indexer(nats_url: str, subjects: Subjects, **kw) -> AsyncIterator[IndexerService]:
    async with connected(nats_url, subjects, "indexer") as b:
        kw.setdefault("tick_s", 0.02)
        # tests send one heartbeat and then none: on a loaded machine a test can outlive the
        # 3 s default and see its worker expire; the expiry tests set their own timeout
        kw.setdefault("heartbeat_timeout_s", 60.0)
        # the background verifier asks for dumps on its own: tests that count dumps and
        # resyncs turn it on themselves
        kw.setdefault("verify_cpu_share", 0.0)
        svc = IndexerService(b, **kw)
        await svc.start()
        await asyncio.wait_for(svc.consuming.wait(), 10)
        try:
            yield svc
        finally:
            await svc.stop()


@contextlib.asynccontextmanager
async def replica(nats_url: str, subjects: Subjects, **kw) -> AsyncIterator[IndexReplica]:
    async with connected(nats_url, subjects, "router") as b:
        r = IndexReplica(b, **kw)
        await r.start()
        try:
            yield r
        finally:
            await r.stop()
