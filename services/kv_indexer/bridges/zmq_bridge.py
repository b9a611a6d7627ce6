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
  repeats one), or below the next expected seq with content other than the batch applied
  under that seq: the engine restarted, even when its first batches were lost;
- ``engine_restarted``: the engine's start time changed (runtime.probe_engine);
- ``replay_mismatch``: filling a gap, the engine's copy of the last applied batch differs
  from the one applied: a new engine process whose seq already passed ours;
- ``unrecovered_gap``: a gap the replay cannot fill (the buffer no longer holds it): what the
  lost batches removed would stay indexed forever, so the view is rebuilt from what the
  engine still has;
- ``lost_history``: at start (or after a reset) the replay begins past seq 0: the engine's
  earliest batches are gone (short replay buffer); the blocks they stored cannot be keyed.

History lost (``lost_history``, ``unrecovered_gap``, or batches missing after an engine restart
with no replay to fill them) is recorded in the runtime's history ledger, with the engine seq
the view starts at and why the replay could not help; every dump says so until the view is
whole again (see runtime, history). A loss caused by a replay that *failed* (timeout, socket
error) rather than by a short buffer may be recoverable: while idle, every
``history_recheck_s`` (doubling after each failure) the bridge asks the replay from seq 0
again, and if the engine still holds every batch from 0 it rebuilds its view from them (a
new instance, counted ``history_recovered``) and the loss is gone.

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

import xxhash
import zmq
import zmq.asyncio

from services.common.logging import get_logger
from services.kv_indexer.bridges.engine_formats import EngineFormatError, VllmDecoder
from services.kv_indexer.bridges.history import LossReason
from services.kv_indexer.bridges.runtime import BRIDGE_GAPS, BRIDGE_REPLAYS, BridgeRuntime

log = get_logger("bridge.zmq")


