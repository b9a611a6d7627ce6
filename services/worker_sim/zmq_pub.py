"""ZMQ publisher of one simulated worker in vLLM's exact wire format (see zmq_wire).

A PUB socket sends ``[topic, seq, payload]``; a ROUTER socket answers replay requests from a
bounded buffer of past batches. Sending never blocks the engine: batches go through an
asyncio queue to a sender task; the PUB socket drops at its high-water mark like vLLM's.

Invariant: ``seq`` increases by one per batch from 0; a batch dropped by the ``drop_kv``
fault is still buffered for replay (so a subscriber that sees the gap can recover it).
"""

from __future__ import annotations

import asyncio
from collections import deque

import zmq
import zmq.asyncio

from services.common.aio import cancel_and_wait
from services.common.logging import get_logger
from services.worker_sim.zmq_wire import END_SEQ, seq_bytes

log = get_logger("sim-worker.zmq")


class ZmqPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        buffer_steps: int = 10_000,
        replay_topic_frame: bool = False,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.replay_topic_frame = replay_topic_frame
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: asyncio.Queue[tuple[int, bytes, int]] = asyncio.Queue(maxsize=100_000)
        self._seq = -1
        self._tasks: list[asyncio.Task[None]] = []
        self.sent = 0
        self.dropped = 0

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._send_loop(), name="zmq-pub"))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="zmq-replay"))

    def publish(self, payload: bytes, copies: int = 1) -> int:
        """Queue one batch (``copies`` = 0 drops it on the wire, 2 duplicates it); its seq."""
        self._seq += 1
        self._buffer.append((self._seq, payload))
        try:
            self._queue.put_nowait((self._seq, payload, copies))
        except asyncio.QueueFull:
            self.dropped += 1
        return self._seq

    async def _send_loop(self) -> None:
        while True:
            seq, payload, copies = await self._queue.get()
            if copies == 0:
                self.dropped += 1
                continue
            for _ in range(copies):
                try:
                    await self._pub.send_multipart(
                        [self.topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK
                    )
                    self.sent += 1
                except zmq.Again:
                    self.dropped += 1

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request", frames=len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    if self.replay_topic_frame:
                        msg = [client, b"", self.topic, seq_bytes(seq), payload]
                    else:
                        msg = [client, b"", seq_bytes(seq), payload]
                    await self._replay.send_multipart(msg)
            if self.replay_topic_frame:
                await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])
            else:
                await self._replay.send_multipart([client, b"", END_SEQ, b""])

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
