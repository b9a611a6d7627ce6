"""vLLM / SGLang bridge: the engine's ZMQ KV-event publisher -> canonical events on NATS.

Live messages: SUB socket, frames ``[topic, seq (8-byte BE), payload]`` (topic
``kv@<pod>@<model>``; we subscribe to a topic prefix, "" = all). ``seq`` counts from 0 per
engine process.

Gaps: when ``seq`` jumps, the bridge asks the engine's ROUTER replay socket from the first
missing seq: a DEALER sends ``[b"", start_seq]`` and receives ``[b"", seq, payload]`` per
buffered batch (or ``[b"", topic, seq, payload]``, the vLLM >= 0.26 framing; both are
accepted) and an end marker with seq -1. While replaying, live messages wait in the SUB
socket's queue and are deduplicated by seq afterwards. A seq that falls back to 0 means the
engine restarted: a new instance id makes the indexer drop the old blocks.

Invariant: engine batches are turned into canonical batches strictly in engine seq order,
each at most once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

from services.common.logging import get_logger
from services.kv_indexer.bridges.engine_formats import EngineFormatError, VllmDecoder
from services.kv_indexer.bridges.runtime import BRIDGE_GAPS, BRIDGE_REPLAYS, BridgeRuntime

log = get_logger("bridge.zmq")


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
    """``[topic, seq, payload]`` -> (topic, seq, payload); None when the framing is wrong."""
    if len(frames) == 3:
        topic, seq, payload = frames
    elif len(frames) == 2:  # publisher without a topic frame
        topic, (seq, payload) = b"", frames
    else:
        return None
    if len(seq) != 8:
        return None
    return topic, int.from_bytes(seq, "big", signed=True), payload


def parse_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A DEALER-side replay reply in either framing -> (seq, payload); seq -1 = end."""
    if len(frames) >= 3 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:  # topic, seq, payload (vLLM >= 0.26)
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != 8:
        return None
    return int.from_bytes(frames[0], "big", signed=True), frames[1]


class ZmqBridge:
    def __init__(
        self,
        runtime: BridgeRuntime,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.rt = runtime
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.decoder = VllmDecoder()
        self.expected: int | None = None  # next engine seq
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.batches = 0
        self.duplicates = 0
        self.restarts = 0
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: Any = None
        self.subscribed = asyncio.Event()

    # ------------------------------------------------------------------ engine batches
    def handle(self, seq: int, payload: bytes) -> None:
        """Apply one engine batch that is next in order (decode, re-key, queue)."""
        self.expected = seq + 1
        self.batches += 1
        try:
            batch = self.decoder.decode(payload)
        except EngineFormatError as exc:
            self.rt.bad(exc.reason, exc.detail)
            return
        for reason, detail in batch.bad:
            self.rt.bad(reason, detail)
        self.rt.emit(self.rt.rekeyer.vllm_events(batch.events), batch.ts or None)

    async def on_message(self, seq: int, payload: bytes) -> None:
        exp = self.expected
        if exp is None or seq == exp:
            if exp is None and seq > 0 and self.replay_endpoint:
                # started late: recover what the engine still buffers
                await self.replay(0, upto=seq)
                if self.expected is not None and seq < self.expected:
                    return
            self.handle(seq, payload)
            return
        if seq < exp:
            if seq == 0:  # the engine restarted and numbers from 0 again
                self.restarts += 1
                self.rt.new_instance()
                self.handle(seq, payload)
            else:
                self.duplicates += 1
            return
        self.gaps += 1
        BRIDGE_GAPS.inc()
        if self.replay_endpoint:
            await self.replay(exp, upto=seq)
        if self.expected is not None and seq < self.expected:
            return  # the replay covered it
        if self.expected != seq:
            self.rt.bad("seq_gap_unrecovered", f"engine batches {self.expected}..{seq - 1} lost")
        self.handle(seq, payload)

    async def replay(self, start: int, upto: int) -> None:
        """Ask the engine for batches ``start..`` and apply those before ``upto`` (and after,
        if it sends them) in order."""
        self.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            got = 0
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    raise TimeoutError("replay timed out")
                parsed = parse_replay(await sock.recv_multipart())
                if parsed is None:
                    self.rt.bad("invalid_replay_frame", "unexpected replay framing")
                    continue
                seq, payload = parsed
                if seq < 0:
                    break
                if self.expected is None or seq == self.expected:
                    self.handle(seq, payload)
                    got += 1
                elif seq > (self.expected or 0):
                    self.rt.bad("seq_gap_unrecovered", f"replay starts at {seq}")
                    self.handle(seq, payload)
            BRIDGE_REPLAYS.labels("ok").inc()
            log.info("replayed engine batches", worker_id=self.rt.worker_id, start=start, got=got)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.replay_failures += 1
            BRIDGE_REPLAYS.labels("failed").inc()
            self.rt.bad("replay_failed", str(exc))
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------ loop
    async def run(self, stop: asyncio.Event) -> None:
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        self.subscribed.set()
        stopper = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                recv = asyncio.ensure_future(sub.recv_multipart())
                done, _ = await asyncio.wait({recv, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    recv.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await recv
                    break
                parsed = parse_live(recv.result())
                if parsed is None:
                    self.rt.bad("invalid_frame", "expected [topic, seq, payload]")
                    continue
                _, seq, payload = parsed
                await self.on_message(seq, payload)
        finally:
            stopper.cancel()
            sub.close(linger=0)
