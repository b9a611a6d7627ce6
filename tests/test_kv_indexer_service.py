"""The indexer service and router replicas over a real NATS (JetStream) server."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.kvdump import KvDumpServer
from services.common.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexDelta,
    IndexStored,
    KvDumpRequest,
    KvEventBatch,
    KvQuery,
    KvQueryReply,
    encode,
)
from services.common.service import start_http
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from tests.test_kv_support import (
    batch,
    caught_up,
    chain,
    hb,
    indexer,
    replica,
    stored,
    wait_until,
)


async def test_events_reach_index_and_replicas(bus: Bus, nats_url: str, subjects: Subjects) -> None:
    await require_kv_events_stream(bus)
    a, b = chain(8, 1), chain(5, 2)
    async with indexer(nats_url, subjects) as svc:
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await bus.publish(subjects.heartbeat("w2"), hb("w2"))
        await wait_until(lambda: len(svc.core.workers) == 2, what="registration")
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(a[:4])]))
        await bus.js_publish(subjects.kv_events("w2"), batch("w2", 0, [stored(b)]))
        await wait_until(lambda: len(svc.core.index) == 9, what="first events")
        # a replica that starts now bootstraps from a snapshot, then follows deltas
        async with replica(nats_url, subjects, max_chunk_bytes=2048) as rep:
            assert rep.ready.is_set() and rep.snapshots == 1
            assert rep.index.find_matches(a) == {"w1": 4}
            await bus.js_publish(subjects.kv_events("w1"), batch("w1", 1, [stored(a[4:], a[3])]))
            await bus.js_publish(
                subjects.kv_events("w2"),
                batch("w2", 1, [BlockRemoved(keys=b[3:]), stored(a[:2], tier="cpu")]),
            )
            await wait_until(lambda: svc.core.workers["w2"].last_seq == 1)
            await wait_until(lambda: caught_up(svc, rep))
            for q in (a, b):
                assert rep.index.find_matches(q) == svc.core.index.find_matches(q)
            assert rep.index.find_matches(a) == {"w1": 8, "w2": 2}
            assert rep.index.tier_of("w2", a[0]) == "cpu"
            assert svc.core.counts["bad:unknown_parent"] == 0
            # kv.query over request/reply, by token ids and by keys
            q = await bus.request(
                subjects.kv_query,
                KvQuery(token_ids=[1 * 7919 + i for i in range(16 * 8)]),
                KvQueryReply,
            )
            assert [(m.worker_id, m.matched_blocks, m.cpu_blocks) for m in q.matches] == [
                ("w1", 8, 0),
                ("w2", 2, 2),
            ]
            q2 = await bus.request(subjects.kv_query, KvQuery(keys=b), KvQueryReply)
            assert [(m.worker_id, m.matched_blocks) for m in q2.matches] == [("w2", 3)]
            # a big cache takes several snapshot chunks
            big = chain(600, 3)
            await bus.js_publish(subjects.kv_events("w1"), batch("w1", 2, [stored(big)]))
            await wait_until(lambda: svc.core.index.blocks_of("w1") == 608)
            async with replica(nats_url, subjects, max_chunk_bytes=4096) as rep2:
                assert rep2.ready.is_set()
                assert rep2.index.find_matches(big) == {"w1": 600}
                assert len(rep2.index) == len(svc.core.index)


async def test_gap_resyncs_from_worker_dump(bus: Bus, nats_url: str, subjects: Subjects) -> None:
    await require_kv_events_stream(bus)
    a = chain(12, 4)
    dumps: list[KvDumpRequest] = []

    async def dump(req: KvDumpRequest) -> KvEventBatch:
        dumps.append(req)  # the worker's real cache: a[:10], as of seq 2
        return batch("w1", 2, [AllBlocksCleared(), stored(a[:10])])

    await KvDumpServer(bus, "w1", dump).start()
    async with (
        indexer(nats_url, subjects, tail_grace_s=0.2) as svc,
        replica(nats_url, subjects) as rep,
    ):
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await wait_until(lambda: "w1" in svc.core.workers)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(a[:2])]))
        # seq 1 and 2 are lost; seq 3 arrives -> gap -> dump at seq 2 -> apply 3 on top
        await bus.js_publish(
            subjects.kv_events("w1"),
            batch("w1", 3, [stored(a[10:], a[9]), BlockRemoved(keys=a[11:])]),
        )
        await wait_until(lambda: svc.core.counts["resyncs"] == 1, what="resync")
        assert len(dumps) == 1 and dumps[0].worker_id == "w1"
        assert svc.core.index.find_matches(a) == {"w1": 11}
        assert svc.core.workers["w1"].last_seq == 3
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 1, [stored(a[:1])]))  # late dup
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 4, [BlockRemoved(keys=a[5:])]))
        await wait_until(lambda: svc.core.workers["w1"].last_seq == 4)
        assert svc.core.counts["duplicates"] == 1
        await wait_until(lambda: caught_up(svc, rep))
        assert rep.index.find_matches(a) == svc.core.index.find_matches(a) == {"w1": 5}
        # a tail gap: the heartbeat says seq 6 was published, nothing arrives -> resync
        await bus.publish(subjects.heartbeat("w1"), hb("w1", kv_seq=6))
        await wait_until(lambda: svc.core.counts["resyncs"] == 2, timeout=15, what="tail resync")
        assert svc.core.counts["resync:tail_gap"] == 1


async def test_worker_lifecycle_expiry_and_restart(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    a, b = chain(4, 5), chain(4, 6)
    async with (
        indexer(nats_url, subjects, heartbeat_timeout_s=0.5) as svc,
        replica(nats_url, subjects) as rep,
    ):
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await bus.publish(subjects.heartbeat("w2"), hb("w2"))
        await wait_until(lambda: len(svc.core.workers) == 2)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(a)]))
        await bus.js_publish(subjects.kv_events("w2"), batch("w2", 0, [stored(a)]))
        await wait_until(lambda: len(svc.core.index) == 8)
        # w1 restarts (new instance id in its heartbeat): its old blocks go
        await bus.publish(subjects.heartbeat("w1"), hb("w1", inst="i2"))
        await bus.publish(subjects.heartbeat("w2"), hb("w2"))
        await wait_until(lambda: svc.core.index.blocks_of("w1") == 0)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(b)], inst="i2"))
        # a late batch of the old instance must not come back
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 1, [stored(a)], inst="i1"))
        await wait_until(lambda: svc.core.counts["bad:stale_instance"] == 1)
        assert svc.core.index.find_matches(b) == {"w1": 4}
        assert svc.core.index.find_matches(a) == {"w2": 4}
        # AllBlocksCleared
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 1, [AllBlocksCleared()], "i2"))
        await wait_until(lambda: svc.core.index.blocks_of("w1") == 0)
        # heartbeats stop: w2 (and w1) are dropped with their blocks; the replica follows
        await wait_until(lambda: not svc.core.workers, timeout=5, what="expiry")
        assert len(svc.core.index) == 0
        await wait_until(lambda: caught_up(svc, rep))
        assert len(rep.index) == 0 and rep.index.find_matches(a) == {}


async def test_bad_input_is_counted_and_never_breaks_the_index(
    bus: Bus, nats_url: str, subjects: Subjects, unused_port: int
) -> None:
    await require_kv_events_stream(bus)
    a = chain(6, 7)
    async with indexer(nats_url, subjects) as svc:
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await wait_until(lambda: "w1" in svc.core.workers)
        js = bus.js
        good = batch("w1", 0, [stored(a[:3])])
        await js.publish(subjects.kv_events("w1"), b"\xc1\xff garbage")  # malformed msgpack
        raw = msgspec.msgpack.encode(
            {
                "v": 1,
                "worker_id": "w1",
                "instance_id": "i1",
                "seq": 0,
                "ts": 0.0,
                "events": [{"type": "stored", "keys": [-5, 3], "block_size": 16}],
            }
        )
        await js.publish(subjects.kv_events("w1"), raw)  # signed hash: wrong type
        bytes_hash = msgspec.msgpack.encode(
            {
                "v": 1,
                "worker_id": "w1",
                "instance_id": "i1",
                "seq": 0,
                "ts": 0.0,
                "events": [{"type": "stored", "keys": [b"\x00" * 32], "block_size": 16}],
            }
        )
        await js.publish(subjects.kv_events("w1"), bytes_hash)  # 32-byte hash: wrong type
        await bus.js_publish(subjects.kv_events("w9"), batch("w9", 0, [stored(a)]))  # unknown
        await bus.js_publish(subjects.kv_events("w1"), good)
        wrong_size = BlockStored(keys=a[3:], parent_key=a[2], block_size=32)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 1, [wrong_size]))
        orphan = stored(chain(2, 8), parent=12345)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 2, [orphan]))
        v2 = msgspec.msgpack.encode({**msgspec.to_builtins(batch("w1", 3, [])), "v": 2})
        await js.publish(subjects.kv_events("w1"), v2)
        await bus.publish_raw(subjects.heartbeat("w1"), b"not a heartbeat")
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 3, [stored(a[3:], a[2])]))
        await wait_until(lambda: svc.core.workers["w1"].last_seq == 3, what="good batches")
        await wait_until(lambda: svc.core.counts["bad:invalid_heartbeat"] == 1)
        c = svc.core.counts
        assert c["bad:malformed_msgpack"] == 1
        assert c["bad:wrong_hash_type"] == 2
        assert c["bad:unknown_worker"] == 1
        assert c["bad:block_size_mismatch"] == 1
        assert c["bad:unknown_parent"] == 1
        assert c["bad:unsupported_version"] == 1
        assert svc.core.index.find_matches(a) == {"w1": 6}
        assert "w9" not in svc.core.index.workers()
        # operators see it all over HTTP: metrics per reason, debug views
        runner = await start_http(svc.make_app(), "127.0.0.1", unused_port)
        try:
            async with aiohttp.ClientSession() as s:
                base = f"http://127.0.0.1:{unused_port}"
                async with s.get(f"{base}/metrics") as r:
                    text = await r.text()
                for reason in ("malformed_msgpack", "wrong_hash_type", "block_size_mismatch"):
                    assert f'kvgate_indexer_bad_input_total{{reason="{reason}"}}' in text
                assert 'kvgate_indexer_bad_input_total{reason="invalid_heartbeat"}' in text
                async with s.get(f"{base}/health") as r:
                    health = await r.json()
                assert health["status"] == "ok" and health["blocks"] == 8
                async with s.get(f"{base}/debug/workers") as r:
                    workers = (await r.json())["workers"]
                assert [(w["worker_id"], w["blocks"], w["last_seq"]) for w in workers] == [
                    ("w1", 8, 3)
                ]
                toks = ",".join(str(7 * 7919 + i) for i in range(16 * 6))
                async with s.get(f"{base}/debug/query", params={"tokens": toks}) as r:
                    body = await r.json()
                assert body["matches"][0]["worker_id"] == "w1"
                assert body["matches"][0]["matched_blocks"] == 6
                async with s.post(f"{base}/debug/query", json={"keys": a[:2]}) as r:
                    assert (await r.json())["matches"][0]["matched_blocks"] == 2
                async with s.get(f"{base}/debug/query", params={"tokens": "x"}) as r:
                    assert r.status == 400
        finally:
            await runner.cleanup()


async def test_replica_starts_without_indexer_and_catches_up(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    a = chain(3, 9)
    t0 = time.monotonic()
    async with replica(nats_url, subjects, retry_max_s=0.3) as rep:
        assert time.monotonic() - t0 < 1.0 and not rep.ready.is_set()  # 503: no responders
        async with indexer(nats_url, subjects) as svc:
            await asyncio.wait_for(rep.ready.wait(), 10)
            await bus.publish(subjects.heartbeat("w1"), hb("w1"))
            await wait_until(lambda: "w1" in svc.core.workers)
            await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(a)]))
            await wait_until(lambda: rep.index.find_matches(a) == {"w1": 3})
            epoch1 = rep.epoch
        # the indexer restarts: the durable consumer resumes, a new epoch re-snapshots the
        # replica, and the worker's blocks come back through a resync (the dump below)

        async def dump(req: KvDumpRequest) -> KvEventBatch:
            return batch("w1", 0, [AllBlocksCleared(), stored(a)])

        await KvDumpServer(bus, "w1", dump).start()
        async with indexer(nats_url, subjects, tail_grace_s=0.1) as svc2:
            await bus.publish(subjects.heartbeat("w1"), hb("w1", kv_seq=0))
            await wait_until(lambda: svc2.core.counts["resyncs"] == 1, what="restart resync")
            await wait_until(lambda: rep.epoch == svc2.epoch and rep.delta_seq == svc2.delta_seq)
            assert rep.epoch != epoch1
            assert rep.index.find_matches(a) == {"w1": 3}


async def test_replica_resnapshots_on_a_delta_gap(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    a = chain(10, 11)
    async with indexer(nats_url, subjects) as svc, replica(nats_url, subjects) as rep:
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await wait_until(lambda: "w1" in svc.core.workers)
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(a[:2])]))
        await wait_until(lambda: caught_up(svc, rep) and svc.delta_seq >= 0)
        assert rep.snapshots == 1
        # a delta that skips ahead (the ones in between were lost): the replica must not
        # apply it, but re-snapshot, and converge once the indexer moves past it
        ghost = IndexDelta(
            epoch=svc.epoch,
            seq=svc.delta_seq + 3,
            ts=0.0,
            ops=[IndexStored(worker_id="ghost", keys=a)],
        )
        await bus.publish_raw(subjects.kv_index_delta, encode(ghost))
        await wait_until(lambda: rep.snapshots >= 2, what="re-snapshot")
        for i in range(1, 6):
            await bus.js_publish(
                subjects.kv_events("w1"), batch("w1", i, [stored(a[i + 1 : i + 2], a[i])])
            )
        await wait_until(lambda: svc.core.workers["w1"].last_seq == 5)
        await wait_until(lambda: caught_up(svc, rep) and not rep._want.is_set())
        assert rep.index.find_matches(a) == svc.core.index.find_matches(a) == {"w1": 7}
        assert "ghost" not in rep.index.workers()
        assert rep.resyncs >= 1


async def test_replica_reads_a_snapshot_past_the_servers_pending_limit(tmp_path) -> None:
    """A snapshot many times the server's per-connection pending limit reaches a replica that
    does not read its socket while the indexer sends (a router starting on a busy host): the
    indexer sends one window of chunks and waits to be asked for the next. Sent all at once,
    the server dropped the replica as a slow consumer, and again at every retry."""
    import random

    from services.common.embedded import EmbeddedNats
    from services.common.index_replica import IndexReplica

    monitor = free_port()
    server = EmbeddedNats(tmp_path, authorization="max_pending: 1048576\n", monitor_port=monitor)
    server.start()
    subjects = Subjects(f"win{random.getrandbits(32):x}")
    try:
        async with indexer(server.url, subjects) as svc:
            rng = random.Random(1)
            for w in range(8):  # ~12 MB of snapshot: 750 k keys x (key + mask word)
                svc.core.index.apply_stored(f"w{w}", [rng.getrandbits(63) for _ in range(94_000)])
            rb = Bus(server.url, "router", subjects)
            await rb.connect(max_wait_s=10)
            try:
                rep = IndexReplica(
                    rb, start_timeout_s=0.05, max_chunk_bytes=256 * 1024, window_chunks=1
                )
                socket = rb.client._transport._io_writer.transport
                socket.pause_reading()
                await rep.start()  # the request goes out; nothing is read meanwhile
                await wait_until(lambda: svc._out.qsize() == 0 and rep.snapshots == 0)
                await svc._out.join()
                await svc.bus.client.flush()  # the server has handled every chunk sent
                async with aiohttp.ClientSession() as http:
                    varz = f"http://127.0.0.1:{monitor}/varz"
                    async with http.get(varz) as r:
                        assert (await r.json())["slow_consumers"] == 0
                    socket.resume_reading()
                    await asyncio.wait_for(rep.ready.wait(), 30)
                    async with http.get(varz) as r:
                        assert (await r.json())["slow_consumers"] == 0
                assert len(rep.index) == len(svc.core.index) == 8 * 94_000
                assert rep.snapshots == 1 and rep.status()["resyncs"] == 0
            finally:
                await rep.stop()
                await rb.close()
    finally:
        server.stop()


async def test_snapshot_windows_whole_requests_and_forgotten_ids(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """A request without ``max_chunks`` (a replica before windows) gets every chunk at once;
    a window of a snapshot the indexer no longer keeps is an error the replica starts over
    from; a replica with a window of one chunk still loads everything."""
    from services.common.schemas import SnapshotChunk, SnapshotRequest, decode

    await require_kv_events_stream(bus)
    async with indexer(nats_url, subjects) as svc:
        for w in range(4):
            svc.core.index.apply_stored(f"w{w}", chain(600, 10 + w))
        nc = bus.client
        inbox = nc.new_inbox()
        got: asyncio.Queue = asyncio.Queue()
        sub = await nc.subscribe(inbox, cb=got.put)
        whole = SnapshotRequest(replica_id="old", max_chunk_bytes=4096)
        await nc.publish(subjects.kv_index_snapshot, encode(whole), reply=inbox)
        first = decode(SnapshotChunk, (await asyncio.wait_for(got.get(), 10)).data)
        assert first.chunks > 3 and first.window_end == 0 and not first.error
        for _ in range(first.chunks - 1):
            ch = decode(SnapshotChunk, (await asyncio.wait_for(got.get(), 10)).data)
            assert ch.snapshot_id == first.snapshot_id and ch.window_end == 0
        assert not svc._snapshots  # nothing kept for a whole request
        gone = SnapshotRequest(snapshot_id=first.snapshot_id, first_chunk=2, max_chunks=2)
        await nc.publish(subjects.kv_index_snapshot, encode(gone), reply=inbox)
        err = decode(SnapshotChunk, (await asyncio.wait_for(got.get(), 10)).data)
        assert err.error and "no longer kept" in err.error
        await sub.unsubscribe()
        async with replica(nats_url, subjects, max_chunk_bytes=4096, window_chunks=1) as rep:
            assert rep.ready.is_set() and len(rep.index) == len(svc.core.index) == 2400
            assert len(svc._snapshots) == 1  # kept for the replica's windows


async def test_replica_loads_a_snapshot_in_steps_and_answers_meanwhile() -> None:
    """A large snapshot (pair form, past 64 workers) is loaded a slice of rows at a time into
    a fresh index, the event loop running between slices, while the replica's own index (the
    object the router holds) keeps its old content; then it takes the new content over."""
    from services.common.index_replica import IndexReplica
    from services.core.index import PrefixIndex

    source = PrefixIndex()
    for w in range(100):
        source.apply_stored(f"w{w}", chain(50, 1000 + w))
    state = source.export_state()
    assert state.pair_slots is not None
    rep = IndexReplica(Bus("nats://127.0.0.1:1", "unused"), load_step_rows=100)
    live = rep.index
    old = chain(4, 7)
    live.apply_stored("before", old)
    seen: list[int] = []

    async def router_meanwhile() -> None:
        while True:
            seen.append(len(rep.index))
            await asyncio.sleep(0)

    task = asyncio.create_task(router_meanwhile())
    await asyncio.sleep(0)
    await rep.load(state)
    task.cancel()
    assert len(seen) >= len(state.keys) // 100  # it ran between the slices
    assert set(seen[:-1]) == {4}  # ... and saw the old content until the end
    assert rep.index is live and len(live) == len(source) == 5000
    assert live.find_matches(chain(50, 1042)) == {"w42": 50} and not live.find_matches(old)


def test_indexer_cli_help() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "indexer", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "--max-blocks" in out.stdout and "--port" in out.stdout
    assert free_port() > 0
    assert encode(hb("x"))
