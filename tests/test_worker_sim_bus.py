"""The simulated worker on a real NATS: KV event batches in JetStream, kvdump replies,
heartbeats from ``serve`` (N workers in one process), and HTTP that keeps serving without NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest

from services.common import settings as S
from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.kvdump import fetch_kvdump
from services.common.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    WorkerHeartbeat,
)
from services.common.streams import require_kv_events_stream
from services.core.keys import block_keys
from tests.test_worker_sim_support import get_text, metric_values, one, sim_worker, until

PROMPTS = [("shared system prompt, " * 6) + f"question {i}; " * 15 for i in range(4)]


async def collect_batches(bus: Bus, subject: str) -> asyncio.Queue[KvEventBatch]:
    q: asyncio.Queue[KvEventBatch] = asyncio.Queue()

    async def on(b: KvEventBatch, _raw) -> None:
        q.put_nowait(b)

    await bus.subscribe(subject, KvEventBatch, on)
    return q


def apply(held: set[int], batch: KvEventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            held.update(ev.keys)
        elif isinstance(ev, BlockRemoved):
            held.difference_update(ev.keys)
        elif isinstance(ev, AllBlocksCleared):
            held.clear()


async def test_kv_events_reach_jetstream_and_kvdump_matches(bus: Bus):
    await require_kv_events_stream(bus)
    q = await collect_batches(bus, bus.subjects.kv_events("kv0"))
    async with sim_worker(bus, worker_id="kv0", engine={"num_gpu_blocks": 40}) as w:
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        for p in PROMPTS:
            await c.completions.create(model="m", prompt=p, max_tokens=20)
        await c.close()
        # the worker has stepped to idle; every batch it made is assigned a seq
        last = w.kv_seq
        batches = [await asyncio.wait_for(q.get(), 5) for _ in range(last + 1)]
        assert [b.seq for b in batches] == list(range(last + 1))
        assert {b.instance_id for b in batches} == {w.instance_id}
        assert batches[0].events == [AllBlocksCleared()]
        held: set[int] = set()
        for b in batches:
            apply(held, b)
        # every prompt's full blocks were stored under the canonical keys
        stored = {
            k for b in batches for ev in b.events if isinstance(ev, BlockStored) for k in ev.keys
        }
        for p in PROMPTS:
            assert set(block_keys(list(p.encode()), 16)) <= stored
        # 40 blocks cannot hold four requests' blocks: something was evicted
        assert any(isinstance(ev, BlockRemoved) for b in batches for ev in b.events)
        # JetStream stored them all
        info = await bus.js.stream_info(bus.subjects.kv_events_stream)
        assert info.state.messages == last + 1

        async def heartbeat_seq() -> bool:
            return w.kv_seq_done == last

        await until(heartbeat_seq, what="publisher caught up")
        assert w.heartbeat().kv_seq == last
        dump = (await fetch_kvdump(bus, "kv0", reason="test")).batch
        assert dump.seq == last and dump.instance_id == w.instance_id  # seq not advanced
        assert w.kv_seq == last
        assert dump.events[0] == AllBlocksCleared()
        dumped = {k for ev in dump.events[1:] for k in ev.keys}
        assert dumped == held and len(held) == w.engine.num_cached_blocks > 0


async def test_fault_drop_and_duplicate_kv_batches(bus: Bus):
    await require_kv_events_stream(bus)
    q = await collect_batches(bus, bus.subjects.kv_events("f0"))
    async with sim_worker(bus, worker_id="f0") as w:
        first = await asyncio.wait_for(q.get(), 5)
        assert first.seq == 0
        await w.apply_faults({"drop_kv": 1.0})
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        await c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4)
        dropped_upto = w.kv_seq
        assert dropped_upto >= 1

        async def handled() -> bool:
            return w.kv_seq_done == dropped_upto

        await until(handled, what="drops handled")
        assert q.empty()
        assert w.heartbeat().kv_seq == dropped_upto  # consumers can see the gap
        v = metric_values(await get_text(w.url + "/metrics"))
        drops = {lab["reason"]: val for lab, val in v["sim:kv_batches_dropped_total"]}
        assert drops["fault"] == dropped_upto
        await w.apply_faults({"drop_kv": 0.0, "dup_kv": 1.0})
        await c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=4)
        await c.close()
        seqs = [(await asyncio.wait_for(q.get(), 5)).seq for _ in range(2)]
        assert seqs == [dropped_upto + 1] * 2  # the same batch twice


async def test_http_keeps_serving_without_nats(nats_url: str):
    port = free_port()
    down = Bus(f"nats://127.0.0.1:{port}", "test")  # nothing listens there
    async with sim_worker(down, worker_id="nn") as w:
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        r = await c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=3)
        await c.close()
        assert r.usage.completion_tokens == 3

        async def counted() -> bool:
            v = metric_values(await get_text(w.url + "/metrics"))
            drops = {lab["reason"]: val for lab, val in v["sim:kv_batches_dropped_total"]}
            return drops.get("nats_down", 0) == w.kv_seq + 1

        await until(counted, what="drops counted")


def sim_settings(nats_url: str, prefix: str, **over):
    from services.worker_sim.cli import OPTIONS

    st = S.resolve(None, OPTIONS, environ={})
    st.nats_url = nats_url
    st.subject_prefix = prefix
    for k, v in over.items():
        setattr(st, k, v)
    return st


async def test_serve_runs_n_workers_with_heartbeats(bus: Bus, nats_url: str, subject_prefix: str):
    from services.worker_sim.app import serve

    beats: asyncio.Queue[WorkerHeartbeat] = asyncio.Queue()

    async def on(hb: WorkerHeartbeat, _raw) -> None:
        beats.put_nowait(hb)

    await bus.subscribe(bus.subjects.heartbeat_all, WorkerHeartbeat, on)
    port = free_port()
    while not all(_free(port + i) for i in range(3)):
        port = free_port()
    st = sim_settings(
        nats_url,
        subject_prefix,
        count=3,
        port=port,
        worker_id="hb",
        heartbeat_interval=0.2,
        num_gpu_blocks=300,
        max_num_seqs=12,
        speedup=100.0,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(st, stop))
    try:
        seen: dict[str, WorkerHeartbeat] = {}
        while len(seen) < 3:
            hb = await asyncio.wait_for(beats.get(), 10)
            seen[hb.worker_id] = hb
        assert sorted(seen) == ["hb-0", "hb-1", "hb-2"]
        for i in range(3):
            hb = seen[f"hb-{i}"]
            assert hb.url == f"http://127.0.0.1:{port + i}"
            assert hb.capacity.num_gpu_blocks == 300 and hb.capacity.max_num_seqs == 12
            assert hb.capacity.block_size == 16 and hb.state == "ready"
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port + 2}/v1", api_key="x")
        raw = await c.completions.with_raw_response.create(model="m", prompt="hello", max_tokens=2)
        await c.close()
        assert raw.headers["x-kvgate-served-by"] == "hb-2"
        v = metric_values(await get_text(f"http://127.0.0.1:{port + 1}/metrics"))
        assert one(v, "vllm:num_requests_running") == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _free(port: int) -> bool:
    import socket

    with contextlib.closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_serve_fails_cleanly_when_a_port_is_taken(
    bus: Bus, nats_url: str, subject_prefix: str
):
    """A start-up error must end ``serve`` with a clear error and nothing left running
    (otherwise the process hangs in asyncio.run's final cancellation instead of exiting)."""
    import socket

    from services.worker_sim.app import serve

    port = free_port()
    while not all(_free(port + i) for i in range(2)):
        port = free_port()
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", port + 1))
    blocker.listen()
    before = set(asyncio.all_tasks())
    try:
        st = sim_settings(nats_url, subject_prefix, count=2, port=port, worker_id="pt")
        try:
            await asyncio.wait_for(serve(st, asyncio.Event()), 15)
        except RuntimeError as exc:
            assert "pt-1 cannot listen" in str(exc)
        else:
            raise AssertionError("serve should fail")
    finally:
        blocker.close()
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [asyncio.current_task()] or left == [], left
    assert _free(port)  # worker pt-0 let go of its port


@pytest.mark.slow
async def test_recovers_by_itself_after_nats_restarts(embedded_nats):
    """NATS goes away: HTTP keeps serving, KV batches are counted as dropped (the heartbeat's
    kv_seq then shows the gap); NATS comes back: publishing resumes without a restart."""
    from services.common.subjects import Subjects

    bus = Bus(embedded_nats.url, "sim-test", Subjects("rec"))
    await bus.connect(max_wait_s=10)
    await require_kv_events_stream(bus)
    watcher = Bus(embedded_nats.url, "watcher", Subjects("rec"))
    await watcher.connect(max_wait_s=10)
    try:
        async with sim_worker(bus, worker_id="r0") as w:
            c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
            await c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=3)
            embedded_nats.stop()
            await asyncio.wait_for(bus.disconnected.wait(), 10)
            r = await c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=3)
            assert r.usage.completion_tokens == 3
            gap_seq = w.kv_seq

            async def dropped() -> bool:
                return w.kv_seq_done == gap_seq and w.kv_dropped.get("nats_down", 0) > 0

            await until(dropped, what="drops counted while NATS is down")
            embedded_nats.start()
            await asyncio.wait_for(bus.connected.wait(), 15)
            await asyncio.wait_for(watcher.connected.wait(), 15)
            q = await collect_batches(watcher, watcher.subjects.kv_events("r0"))
            await watcher.client.flush()  # the subscription is on the server before the publish

            async def stream_back() -> bool:
                # a restarted server answers JetStream only once it has recovered the stream;
                # a batch published before that is a counted drop (nats_error), by design
                try:
                    await watcher.js.stream_info(watcher.subjects.kv_events_stream)
                except Exception:
                    return False
                return True

            await until(stream_back, what="the KV events stream recovered after the restart")
            await c.completions.create(model="m", prompt=PROMPTS[2], max_tokens=3)
            b = await asyncio.wait_for(q.get(), 10)
            assert b.seq > gap_seq and b.instance_id == w.instance_id
            dump = (await fetch_kvdump(watcher, "r0")).batch
            assert dump.seq == w.kv_seq and len(dump.events) > 1
            await c.close()
    finally:
        with contextlib.suppress(Exception):
            await watcher.js.delete_stream(watcher.subjects.kv_events_stream)
        await watcher.close()
        await bus.close()


