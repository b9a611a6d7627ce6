"""Engine identity, start-up and watchability of the vLLM / SGLang bridge, over real ZMQ
sockets, a real NATS and the real indexer: engine restarts whose first batches nobody
received, an idle engine when the bridge starts, a short replay buffer, an engine whose PUB
connects out (--bind), the block size read from the engine, bad input, /health + /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import structlog

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.logging import RateLimiter
from services.common.service import start_http
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.core.keys import block_keys
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.bridges.zmq_bridge import ZmqBridge
from tests.test_bridge_zmq import TinyEngine
from tests.test_kv_support import connected, indexer, wait_until
from tests.tools.engine_http import HttpEngine

TOKENS = list(range(7000, 7000 + 16 * 64))
KEYS = block_keys(TOKENS, 16)


@contextlib.asynccontextmanager
async def bridge(
    nats_url: str,
    subjects: Subjects,
    endpoint: str,
    replay: str | None,
    *,
    worker: str = "pod-a",
    bind: bool = False,
    engine: str = "vllm",
    **kw,
) -> AsyncIterator[ZmqBridge]:
    async with connected(nats_url, subjects, "bridge") as b:
        rt = BridgeRuntime(b, worker, engine=engine, model="m", heartbeat_s=0.1, **kw)
        await rt.start()
        zb = ZmqBridge(rt, endpoint, replay, topic="kv@", bind=bind, tail_check_s=0.5)
        stop = asyncio.Event()
        task = asyncio.create_task(zb.run(stop))
        await zb.subscribed.wait()
        try:
            yield zb
        finally:
            stop.set()
            await task
            await rt.stop()


def chain_events(eng: TinyEngine, first: int, n: int, base: int = 0) -> list[list[object]]:
    """``n`` batches, one block each, continuing the chain from block ``first`` (hash ids
    offset by ``base`` so two engine processes' hashes differ)."""
    out = []
    for i in range(first, first + n):
        parent = base + i - 1 if i else None
        out.append([eng.stored([base + i], parent, TOKENS[16 * i : 16 * i + 16])])
    return out


def held(svc, worker: str = "pod-a") -> set[int]:
    idx = svc.core.index
    return {k for k in idx.keys() if idx.holds(worker, k)}


async def test_idle_engine_history_is_replayed_before_the_bridge_is_ready(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """The engine published before the bridge started and is idle now: the bridge replays
    from seq 0 and only then says ready (no new batch needed)."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    try:
        for evs in chain_events(eng, 0, 5):
            await eng.publish(evs)  # nobody listens yet
        pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, block_size=16) as zb,
        ):
            await wait_until(lambda: held(svc) == set(KEYS[:5]), what="history indexed")
            assert zb.rt.ready and zb.rt.heartbeat().state == "ready"
            await wait_until(lambda: svc.core.workers["pod-a"].state == "ready", what="ready hb")
            assert zb.rt.resets == {} and zb.rt.rekeyer.counts == {}
    finally:
        await eng.close()


async def test_engine_restart_with_lost_first_batches_is_a_new_instance(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """vLLM/SGLang restart, seq starts again at 0 and the bridge first sees seq 5 or 2:
    the old process's blocks leave the index, the new process's are all indexed."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
    try:
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, block_size=16) as zb,
        ):
            await wait_until(lambda: zb.rt.ready, what="ready")
            for evs in chain_events(eng, 0, 3):
                await eng.publish(evs)
            await wait_until(lambda: held(svc) == set(KEYS[:3]), what="first process indexed")
            # restart 1: the new process's seq passes ours (0..4 lost, 5 live)
            eng.restart()
            other = block_keys(TOKENS[16 * 20 :], 16)
            evs = [
                [
                    eng.stored(
                        [1000 + i],
                        1000 + i - 1 if i else None,
                        TOKENS[16 * (20 + i) : 16 * (21 + i)],
                    )
                ]
                for i in range(6)
            ]
            for e in evs[:5]:
                await eng.publish(e, send=False)
            await eng.publish(evs[5])
            await wait_until(lambda: held(svc) == set(other[:6]), what="second process indexed")
            assert zb.rt.resets.get("replay_mismatch") == 1
            # restart 2: the new process's seq is below ours (0..1 lost, 2 live)
            eng.restart()
            for e in chain_events(eng, 0, 2, base=5000):
                await eng.publish(e, send=False)
            await eng.publish(chain_events(eng, 2, 1, base=5000)[0])
            await wait_until(lambda: held(svc) == set(KEYS[:3]), what="third process indexed")
            assert zb.rt.resets.get("seq_backwards") == 1
            assert zb.rt.rekeyer.counts.get("unknown_parent", 0) == 0
    finally:
        await eng.close()


