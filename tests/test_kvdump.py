"""Chunked KV dumps (services.common.kvdump) over a real NATS server, from a real sim worker."""

from __future__ import annotations

import time

import pytest

from services.common.bus import Bus, RemoteError
from services.common.kvdump import DumpError, KvDumpServer, fetch_kvdump, split_events
from services.common.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDumpChunk,
    KvDumpRequest,
    KvEventBatch,
    decode,
    encode,
)
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.divergence import apply_events
from services.worker_sim.cachefill import fill_cache
from tests.test_kv_support import indexer, wait_until
from tests.test_worker_sim_support import sim_worker


def _batch(worker: str, seq: int, events: list) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, instance_id="i1", seq=seq, ts=time.time(), events=events)


def test_split_events_keeps_chain_order_and_parents() -> None:
    ev = BlockStored(keys=list(range(10, 20)), parent_key=7, block_size=16, tier="cpu")
    parts = split_events([AllBlocksCleared(), ev, BlockRemoved(keys=[1, 2, 3])], 4)
    stored = [p for p in parts if isinstance(p, BlockStored)]
    assert [p.keys for p in stored] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert [p.parent_key for p in stored] == [7, 13, 17]
    assert {p.tier for p in stored} == {"cpu"} and isinstance(parts[0], AllBlocksCleared)
    assert apply_events({}, parts) == apply_events({}, [ev, BlockRemoved(keys=[1, 2, 3])])


async def test_sim_worker_dump_larger_than_max_payload_arrives_whole(bus: Bus) -> None:
    """27,000 one-block chains: the worst-case dump (one event per block) is ~2 MB, over the
    server's 1 MB max_payload, so the single-reply dump of before could never arrive."""
    await require_kv_events_stream(bus)
    async with sim_worker(bus, worker_id="big0", engine={"num_gpu_blocks": 27_000}) as w:
        fill_cache(w, 27_000, chain_blocks=1, chains_per_batch=1024)
        truth = w.engine.dump_cache()
        single = encode(_batch("big0", w.kv_seq, [AllBlocksCleared(), *truth]))
        assert len(single) > bus.client.max_payload  # what one reply would have had to carry
        fetched = await fetch_kvdump(bus, "big0", reason="test")
        assert fetched.blocks == 27_000 and fetched.chunks >= 2
        assert fetched.batch.seq == w.kv_seq and fetched.batch.instance_id == w.instance_id
        assert apply_events({}, fetched.batch.events) == apply_events({}, truth)
        assert fetched.bytes <= fetched.chunks * bus.client.max_payload
        assert w._dump_sub is not None and w._dump_sub.dumps_started == 1


async def test_chunks_fit_the_limit_and_the_dump_is_frozen_at_its_seq(bus: Bus) -> None:
    state: list = [AllBlocksCleared(), BlockStored(keys=list(range(1, 5001)), block_size=16)]
    seq = 3

    async def source(req: KvDumpRequest) -> KvEventBatch:
        return _batch("fz", seq, list(state))

    server = KvDumpServer(bus, "fz", source)
    await server.start()
    try:
        limit = 8192
        first = await bus.request(
            bus.subjects.kv_dump("fz"),
            KvDumpRequest(worker_id="fz", max_chunk_bytes=limit),
            KvDumpChunk,
        )
        assert first.kv_seq == 3 and first.blocks == 5000 and first.next_cursor is not None
        # the worker moves on after the first chunk: the rest of this dump does not change
        state.append(BlockStored(keys=[999_999], block_size=16))
        seq = 4
        events, chunk, sizes = list(first.events), first, []
        while chunk.next_cursor is not None:
            raw = await bus.request_bytes(
                bus.subjects.kv_dump("fz"),
                KvDumpRequest(
                    worker_id="fz",
                    dump_id=first.dump_id,
                    cursor=chunk.next_cursor,
                    max_chunk_bytes=limit,
                ),
            )
            sizes.append(len(raw))
            chunk = decode(KvDumpChunk, raw)
            assert chunk.dump_id == first.dump_id and chunk.kv_seq == 3
            events.extend(chunk.events)
        assert max(sizes) <= limit - 4096 and len(sizes) >= 5
        assert apply_events({}, events) == {k: 1 for k in range(1, 5001)}
        # the finished dump is forgotten: asking for it again is an explicit error
        with pytest.raises(RemoteError, match="unknown or expired dump id"):
            await bus.request(
                bus.subjects.kv_dump("fz"),
                KvDumpRequest(worker_id="fz", dump_id=first.dump_id, cursor=1),
                KvDumpChunk,
            )
        # a fresh dump sees the new state and seq
        again = await fetch_kvdump(bus, "fz", max_chunk_bytes=limit)
        assert again.batch.seq == 4 and again.blocks == 5001
    finally:
        await server.stop()


async def test_a_dump_that_does_not_add_up_is_refused(bus: Bus) -> None:
    """A responder whose chunks lose blocks (here: a forged count) fails loudly."""

    async def source(req: KvDumpRequest) -> KvEventBatch:
        return _batch("bad0", 0, [BlockStored(keys=[1, 2, 3], block_size=16)])

    server = KvDumpServer(bus, "bad0", source)
    await server.start()
    try:
        real = server._chunk

        def forged(fd, cursor):  # type: ignore[no-untyped-def]
            fd.blocks = 4
            return real(fd, cursor)

        server._chunk = forged  # type: ignore[method-assign]
        with pytest.raises(DumpError, match="announced 4 blocks, got 3"):
            await fetch_kvdump(bus, "bad0")
    finally:
        await server.stop()


@pytest.mark.slow
async def test_bridge_with_1m_blocks_resyncs_into_the_indexer(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """A bridge holding 1,000,000 blocks answers the indexer's resync with a chunked dump."""
    rt = BridgeRuntime(bus, "br0", engine="vllm", model="m", block_size=16, heartbeat_s=0.2)
    await rt.start()
    rt.mark_ready()  # no engine history to replay here
    try:
        async with indexer(nats_url, subjects, tail_grace_s=0.2) as svc:
            await wait_until(lambda: svc.core.workers.get("br0") is not None, what="heartbeat")
            await wait_until(lambda: svc.core.workers["br0"].last_seq == 0, what="seq 0")
            before = svc.core.counts["resyncs"]
            for c in range(1000):  # 1,000 chains of 1,000 blocks through the real re-keying
                tokens = list(range(c * 16_000, (c + 1) * 16_000))
                hashes = [(c << 20) | i for i in range(1000)]
                assert rt.rekeyer.stored(hashes, None, tokens, 16) is not None
            # the batch carrying them was lost on the way: its seq is consumed, as a failed
            # publish does; the heartbeat shows the tail gap and the indexer asks for a dump
            rt.out_seq += 1
            await wait_until(
                lambda: svc.core.counts["resyncs"] > before, timeout=60, what="1M-block resync"
            )
            want = apply_events({}, rt.rekeyer.dump())
            assert len(want) == 1_000_000
            assert svc.core.index.pairs_of("br0") == want
            assert rt._sub is not None and rt._sub.chunks_sent > 1
    finally:
        await rt.stop()
