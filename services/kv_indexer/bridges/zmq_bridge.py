"""vLLM / SGLang bridge: the engine's ZMQ KV-event publisher -> canonical events on NATS.

Live messages: SUB socket, frames ``[topic, seq (8-byte BE), payload]`` (topic
``kv@<pod>@<model>``; we subscribe to a topic prefix, "" = all). ``seq`` counts from 0 per
engine process. The SUB socket connects to an engine that binds its PUB (``tcp://*:5557``),
or, with ``bind=True``, binds and lets engines whose PUB connects out reach it (an endpoint
without ``*``, the central-subscriber pattern llm-d uses).

Replay: a DEALER asks the engine's ROUTER replay socket for batches from a seq: it sends
``[b"", start_seq]`` and receives ``[b"", seq, payload]`` per buffered batch (or
``[b"", topic, seq, payload]``, the vLLM >= 0.26 framing; both are accepted) and an end
marker with seq -1. While replaying, live messages wait in the SUB socket's queue and are
deduplicated by seq afterwards.

Engine identity (each case resets the bridge's view of the engine -- a new instance, so the
indexer drops the old blocks -- then replays from 0, and is counted by reason):
- ``seq_backwards``: a live seq at or below one already received live (the PUB socket never
  repeats one): the engine restarted, even when its first batches were lost;
- ``engine_restarted``: the engine's start time changed (runtime.probe_engine);
- ``unrecovered_gap``: a gap the replay cannot fill (the buffer no longer holds it): what the
  lost batches removed would stay indexed forever, so the view is rebuilt from what the
  engine still has;
- ``lost_history``: at start (or after a reset) the replay begins past seq 0: the engine's
  earliest batches are gone (short replay buffer); the blocks they stored cannot be keyed.

Start: the bridge waits for the engine's block size, replays from seq 0 and only then says
it is ready; while idle it asks the replay socket for anything after its last seq every
``tail_check_s`` (a lost last batch is refilled without waiting for the next one).

Invariant: engine batches are turned into canonical batches strictly in engine seq order,
each at most once per bridge instance view.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
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
        *,
        bind: bool = False,
        tail_check_s: float = 2.0,
    ) -> None:
        self.rt = runtime
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.bind = bind
        self.tail_check_s = tail_check_s
        self.decoder = VllmDecoder()
        self.expected: int | None = None  # next engine seq (None: nothing applied yet)
        self.last_live = -1  # highest seq received on the live socket (this engine process)
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.batches = 0
        self.duplicates = 0
        self.restarts = 0
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: Any = None
        self.subscribed = asyncio.Event()
        self.bound_endpoint: str | None = None

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

    def reset(self, reason: str) -> None:
        """Forget the engine's state (new instance); the next batch applied starts afresh."""
        self.restarts += 1
        self.rt.new_instance(reason)
        self.expected = None

    async def on_message(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_live:
            # a PUB socket never repeats a seq: the engine process is a new one
            self.last_live = seq
            self.reset("seq_backwards")
            if self.replay_endpoint:
                await self.replay(0, upto=seq)
            if self.expected is not None and seq < self.expected:
                return
            if seq > 0 and self.expected is None:
                self._lost_history(0, seq)
            self.handle(seq, payload)
            return
        self.last_live = seq
        exp = self.expected
        if exp is None:
            if self.replay_endpoint:
                await self.replay(0, upto=seq)
            if self.expected is not None and seq < self.expected:
                return
            if seq > (self.expected or 0):
                self._lost_history(self.expected or 0, seq)
            self.handle(seq, payload)
            return
        if seq == exp:
            self.handle(seq, payload)
            return
        if seq < exp:  # already applied through a replay
            self.duplicates += 1
            return
        self.gaps += 1
        BRIDGE_GAPS.inc()
        if self.replay_endpoint:
            await self.replay(exp, upto=seq)
        if self.expected is not None and seq < self.expected:
            return  # the replay covered it
        if self.expected is not None and self.expected != seq:
            self._unrecovered(self.expected, seq)
        self.handle(seq, payload)

    def _lost_history(self, first_missing: int, seq: int) -> None:
        """Nothing applied yet and the engine's history starts past ``first_missing``: the
        blocks those batches stored cannot be keyed (their children count unknown_parent)."""
        self.rt.bad("seq_gap_unrecovered", f"engine batches {first_missing}..{seq - 1} lost")
        self.rt.new_instance("lost_history")

    def _unrecovered(self, first_missing: int, seq: int) -> None:
        self.rt.bad("seq_gap_unrecovered", f"engine batches {first_missing}..{seq - 1} lost")
        self.reset("unrecovered_gap")

    async def replay(self, start: int, upto: int | None = None) -> bool:
        """Ask the engine for batches ``start..`` and apply them in order. A reply that does
        not continue what was applied (the buffer no longer holds the missing batches)
        resets the view and goes on from there. False when the replay failed."""
        self.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got = 0
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
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
                exp = self.expected if self.expected is not None else 0
                if seq < exp:
                    continue
                if seq > exp:
                    if self.expected is None:
                        self._lost_history(exp, seq)
                    else:
                        self._unrecovered(exp, seq)
                self.handle(seq, payload)
                got += 1
            BRIDGE_REPLAYS.labels("ok").inc()
            if got:
                log.info(
                    "replayed engine batches", worker_id=self.rt.worker_id, start=start, got=got
                )
            return True
        except (TimeoutError, zmq.ZMQError) as exc:
            self.replay_failures += 1
            BRIDGE_REPLAYS.labels("failed").inc()
            self.rt.bad("replay_failed", str(exc))
            return False
        finally:
            sock.close(linger=0)

    async def resync_from_start(self, reason: str | None) -> None:
        """Replay the engine's whole buffer into an empty view (start, engine restart)."""
        if reason is not None:
            self.reset(reason)
            self.last_live = -1
        if self.replay_endpoint:
            await self.replay(0)

    # ------------------------------------------------------------------ loop
    async def run(self, stop: asyncio.Event) -> None:
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.bind:
            sub.bind(self.endpoint)
            self.bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sub.connect(self.endpoint)
        self.subscribed.set()
        stopper = asyncio.create_task(stop.wait())
        restart = asyncio.create_task(self.rt.restart_detected.wait())
        try:
            # live batches wait in the SUB queue while the block size is read and history
            # replayed (then they are deduplicated by seq)
            if not await self.rt.wait_block_size(stop):
                return
            await self.resync_from_start(None)
            self.rt.mark_ready()
            last_msg = time.monotonic()
            while not stop.is_set():
                recv = asyncio.ensure_future(sub.recv_multipart())
                timeout = self.tail_check_s if self.replay_endpoint else None
                done, _ = await asyncio.wait(
                    {recv, stopper, restart}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if recv not in done:
                    recv.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await recv
                    if stopper in done:
                        break
                    if restart in done:
                        self.rt.restart_detected.clear()
                        restart = asyncio.create_task(self.rt.restart_detected.wait())
                        await self.resync_from_start("engine_restarted")
                    elif time.monotonic() - last_msg >= self.tail_check_s:
                        # idle: anything the engine published that we did not receive?
                        await self.replay(self.expected or 0)
                        last_msg = time.monotonic()
                    continue
                last_msg = time.monotonic()
                parsed = parse_live(recv.result())
                if parsed is None:
                    self.rt.bad("invalid_frame", "expected [topic, seq, payload]")
                    continue
                _, seq, payload = parsed
                await self.on_message(seq, payload)
        finally:
            stopper.cancel()
            restart.cancel()
            sub.close(linger=0)
