"""``kvgate index verify`` for a bridged worker, against what the engine can still prove.

Real parts: simulated workers publishing vLLM's ZMQ wire format with a replay buffer of a few
batches, the vLLM bridge, a real NATS, the real indexer (its verifier) and the real
``kvgate index verify`` process. A bridge whose engine history is gone (it started after the
engine's first batches left the replay buffer, or a gap outlived the buffer) must not pass
for the engine: the index then equals the bridge's view while the engine holds blocks
neither has, and the answer is "unknown" with the reason and counts, never "equal". A bridge
that missed nothing stays "equal", and an engine restart makes a bridge verifiable again.
Plus the same bookkeeping for an engine that clears its cache (TinyEngine, vLLM's documented
wire format) and for TensorRT-LLM's event ids, and the verifier's rule itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import openai

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.kvdump import fetch_kvdump
from services.common.schemas import (
    EngineHistoryLost,
    IndexVerifyReply,
    IndexVerifyRequest,
    WorkerDivergence,
)
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.common.tokenizer import ByteTokenizer
from services.core.engine import EngineConfig
from services.kv_indexer.bridges.rekey import Rekeyer
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.bridges.trtllm import TrtllmBridge
from services.kv_indexer.bridges.zmq_bridge import ZmqBridge
from services.kv_indexer.divergence import apply_events
from services.kv_indexer.verifier import qualify_check
from services.worker_sim.worker import SimWorker, WorkerSettings
from tests.test_bridge_identity import KEYS, chain_events, held
from tests.test_bridge_zmq import TinyEngine, two_ports
from tests.test_kv_support import connected, indexer, wait_until

MODEL = "llama-sim"
SYSTEM = "You are a careful assistant; answer in one short sentence please. " * 2


@contextlib.asynccontextmanager
async def zmq_bridge(
    nats_url: str,
    subjects: Subjects,
    worker: str,
    pub: int,
    rep: int,
    *,
    engine_url: str = "",
    model: str = MODEL,
    block_size: int | None = None,
    tail_check_s: float = 0.3,
    **zmq_kw: Any,
) -> AsyncIterator[ZmqBridge]:
    """``kvgate bridge vllm`` in-process for the engine at ZMQ ports ``pub``/``rep`` (with
    ``engine_url``, block size and start time are read from its /metrics, like a real
    vLLM's). The bridge's bus is ``zb.rt.bus``."""
    async with connected(nats_url, subjects, f"bridge-{worker}") as b:
        rt = BridgeRuntime(
            b,
            worker,
            engine="vllm",
            model=model,
            engine_url=engine_url,
            heartbeat_s=0.1,
            block_size=block_size,
        )
        await rt.start()
        zb = ZmqBridge(
            rt,
            f"tcp://127.0.0.1:{pub}",
            f"tcp://127.0.0.1:{rep}",
            topic="kv@",
            tail_check_s=tail_check_s,
            **zmq_kw,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(zb.run(stop))
        await zb.subscribed.wait()
        try:
            yield zb
        finally:
            stop.set()
            await task
            await rt.stop()


@contextlib.asynccontextmanager
async def engine_sim(
    worker: str, pub: int, rep: int, buffer_steps: int, port: int = 0
) -> AsyncIterator[SimWorker]:
    """A simulated vLLM: ZMQ PUB + replay buffer of ``buffer_steps`` batches, HTTP on
    ``port`` (0: any). No native NATS identity: the bridge is this engine's only voice."""
    ws = WorkerSettings(
        worker_id=worker,
        port=port or free_port(),
        speedup=200.0,
        model=MODEL,
        zmq_port=pub,
        zmq_replay_port=rep,
        zmq_buffer_steps=buffer_steps,
        zmq_replay_topic_frame=True,
    )
    cfg = EngineConfig(num_gpu_blocks=512, max_num_seqs=16, max_model_len=4096)
    w = SimWorker(ws, cfg, ByteTokenizer(), None)
    await w.start()
    try:
        yield w
    finally:
        await w.close()


async def ask(w: SimWorker, first: int, n: int, system: str = SYSTEM) -> None:
    """``n`` prompts sharing ``system`` (each request's new blocks chain onto cached ones)."""
    client = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
    try:
        for i in range(first, first + n):
            await client.completions.create(
                model=MODEL, prompt=f"{system} question {i:03d}" * 3, max_tokens=3
            )
    finally:
        await client.close()


def engine_pairs(w: SimWorker) -> dict[int, int]:
    """The engine's own cache, as (key -> tier bits)."""
    return apply_events({}, w.engine.dump_cache())


def bridge_view(zb: ZmqBridge) -> dict[int, int]:
    return apply_events({}, zb.rt.rekeyer.dump())


async def caught_up(svc: Any, zb: ZmqBridge, w: SimWorker) -> None:
    """The bridge applied every engine batch and the index holds exactly its view."""
    await wait_until(lambda: zb.expected == w.kv_seq + 1, timeout=15, what="bridge caught up")
    worker = zb.rt.worker_id
    await wait_until(
        lambda: svc.core.index.pairs_of(worker) == bridge_view(zb),
        timeout=15,
        what="index holds the bridge's view",
    )


async def index_verify_cli(nats_url: str, subjects: Subjects, *args: str) -> tuple[int, str]:
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
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    out, _ = await proc.communicate()  # stderr: the CLI's own log lines
    return proc.returncode or 0, out.decode()


async def verify(bus: Bus, *workers: str) -> dict[str, WorkerDivergence]:
    reply = await bus.request(
        bus.subjects.kv_index_verify,
        IndexVerifyRequest(workers=list(workers)),
        IndexVerifyReply,
        timeout=60,
    )
    return {r.worker_id: r for r in reply.workers}


async def test_late_bridge_past_a_short_replay_buffer_is_unknown_not_equal(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """Two engines served for a while before their bridges started. ``late``'s replay buffer
    (4 batches) no longer holds its first batches: its index is equal to its bridge's view,
    but the engine holds blocks neither has, so ``kvgate index verify`` says unknown, with the
    lost batches and the blocks seen stored on lost parents, and exits 2. ``whole``'s buffer
    holds everything: equal."""
    await require_kv_events_stream(bus)
    late_pub, late_rep = two_ports()
    whole_pub, whole_rep = two_ports()
    async with (
        indexer(nats_url, subjects) as svc,
        engine_sim("late", late_pub, late_rep, buffer_steps=4) as late,
        engine_sim("whole", whole_pub, whole_rep, buffer_steps=10_000) as whole,
    ):
        await ask(late, 0, 10)
        await ask(whole, 0, 10)
        assert late.kv_seq > 8  # more batches than the buffer holds (one per request)
        async with (
            zmq_bridge(
                nats_url, subjects, "br-late", late_pub, late_rep, engine_url=late.url
            ) as zl,
            zmq_bridge(
                nats_url, subjects, "br-whole", whole_pub, whole_rep, engine_url=whole.url
            ) as zw,
        ):
            await wait_until(lambda: zl.rt.ready and zw.rt.ready, timeout=15, what="ready")
            # new questions on the shared system prompt: their blocks chain onto blocks
            # stored in the lost batches, which the bridge cannot key
            await ask(late, 6, 3)
            await ask(whole, 6, 3)
            other = "Another deployment's system prompt, never seen before the bridge. " * 2
            await ask(late, 0, 1, other)  # a new root: keyable
            await caught_up(svc, zl, late)
            await caught_up(svc, zw, whole)
            # the ground truth: the index lacks blocks the engine holds (a check against the
            # bridge's view alone would say "equal")
            truth, indexed = engine_pairs(late), svc.core.index.pairs_of("br-late")
            assert set(indexed) < set(truth), (len(indexed), len(truth))
            assert engine_pairs(whole) == svc.core.index.pairs_of("br-whole")

            code, out = await index_verify_cli(nats_url, subjects)
            assert code == 2, out
            rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("br-")}
            assert rows["br-late"][1] == "unknown", out
            assert rows["br-whole"][1] == "equal", out
            assert "engine history lost: engine batches 0.." in out
            assert "replay buffer no longer held them" in out
            assert "unknown: 1 bridged worker(s) lost engine history" in out and "br-late" in out

            code, out = await index_verify_cli(nats_url, subjects, "--worker", "br-late", "--json")
            assert code == 2, out
            (row,) = json.loads(out)["workers"]
            lost = row["history_lost"]
            assert row["status"] == "unknown" and row["missing"] == row["extra"] == 0
            assert 0 < row["worker_blocks"] == len(indexed) < len(truth)
            assert lost["reason"] == "lost_history" and lost["first_lost_seq"] == 0
            assert lost["view_from_seq"] == lost["last_lost_seq"] + 1 > 4
            assert lost["unkeyed_blocks"] > 0  # stored on parents from the lost batches
            code, out = await index_verify_cli(nats_url, subjects, "--worker", "br-whole")
            assert code == 0, out
            assert zl.rt.health()["history_lost"]["reason"] == "lost_history"
            assert zw.rt.health()["history_lost"] is None


async def test_gap_longer_than_the_replay_buffer_then_engine_restart(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """A bridge that saw everything is equal; batches lost on the wire while the engine's
    replay buffer rolls over them make it unknown (unrecovered gap) in the verifier's own
    answer; the engine restarting (a new process whose replay starts at seq 0 again) makes
    the same bridge verifiable, and equal, again."""
    await require_kv_events_stream(bus)
    pub, rep = two_ports()
    http = free_port()
    async with contextlib.AsyncExitStack() as first, indexer(nats_url, subjects) as svc:
        w = await first.enter_async_context(engine_sim("gap", pub, rep, 3, port=http))
        # no idle replay while the wire drops batches: the gap shows on the next batch
        async with zmq_bridge(
            nats_url, subjects, "br-gap", pub, rep, engine_url=w.url, tail_check_s=60.0
        ) as zb:
            await wait_until(lambda: zb.rt.ready, timeout=15, what="bridge ready")
            await ask(w, 0, 3)
            await caught_up(svc, zb, w)
            assert (await verify(bus, "br-gap"))["br-gap"].status == "equal"

            w.faults.drop_kv = 1.0  # every batch lost on the wire, the buffer rolls over
            await ask(w, 3, 5)
            w.faults.drop_kv = 0.0
            await ask(w, 8, 2)
            await caught_up(svc, zb, w)
            assert set(svc.core.index.pairs_of("br-gap")) < set(engine_pairs(w))
            r = (await verify(bus, "br-gap"))["br-gap"]
            assert r.status == "unknown", r
            assert r.history_lost is not None and r.history_lost.reason == "unrecovered_gap"
            assert "a gap the bridge could not replay" in r.detail

            await first.aclose()  # the engine process ends (its /health stops answering) ...
            await wait_until(lambda: not zb.rt.engine_ok, what="the bridge saw the engine down")
            async with engine_sim("gap", pub, rep, 3, port=http) as w2:  # ... and starts again
                await ask(w2, 0, 2)
                await wait_until(
                    lambda: zb.restarts >= 2 and zb.rt.history_report() is None,
                    timeout=15,
                    what="the bridge saw the new engine process from its seq 0",
                )
                await caught_up(svc, zb, w2)
                assert svc.core.index.pairs_of("br-gap") == engine_pairs(w2)
                assert (await verify(bus, "br-gap"))["br-gap"].status == "equal"


async def test_engine_clearing_its_cache_makes_a_bridge_verifiable_again(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """vLLM's documented wire (TinyEngine): a bridge started after the buffer lost seqs 0-2
    serves dumps marked history_lost; once the engine publishes AllBlocksCleared (its cache
    is empty: everything it holds later is seen), the mark goes and verify says equal."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    try:
        for evs in chain_events(eng, 0, 5):
            await eng.publish(evs)
        del eng.buffer[:3]  # the replay buffer only holds seqs 3 and 4
        async with (
            indexer(nats_url, subjects) as svc,
            zmq_bridge(
                nats_url,
                subjects,
                "pod-a",
                eng.pub_port,
                eng.replay_port,
                model="m",
                block_size=16,
            ) as zb,
        ):
            rt, b = zb.rt, zb.rt.bus
            await wait_until(lambda: rt.ready and "pod-a" in svc.core.workers, what="ready")
            dump = await fetch_kvdump(b, "pod-a")
            lost = dump.history_lost
            assert lost is not None and (lost.first_lost_seq, lost.last_lost_seq) == (0, 2)
            assert lost.view_from_seq == 3 and lost.unkeyed_blocks == 2  # seqs 3-4: lost parents
            assert "the engine's replay buffer no longer held them" in lost.detail
            assert (await verify(b, "pod-a"))["pod-a"].status == "unknown"

            await eng.publish([{"type": "AllBlocksCleared"}])
            await eng.publish(chain_events(eng, 0, 1)[0])
            await wait_until(lambda: held(svc) == {KEYS[0]}, what="cleared, re-stored")
            assert (await fetch_kvdump(b, "pod-a")).history_lost is None
            assert (await verify(b, "pod-a"))["pod-a"].status == "equal"
    finally:
        await eng.close()


async def test_history_lost_to_a_failed_replay_is_recovered_by_asking_again(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """The engine's replay socket does not answer when the bridge starts (not a short
    buffer: a failed replay): unknown, saying the replay failed. Once the replay answers,
    the bridge's re-ask from seq 0 finds the whole history, rebuilds its view and the same
    worker verifies equal, every block indexed."""
    await require_kv_events_stream(bus)
    eng = TinyEngine()
    try:
        for evs in chain_events(eng, 0, 5):
            await eng.publish(evs)
        eng.task.cancel()  # the replay socket stops answering
        with contextlib.suppress(asyncio.CancelledError):
            await eng.task
        async with (
            indexer(nats_url, subjects) as svc,
            zmq_bridge(
                nats_url,
                subjects,
                "pod-a",
                eng.pub_port,
                eng.replay_port,
                model="m",
                block_size=16,
                replay_timeout_s=0.2,
                tail_check_s=0.2,
                history_recheck_s=0.2,
            ) as zb,
        ):
            rt, b = zb.rt, zb.rt.bus
            n = 5
            while zb.batches == 0:  # until a live batch passes the slow-joining SUB
                await eng.publish(chain_events(eng, n, 1)[0])
                n += 1
                await asyncio.sleep(0.05)  # pacing the publisher, not synchronisation
            await wait_until(lambda: "pod-a" in svc.core.workers, what="heartbeat")
            lost = rt.history_report()
            assert lost is not None and lost.reason == "lost_history"
            assert lost.detail.startswith("the engine's replay failed")
            assert (await verify(b, "pod-a"))["pod-a"].status == "unknown"

            eng.task = asyncio.create_task(eng._serve_replay())  # the replay answers again
            await wait_until(
                lambda: rt.history_report() is None and held(svc) == set(KEYS[:n]),
                timeout=15,
                what="history recovered and indexed",
            )
            assert rt.resets.get("history_recovered") == 1 and zb.history_rechecks >= 1
            assert (await verify(b, "pod-a"))["pod-a"].status == "equal"
    finally:
        await eng.close()


def trt_event(event_id: int, data: dict[str, Any]) -> dict[str, Any]:
    return {"event_id": event_id, "data": data, "window_size": 32}


async def test_trtllm_bridge_started_late_or_past_a_gap_lost_history(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """TensorRT-LLM has no replay: a first event past id 0 that is not ``created`` (the
    bridge started late), or a jump in event ids, is lost history; ``created`` (an engine
    start) is a whole view."""
    await require_kv_events_stream(bus)
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(16)]
    stored = {
        "type": "stored",
        "parent_hash": None,
        "blocks": [{"type": "stored_block", "block_hash": 1, "tokens": tokens, "cache_level": 0}],
    }
    created = {"type": "created", "num_blocks_per_cache_level": [100, 0]}
    async with connected(nats_url, subjects, "bridge") as b:
        rt = BridgeRuntime(b, "trt-a", engine="trtllm", model="m", block_size=16)
        await rt.start()
        try:
            tb = TrtllmBridge(rt, "http://127.0.0.1:1")
            tb.handle_body(json.dumps([trt_event(7, stored)]).encode())
            lost = rt.history_report()
            assert lost is not None and lost.reason == "lost_history"
            assert (lost.first_lost_seq, lost.last_lost_seq, lost.view_from_seq) == (0, 6, 7)
            assert "no replay" in lost.detail
            dump = await fetch_kvdump(b, "trt-a")
            assert dump.history_lost is not None and dump.blocks == 1

            tb.handle_body(json.dumps([trt_event(0, created), trt_event(1, stored)]).encode())
            assert rt.history_report() is None  # an engine start: its whole history seen
            tb.handle_body(json.dumps([trt_event(5, stored)]).encode())
            lost = rt.history_report()
            assert lost is not None and lost.reason == "unrecovered_gap"
            assert (lost.first_lost_seq, lost.last_lost_seq, lost.view_from_seq) == (2, 4, 0)
        finally:
            await rt.stop()


def test_only_an_equal_check_against_a_partial_view_becomes_unknown() -> None:
    lost = EngineHistoryLost(
        reason="lost_history", first_lost_seq=0, last_lost_seq=9, view_from_seq=10
    )
    equal = WorkerDivergence(worker_id="w", status="equal", worker_blocks=5, index_blocks=5)
    r = qualify_check(equal, lost)
    assert r.status == "unknown" and r.history_lost == lost
    assert "engine batches 0..9 never reached the bridge" in r.detail
    div = WorkerDivergence(worker_id="w", status="divergent", missing=2)
    assert qualify_check(div, lost).status == "divergent"  # the index differs from the bridge
    assert qualify_check(div, lost).history_lost == lost
    unreachable = WorkerDivergence(worker_id="w", status="unreachable")
    assert qualify_check(unreachable, lost) is unreachable
    assert qualify_check(equal, None) is equal


def test_ledger_widens_a_second_loss_and_counts_evidence_since_the_first() -> None:
    from services.kv_indexer.bridges.history import HistoryLedger

    rk = Rekeyer(0, 16)
    rk.unkeyed_blocks = 3  # before the loss: not evidence of it
    ledger = HistoryLedger()
    ledger.note_loss("unrecovered_gap", 10, 12, 0, rk)
    rk.unkeyed_blocks += 4
    rk.unknown_hashes += 2
    ledger.note_loss("unrecovered_gap", 20, 25, 0, rk)
    lost = ledger.report(rk)
    assert lost is not None
    assert (lost.first_lost_seq, lost.last_lost_seq, lost.losses) == (10, 25, 2)
    assert (lost.unkeyed_blocks, lost.unknown_hashes) == (4, 2)
    assert not ledger.after_batch(rk)
    rk.cleared()  # the engine's own AllBlocksCleared
    assert ledger.after_batch(rk) and ledger.report(rk) is None