RECENT_BATCHES = 4096  # digests kept to tell a replayed duplicate from a new process's batch
# batches before a replay's start compared with the engine's copies (a new process whose seq
# reached ours is told by its different batches; two, because one may already be its own)
VERIFY_BATCHES = 2


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


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
        history_recheck_s: float = 30.0,
    ) -> None:
        self.rt = runtime
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.bind = bind
        self.tail_check_s = tail_check_s
        self.history_recheck_s = history_recheck_s  # 0: never re-ask after a failed replay
        self._recheck_at: float | None = None  # monotonic time of the next re-ask from 0
        self._recheck_delay = history_recheck_s
        self._last_fetch_failed = False
        self.history_rechecks = 0
        self.decoder = VllmDecoder()
        self.expected: int | None = None  # next engine seq (None: nothing applied yet)
        self.recent: dict[int, int] = {}  # seq -> payload digest of recently applied batches
        self.last_live = -1  # highest seq received on the live socket (this engine process)
        self.view_from = 0  # engine seq of the first batch in the current view
        self.replay_note = ""  # what the last replay request found (why a gap stayed open)
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
        if self.expected is None:
            self.view_from = seq
        self.expected = seq + 1
        d = _digest(payload)
        recent = self.recent
        recent[seq] = d
        if len(recent) > RECENT_BATCHES:
            del recent[next(iter(recent))]
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
        self.recent.clear()
        self._recheck_at = None  # a new view owes nothing to the old one's losses

    async def on_message(self, seq: int, payload: bytes) -> None:
        exp = self.expected
        # a PUB socket never repeats a seq; below the next expected one, only a batch a replay
        # already gave us under that seq may come again: otherwise a new engine process
        backwards = seq <= self.last_live or (
            exp is not None and seq < exp and self.recent.get(seq) != _digest(payload)
        )
        if backwards:
            self.last_live = seq
            self.reset("seq_backwards")
            if self.replay_endpoint:
                await self.replay(0)
            if self.expected is not None and seq < self.expected:
                return
            if seq > (self.expected or 0):  # the new process's first batches are gone
                first = self.expected or 0
                self.rt.bad("seq_gap_unrecovered", f"engine batches {first}..{seq - 1} lost")
                fresh = self.expected is None
                self._lose(
                    "lost_history" if fresh else "unrecovered_gap",
                    first,
                    seq - 1,
                    seq if fresh else self.view_from,
                )
            self.handle(seq, payload)
            return
        self.last_live = seq
        exp = self.expected
        if exp is None:
            if self.replay_endpoint:
                await self.replay(0)
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
            await self.replay(exp)
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
        self._recheck_at = None
        self._lose("lost_history", first_missing, seq - 1, seq)

    def _unrecovered(self, first_missing: int, seq: int) -> None:
        self.rt.bad("seq_gap_unrecovered", f"engine batches {first_missing}..{seq - 1} lost")
        self.reset("unrecovered_gap")
        self._lose("unrecovered_gap", first_missing, seq - 1, seq)

    def _lose(self, reason: LossReason, first: int, last: int, view_from: int) -> None:
        """Record lost engine batches ``first..last``; when a failed replay (not a short
        buffer) lost them, re-ask the replay from 0 later (:meth:`recheck_history`)."""
        self.rt.history_lost(reason, first, last, view_from, self._why())
        if self._last_fetch_failed and self.replay_endpoint and self.history_recheck_s > 0:
            self._recheck_delay = self.history_recheck_s
            self._recheck_at = time.monotonic() + self._recheck_delay

    async def recheck_history(self) -> bool:
        """Re-ask the engine's replay from seq 0 after a failed replay lost history. When
        the engine still holds every batch from 0 on, rebuild the view from them (a new
        instance: the index takes the whole view again) and the loss is gone: True. A
        reply that starts past 0 proves nothing more: the loss stands and is not re-asked;
        a failed reply is re-asked after twice the delay."""
        self.history_rechecks += 1
        frames = await self._fetch(0)
        if frames is None:
            self._recheck_delay = min(self._recheck_delay * 2, 8 * self.history_recheck_s)
            self._recheck_at = time.monotonic() + self._recheck_delay
            return False
        self._recheck_at = None
        if not frames or frames[0][0] != 0:
            return False
        self.reset("history_recovered")
        self._apply(frames, 0)
        recovered = self.rt.history.lost is None
        if recovered:
            log.info(
                "engine history recovered from its replay",
                worker_id=self.rt.worker_id,
                batches=len(frames),
            )
        return recovered

    def _why(self) -> str:
        """Why a gap could not be filled, for the operator reading ``index verify``."""
        if not self.replay_endpoint:
            return "the engine has no replay endpoint (--replay-endpoint)"
        return self.replay_note

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches from ``start`` (None when the replay failed)."""
        self.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
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
                if parsed[0] < 0:
                    break
                out.append(parsed)
            BRIDGE_REPLAYS.labels("ok").inc()
            self._last_fetch_failed = False
            if not out:
                self.replay_note = f"the engine's replay from seq {start} was empty"
            elif out[0][0] > start:
                self.replay_note = (
                    f"the engine's replay buffer no longer held them: asked from seq {start}, "
                    f"it began at seq {out[0][0]}"
                )
            else:
                self.replay_note = f"the engine's replay from seq {start} ended at {out[-1][0]}"
            return out
        except (TimeoutError, zmq.ZMQError) as exc:
            self.replay_failures += 1
            self._last_fetch_failed = True
            self.replay_note = f"the engine's replay failed: {exc!s}"[:200]
            BRIDGE_REPLAYS.labels("failed").inc()
            self.rt.bad("replay_failed", str(exc))
            return None
        finally:
            sock.close(linger=0)

    async def replay(self, start: int) -> bool:
        """Ask the engine for batches ``start..`` and apply them in order. False when the
        replay failed.

        Continuing an applied history, the request starts up to ``VERIFY_BATCHES`` batches
        earlier and those must be byte-identical to the ones applied: otherwise the engine is
        a new process whose seq has reached ours (its first batches lost), and the view is
        reset and replayed from 0. A reply that does not continue what was applied (the
        buffer no longer holds the missing batches) resets the view and goes on from there."""
        recent = self.recent
        first = start
        while first > 0 and start - first < VERIFY_BATCHES and (first - 1) in recent:
            first -= 1
        frames = await self._fetch(first)
        if frames is None:
            return False
        if any(seq < start and recent.get(seq) != _digest(p) for seq, p in frames):
            self.reset("replay_mismatch")
            frames = await self._fetch(0)
            if frames is None:
                return False
        self._apply(frames, start)
        return True

    def _apply(self, frames: list[tuple[int, bytes]], start: int) -> None:
        """Apply a replay's batches in order: those already applied are skipped, a first
        batch past the next expected one is lost history or an unrecovered gap."""
        got = 0
        for seq, payload in frames:
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
        if got:
            log.info("replayed engine batches", worker_id=self.rt.worker_id, start=start, got=got)

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
            if self.replay_endpoint:  # from 0 at start; after a pause, on from where we were
                await self.replay(self.expected or 0)
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
                    elif self.rt.engine_ok and time.monotonic() - last_msg >= self.tail_check_s:
                        # idle: anything the engine published that we did not receive?
                        await self.replay(self.expected or 0)
                        due = self._recheck_at
                        if due is not None and time.monotonic() >= due:
                            await self.recheck_history()  # a failed replay lost history
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