async def test_restart_whose_seq_lands_exactly_on_ours_is_caught_by_the_idle_check(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """The new process's first received seq is exactly the next one expected: it looks like
    a continuation; the idle replay check compares the batches before it and tells."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
    try:
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, block_size=16) as zb,
        ):
            await wait_until(lambda: zb.rt.ready, what="ready")
            for evs in chain_events(eng, 0, 3):
                await eng.publish(evs)
            await wait_until(lambda: held(svc) == set(KEYS[:3]), what="first process")
            eng.restart()
            for i in range(4):  # 0..2 lost, 3 received: seq 3 is the one expected
                ev = eng.stored([900 + i], 900 + i - 1 if i else None, TOKENS[16 * (30 + i) :][:16])
                await eng.publish([ev], send=i == 3)
            want = set(block_keys(TOKENS[16 * 30 : 16 * 34], 16))
            await wait_until(lambda: held(svc) == want, what="new process indexed")
            assert zb.rt.resets.get("replay_mismatch") == 1
    finally:
        await eng.close()


async def test_short_replay_buffer_counts_lost_history(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """A bridge with no prior seq whose replay starts past 0 counts the lost history and
    indexes only what can be keyed (never a guess)."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    try:
        for evs in chain_events(eng, 0, 4):
            await eng.publish(evs)
        await eng.publish([eng.stored([900], None, TOKENS[16 * 40 : 16 * 41])])  # a new root
        del eng.buffer[:3]  # the buffer only holds seqs 3 and 4 now
        pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, block_size=16) as zb,
        ):
            root = block_keys(TOKENS[16 * 40 : 16 * 41], 16)
            await wait_until(lambda: held(svc) == set(root), what="keyable blocks indexed")
            assert zb.rt.resets == {"lost_history": 1}
            assert zb.rt.rekeyer.counts["seq_gap_unrecovered"] == 1
            assert zb.rt.rekeyer.counts["unknown_parent"] == 1  # seq 3's parent was in 2
    finally:
        await eng.close()


