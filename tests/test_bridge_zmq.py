"""vLLM / SGLang bridge over real ZMQ sockets and a real NATS, into the real indexer.

First against a tiny publisher written here from the documented wire format (both event
forms, three hash types, both replay framings), then end to end against the simulated
worker's vLLM-format ZMQ output, with dropped batches that force replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator

import msgpack
import openai
import pytest
import zmq
import zmq.asyncio

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.core.keys import block_keys
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.bridges.zmq_bridge import ZmqBridge, parse_replay
from tests.test_kv_support import connected, indexer, wait_until

END = (-1).to_bytes(8, "big", signed=True)


def two_ports() -> tuple[int, int]:
    a = free_port()
    b = free_port()
    while b == a:
        b = free_port()
    return a, b


class TinyEngine:
    """A vLLM-style publisher: PUB ``[topic, seq, payload]`` + ROUTER replay buffer."""

    def __init__(
        self,
        form: str = "map",
        mode: str = "uint64",
        topic_frame: bool = True,
        block_size: int = 16,
        connect_to: str | None = None,
    ) -> None:
        self.form, self.mode, self.topic_frame = form, mode, topic_frame
        self.block_size = block_size
        self.pub_port, self.replay_port = two_ports()
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:  # the engine's PUB connects out to a bridge that binds
            self.pub.connect(connect_to)
        else:
            self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.topic = b"kv@pod-a@tiny-model"
        self.seq = -1
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self.task = asyncio.create_task(self._serve_replay())

    def ehash(self, key_index: int) -> int | bytes:
        raw = hashlib.sha256(f"b{key_index}".encode()).digest()
        if self.mode == "bytes32":
            return raw
        u = int.from_bytes(raw[:8], "big")
        return u - (1 << 64) if self.mode == "int64" and u >= 1 << 63 else u

    def stored(self, ids: list[int], parent: int | None, tokens: list[int]) -> object:
        hashes = [self.ehash(i) for i in ids]
        p = None if parent is None else self.ehash(parent)
        if self.form == "map":
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": p,
                "token_ids": tokens,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        return ["BlockStored", hashes, p, tokens, self.block_size, None, "GPU", None]

    def removed(self, ids: list[int]) -> object:
        hashes = [self.ehash(i) for i in ids]
        if self.form == "map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
        return ["BlockRemoved", hashes, "GPU"]

    def restart(self) -> None:
        """A new engine process: seq from 0 again, an empty replay buffer."""
        self.seq = -1
        self.buffer.clear()

    async def publish(self, events: list[object], send: bool = True) -> int:
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        return await self.publish_raw(payload, send)

    async def publish_raw(self, payload: bytes, send: bool = True) -> int:
        self.seq += 1
        self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        return self.seq

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            s = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= s:
                    mid = [self.topic] if self.topic_frame else []
                    await self.router.send_multipart(
                        [client, b"", *mid, seq.to_bytes(8, "big"), payload]
                    )
            end = [client, b"", b"", END, b""] if self.topic_frame else [client, b"", END, b""]
            await self.router.send_multipart(end)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@contextlib.asynccontextmanager
async def bridge(
    nats_url: str, subjects: Subjects, worker: str, endpoint: str, replay: str | None, **kw
) -> AsyncIterator[ZmqBridge]:
    async with connected(nats_url, subjects, "bridge") as b:
        kw.setdefault("block_size", None if kw.get("engine_url") else 16)
        rt = BridgeRuntime(b, worker, engine="vllm", model="m", heartbeat_s=0.2, **kw)
        await rt.start()
        zb = ZmqBridge(rt, endpoint, replay, topic="kv@")
        stop = asyncio.Event()
        task = asyncio.create_task(zb.run(stop))
        await zb.subscribed.wait()
        try:
            yield zb
        finally:
            stop.set()
            await task
            await rt.stop()


def test_replay_framings_parse() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay([b"", seq, b"p"]) == (5, b"p")
    assert parse_replay([b"", b"kv@a@m", seq, b"p"]) == (5, b"p")
    assert parse_replay([b"", b"", END, b""]) == (-1, b"")
    assert parse_replay([b"", END, b""]) == (-1, b"")
    assert parse_replay([b"x"]) is None


@pytest.mark.parametrize(
    ("form", "mode", "topic_frame"),
    [("map", "uint64", False), ("array", "int64", True), ("map", "bytes32", True)],
)
async def test_bridge_rekeys_replays_gaps_and_feeds_the_index(
    bus: Bus, nats_url: str, subjects: Subjects, form: str, mode: str, topic_frame: bool
) -> None:
    await require_kv_events_stream(bus)
    eng = TinyEngine(form, mode, topic_frame)
    tokens = list(range(5000, 5000 + 16 * 40))
    keys = block_keys(tokens, 16)
    try:
        async with (
            indexer(nats_url, subjects) as svc,
            bridge(
                nats_url,
                subjects,
                "pod-a",
                f"tcp://127.0.0.1:{eng.pub_port}",
                f"tcp://127.0.0.1:{eng.replay_port}",
            ) as zb,
        ):
            await wait_until(lambda: "pod-a" in svc.core.workers, what="bridge heartbeat")
            # one block per batch until the (slow-joining) SUB socket sees one; whatever it
            # missed before that is recovered by a replay from seq 0
            i = 0
            deadline = time.monotonic() + 10
            while zb.batches == 0:
                assert time.monotonic() < deadline, "bridge never received a batch"
                parent = i - 1 if i else None
                await eng.publish([eng.stored([i], parent, tokens[16 * i : 16 * i + 16])])
                i += 1
                await asyncio.sleep(0.02)  # pacing the publisher, not synchronisation
            await wait_until(lambda: zb.expected == eng.seq + 1, what="catch-up")
            # a batch lost on the wire (gap), then a live one: the bridge replays the gap
            lost = eng.stored(list(range(i, i + 10)), i - 1, tokens[16 * i : 16 * (i + 10)])
            await eng.publish([lost], send=False)
            await eng.publish([eng.removed([i + 8, i + 9])])
            await wait_until(lambda: zb.expected == eng.seq + 1, what="replay")
            assert zb.gaps >= 1 and eng.replays >= 1 and zb.replay_failures == 0
            expect = {"pod-a": i + 8}
            await wait_until(
                lambda: svc.core.index.find_matches(keys) == expect, what="index has the chain"
            )
            assert svc.core.index.blocks_of("pod-a") == i + 8
            assert zb.rt.rekeyer.counts == {}  # no unknown parents: nothing was lost
            assert svc.core.counts["bad:unknown_parent"] == 0
            # an engine restart (seq back to 0) makes a new instance: old blocks go
            eng.seq = -1
            eng.buffer.clear()
            other = list(range(9000, 9000 + 32))
            await eng.publish([eng.stored([500, 501], None, other)])
            await wait_until(lambda: svc.core.index.blocks_of("pod-a") == 2, what="restart clears")
            assert zb.restarts == 1
            assert svc.core.index.find_matches(block_keys(other, 16)) == {"pod-a": 2}
    finally:
        await eng.close()


@pytest.mark.slow
async def test_end_to_end_with_simulated_worker_zmq(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    """The sim worker publishes its KV events both natively on NATS (as ``z0``) and in vLLM's
    ZMQ format; the bridge re-keys the ZMQ side as ``br-z0``. With a quarter of the batches
    dropped on the wire (forcing replays), both views of the same cache must agree."""
    from tests.test_worker_sim_support import sim_worker

    await require_kv_events_stream(bus)
    pub_port, replay_port = two_ports()
    async with (
        indexer(nats_url, subjects) as svc,
        sim_worker(
            bus,
            worker_id="z0",
            model="llama-sim",
            zmq_port=pub_port,
            zmq_replay_port=replay_port,
            zmq_event_form="map",
            zmq_hash="uint64",
            zmq_replay_topic_frame=True,
        ) as w,
        bridge(
            nats_url,
            subjects,
            "br-z0",
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
            engine_url=w.url,
        ) as zb,
    ):

        async def beat() -> None:  # `kvgate sim-worker` heartbeats from its app loop
            while True:
                await bus.publish(subjects.heartbeat("z0"), w.heartbeat())
                await asyncio.sleep(0.3)

        beats = asyncio.create_task(beat())
        client = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        try:
            await wait_until(lambda: "br-z0" in svc.core.workers and "z0" in svc.core.workers)
            system = "You are a helpful assistant that answers briefly. " * 3
            for i in range(6):
                await client.completions.create(
                    model="llama-sim", prompt=f"{system} question {i:03d}" * 4, max_tokens=4
                )
            await wait_until(lambda: zb.batches > 0, what="first ZMQ batch")
            w.faults.drop_kv = 0.25  # lost on the wire (and on NATS): gaps on both paths
            for i in range(6, 30):
                await client.completions.create(
                    model="llama-sim", prompt=f"{system} question {i:03d}" * 4, max_tokens=4
                )
            w.faults.drop_kv = 0.0
            await client.completions.create(model="llama-sim", prompt=system, max_tokens=2)
        finally:
            await client.close()

        def keys_of(worker: str) -> set[int]:
            idx = svc.core.index
            return {k for k in idx.keys() if idx.holds(worker, k)}

        await wait_until(lambda: zb.expected == w.kv_seq + 1, timeout=15, what="bridge caught up")
        await wait_until(
            lambda: keys_of("z0") and keys_of("z0") == keys_of("br-z0"),
            timeout=20,
            what="both views agree",
        )
        assert zb.gaps >= 1 and zb.replays >= 1 and zb.replay_failures == 0
        # the heartbeat's capacity comes from the engine's vllm:cache_config_info
        assert zb.rt.capacity().num_gpu_blocks == w.heartbeat().capacity.num_gpu_blocks
        assert svc.core.workers["br-z0"].url == w.url
        assert zb.rt.rekeyer.counts.get("unknown_parent", 0) == 0
        toks = list((f"{system} question {7:03d}" * 4).encode())
        m = svc.core.index.find_matches(block_keys(toks, 16))
        assert m.get("br-z0") == m.get("z0") and m["z0"] >= len(system) // 16
        beats.cancel()