def test_advertised_url_and_worker_ids():
    import socket

    from services.worker_sim.app import advertise_host, worker_ids

    assert advertise_host("0.0.0.0", "") == socket.gethostname()
    assert advertise_host("sim", "") == "sim"
    assert advertise_host("0.0.0.0", "sim.internal") == "sim.internal"
    assert worker_ids("sim", 1) == ["sim"]
    assert worker_ids("sim", 3) == ["sim-0", "sim-1", "sim-2"]
    assert worker_ids("sim", 1, first=6) == ["sim-6"]
    assert worker_ids("sim", 2, first=4) == ["sim-4", "sim-5"]
    with pytest.raises(ValueError):
        worker_ids("bad.id", 2)


@pytest.mark.slow
def test_cli_process_serves_and_stops_on_sigterm(nats_url: str, subject_prefix: str, tmp_path):
    """The real command: ``kvgate sim-worker --count 2`` answers on both ports and exits
    promptly and cleanly on SIGTERM, also after a failed start (port taken)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.conftest import wait_for_port

    port = free_port()
    while not all(_free(port + i) for i in range(2)):
        port = free_port()
    env = {**os.environ, "KVGATE_NATS_URL": nats_url, "KVGATE_SUBJECT_PREFIX": subject_prefix}
    cmd = [sys.executable, "-m", "services.cli", "sim-worker", "--count", "2"]
    log = open(tmp_path / "sim.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, stdout=log, stderr=log)
    try:
        wait_for_port(port + 1, timeout=20)
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/health", timeout=5) as r:
            assert json.loads(r.read())["worker_id"] == "sim-1"
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - t < 10
        # a port already taken: a clear error and a prompt, non-zero exit (no hang)
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", port + 1))
        blocker.listen()
        try:
            failed = subprocess.run(
                cmd + ["--port", str(port)], env=env, capture_output=True, text=True, timeout=30
            )
        finally:
            blocker.close()
        assert failed.returncode != 0
        assert "cannot listen" in failed.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        with contextlib.suppress(Exception):
            asyncio.run(_drop_stream(nats_url, subject_prefix))


async def _drop_stream(nats_url: str, prefix: str) -> None:
    from services.common.subjects import Subjects

    b = Bus(nats_url, "cleanup", Subjects(prefix))
    await b.connect(max_wait_s=5)
    try:
        await b.js.delete_stream(b.subjects.kv_events_stream)
    finally:
        await b.close()