async def test_bind_mode_reaches_an_engine_that_connects_out(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    async with (
        indexer(nats_url, subjects) as svc,
        bridge(nats_url, subjects, endpoint, None, bind=True, block_size=16) as zb,
    ):
        eng = TinyEngine(connect_to=endpoint)
        try:
            i = 0
            deadline = time.monotonic() + 10
            while zb.batches == 0:  # the connecting PUB joins asynchronously
                assert time.monotonic() < deadline, "bridge never received a batch"
                await eng.publish([eng.stored([i], None, TOKENS[16 * i : 16 * i + 16])])
                i += 1
                await asyncio.sleep(0.02)  # pacing the publisher, not synchronisation
            await eng.publish(chain_events(eng, i, 1)[0])  # continues root block i - 1
            want = block_keys(TOKENS[16 * (i - 1) : 16 * (i + 1)], 16)
            await wait_until(lambda: set(want) <= held(svc), what="bound bridge indexes")
            assert zb.bound_endpoint == endpoint
        finally:
            await eng.close()


async def test_block_size_is_read_from_the_engine_before_the_first_event(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """SGLang with page_size 1: the first batch (40 one-token blocks) is indexed whole."""
    await require_kv_events_stream(bus)
    eng = TinyEngine(block_size=1)
    try:
        toks = TOKENS[:40]
        await eng.publish([eng.stored(list(range(40)), None, toks)])
        pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
        async with (
            HttpEngine(page_size=1) as http,
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, engine="sglang", engine_url=http.url) as zb,
        ):
            await wait_until(lambda: len(held(svc)) == 40, what="40 of 40 blocks")
            assert held(svc) == set(block_keys(toks, 1))
            assert svc.core.workers["pod-a"].block_size == 1
            assert zb.rt.capacity().num_gpu_blocks == 4000
        # an engine that does not tell its block size: the bridge waits, and says so
        async with HttpEngine() as http, connected(nats_url, subjects, "b2") as b:
            rt = BridgeRuntime(b, "pod-b", engine="vllm", model="m", engine_url=http.url)
            rt._session = aiohttp.ClientSession()
            try:
                assert await rt.probe_engine() is True
                assert not rt.block_size_known.is_set() and not rt.ready
                http.block_size = 32
                await rt.probe_engine()
                assert rt.block_size_known.is_set() and rt.capacity().block_size == 32
            finally:
                await rt._session.close()
    finally:
        await eng.close()


async def test_engine_start_time_change_resyncs_an_idle_bridge(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """The engine restarted and its new batches were all lost (then it went idle): the
    changed start time makes the bridge drop the old blocks and replay from 0."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
    try:
        async with (
            HttpEngine(block_size=16) as http,
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, engine_url=http.url) as zb,
        ):
            for evs in chain_events(eng, 0, 4):
                await eng.publish(evs)
            await wait_until(lambda: held(svc) == set(KEYS[:4]), what="first process")
            eng.restart()
            http.start_time = (http.start_time or 0) + 60
            await eng.publish([eng.stored([800], None, TOKENS[16 * 30 : 16 * 31])], send=False)
            await wait_until(
                lambda: held(svc) == set(block_keys(TOKENS[16 * 30 : 16 * 31], 16)),
                what="new process indexed",
            )
            assert zb.rt.resets.get("engine_restarted") == 1
    finally:
        await eng.close()


async def test_engine_back_from_failed_health_without_start_time_resyncs(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """An engine that exports no start time went down (/health failed) and came back: it
    may be a new process whose batches were lost, so the bridge resyncs from 0."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
    try:
        async with (
            HttpEngine(block_size=16) as http,
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, engine_url=http.url) as zb,
        ):
            http.start_time = None
            for evs in chain_events(eng, 0, 3):
                await eng.publish(evs)
            await wait_until(lambda: held(svc) == set(KEYS[:3]), what="first process")
            http.healthy = False
            await wait_until(lambda: not zb.rt.engine_ok, what="bridge sees the engine down")
            eng.restart()
            await eng.publish([eng.stored([800], None, TOKENS[16 * 30 : 16 * 31])], send=False)
            http.healthy = True
            want = set(block_keys(TOKENS[16 * 30 : 16 * 31], 16))
            await wait_until(lambda: held(svc) == want, what="new process indexed")
            assert zb.rt.resets.get("engine_restarted") == 1
    finally:
        await eng.close()


async def test_bad_input_is_counted_and_the_index_stays_right(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    pub, rep = f"tcp://127.0.0.1:{eng.pub_port}", f"tcp://127.0.0.1:{eng.replay_port}"
    port = free_port()
    try:
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(nats_url, subjects, pub, rep, block_size=16) as zb,
        ):
            runner = await start_http(zb.rt.make_app(), "127.0.0.1", port)
            try:
                await wait_until(lambda: zb.rt.ready, what="ready")
                await eng.pub.send_multipart([b"kv@garbage"])  # wrong framing
                await eng.pub.send_multipart([eng.topic, b"abc", b"x"])  # 3-byte seq
                await eng.publish_raw(b"\xc1\xc1\xc1")  # not msgpack
                await eng.publish_raw(msgpack.packb({"hello": 1}))  # not a batch
                bad_size = eng.stored([50], None, TOKENS[:24])
                bad_size["block_size"] = 24
                bad_hash = eng.stored([51], None, TOKENS[:16])
                bad_hash["block_hashes"] = ["not-a-hash"]
                good = chain_events(eng, 0, 2)
                await eng.publish([bad_size, good[0][0], bad_hash, {"type": "Future"}])
                await eng.publish(good[1])
                await wait_until(lambda: held(svc) == set(KEYS[:2]), what="good blocks")
                c = zb.rt.rekeyer.counts
                assert c["invalid_frame"] == 2 and c["malformed_msgpack"] == 1
                assert c["invalid_schema"] == 1 and c["block_size_mismatch"] == 1
                assert c["wrong_hash_type"] == 1 and c["unknown_event_type"] == 1
                assert svc.core.counts["bad:block_size_mismatch"] == 0
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        body = await r.json()
                        assert r.status == 200 and body["ready"] and body["blocks"] == 2
                    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                        text = await r.text()
                assert 'kvgate_bridge_bad_input_total{reason="unknown_event_type"}' in text
                assert "kvgate_bridge_instance_resets_total" in text
            finally:
                await runner.cleanup()
    finally:
        await eng.close()


def test_rate_limited_bad_input_logs_say_how_many_were_suppressed() -> None:
    now = [0.0]
    rt = BridgeRuntime.__new__(BridgeRuntime)
    rt.worker_id = "w"
    rt._log = RateLimiter(60.0, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for _ in range(19):
            rt._on_bad("invalid_frame", "x")
        rt._on_bad("malformed_msgpack", "y")  # another reason gets its own line
        now[0] = 61.0
        rt._on_bad("invalid_frame", "x")
    lines = [(e["reason"], e["suppressed"]) for e in logs if e["event"] == "bad engine KV input"]
    assert lines == [("invalid_frame", 0), ("malformed_msgpack", 0), ("invalid_frame", 18)]


async def test_kvgate_bridge_serves_health_and_metrics_on_its_port(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """`kvgate bridge vllm --port P`: a real process; /health says 503 while it waits for its
    engine's history, 200 once replayed; /metrics has the kvgate_bridge_* counters."""
    import os
    import subprocess
    import sys

    await require_kv_events_stream(bus)
    eng = TinyEngine()
    port = free_port()
    env = {**os.environ, "KVGATE_NATS_URL": nats_url, "KVGATE_SUBJECT_PREFIX": subjects.prefix}
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "bridge",
        "vllm",
        "--worker-id",
        "pod-p",
        "--endpoint",
        f"tcp://127.0.0.1:{eng.pub_port}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{eng.replay_port}",
        "--block-size",
        "16",
        "--port",
        str(port),
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for evs in chain_events(eng, 0, 3):
            await eng.publish(evs)
        async with aiohttp.ClientSession() as s:
            body: dict = {}

            async def health() -> int:
                nonlocal body
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        body = await r.json()
                        return r.status
                except aiohttp.ClientError:
                    return 0

            deadline = time.monotonic() + 20
            while await health() != 200:
                assert proc.returncode is None, "kvgate bridge exited"
                assert time.monotonic() < deadline, "bridge never became healthy"
                await asyncio.sleep(0.05)
            assert body["ready"] and body["blocks"] == 3 and body["block_size"] == 16
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert "kvgate_bridge_batches_total" in text
            assert "kvgate_bridge_instance_resets_total" in text
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        await eng.close()


def test_kvgate_up_runs_a_bridge_on_its_port(tmp_path) -> None:
    import argparse

    from services import up
    from services.common import settings as S

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(
        ["--bridge", "sglang", "--bridge-port", "8199", "--state-dir", str(tmp_path)]
    )
    stack = up.Stack(S.resolve(args, up.OPTIONS))
    kids = {c.name: c for c in stack.plan()}
    assert kids["bridge"].argv[-4:] == ["bridge", "sglang", "--port", "8199"]
    assert kids["bridge"].health_url == "http://127.0.0.1:8199/health"
    args = parser.parse_args(["--state-dir", str(tmp_path)])
    assert "bridge" not in {c.name for c in up.Stack(S.resolve(args, up.OPTIONS)).plan()}


def test_indexer_bad_input_logs_are_per_reason_with_suppressed_counts() -> None:
    from services.kv_indexer.app import IndexerService

    now = [0.0]
    svc = IndexerService.__new__(IndexerService)
    svc._log = RateLimiter(60.0, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            svc._on_bad("unknown_parent", "w1", "x")
        svc._on_bad("block_size_mismatch", "w1", "y")  # not hidden behind the other reason
        now[0] = 61.0
        svc._on_bad("unknown_parent", "w1", "x")
    lines = [(e["reason"], e["suppressed"]) for e in logs if e["event"] == "bad kv input"]
    assert lines == [("unknown_parent", 0), ("block_size_mismatch", 0), ("unknown_parent", 4)]
