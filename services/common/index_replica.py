"""IndexReplica: a router's local copy of the global prefix index, kept in sync over NATS.

Protocol (see docs/kv-index.md): subscribe to ``kv.index.delta`` first and buffer; request a
snapshot on ``kv.index.snapshot`` (the indexer replies with SnapshotChunk messages to our
inbox, ``window_chunks`` at a time, at most two windows in flight); load it; apply buffered
deltas with ``seq`` above the snapshot's ``delta_seq``; then apply deltas live. A delta of
another epoch (indexer restarted) or a seq gap triggers a new snapshot; while none can be had
the replica keeps what it has and retries with backoff.

Invariants:
- ``index`` is the same PrefixIndex object for the replica's life (a snapshot is loaded into
  a fresh index step by step, letting the event loop run, and then adopted in place), so a
  router may hold a reference to it;
- after ``ready`` is set, the index equals the indexer's state as of delta ``delta_seq``;
- ``start()`` returns within ``start_timeout_s`` whether or not an indexer answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import nats.errors
from prometheus_client import Counter

from services.common.aio import cancel_and_wait, wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    IndexCleared,
    IndexDelta,
    IndexEvicted,
    IndexOp,
    IndexRemoved,
    IndexStored,
    SchemaError,
    SnapshotChunk,
    SnapshotRequest,
    decode,
    encode,
)
from services.core import cindex
from services.core.index import IndexState, PrefixIndex
from services.core.index_common import LOAD_STEP_ROWS
from services.core.snapshot import chunks_to_state

log = get_logger("kv_replica")

REPLICA_SNAPSHOTS = Counter(
    "kvgate_index_replica_snapshots_total", "Snapshots loaded by index replicas", ["result"]
)
REPLICA_GAPS = Counter(
    "kvgate_index_replica_resyncs_total",
    "Re-snapshots triggered by a delta gap or a new indexer epoch",
    ["reason"],
)
REPLICA_BAD = Counter("kvgate_index_replica_bad_deltas_total", "Undecodable index deltas")


def apply_ops(index: PrefixIndex, ops: list[IndexOp]) -> None:
    """Apply journaled index ops in order (what the indexer did, replayed)."""
    for op in ops:
        t = type(op)
        if t is IndexStored:
            index.apply_stored(op.worker_id, op.keys, op.tier)
        elif t is IndexRemoved:
            index.apply_removed(op.worker_id, op.keys, op.tier)
        elif t is IndexCleared:
            index.clear_worker(op.worker_id)
        elif t is IndexEvicted:
            index.remove_keys(op.keys)


# chunks asked for at a time: two windows of 16 chunks of the default 1 MB max_payload stay
# well under the server's per-connection pending limit (64 MB by default), past which a replica
# too busy to read (a router loading on a loaded host) is disconnected as a slow consumer, for
# good: every retry asked for the whole snapshot at once again
WINDOW_CHUNKS = 16


class NoIndexer(Exception):
    """No indexer answered the snapshot request."""


class IndexReplica:
    def __init__(
        self,
        bus: Bus,
        replica_id: str | None = None,
        start_timeout_s: float = 3.0,
        chunk_timeout_s: float = 2.0,
        retry_max_s: float = 5.0,
        max_buffered: int = 100_000,
        max_chunk_bytes: int | None = None,
        min_resnapshot_s: float = 0.1,
        window_chunks: int = WINDOW_CHUNKS,
        load_step_rows: int = LOAD_STEP_ROWS,
    ) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.window_chunks = window_chunks
        self.load_step_rows = load_step_rows
        self.min_resnapshot_s = min_resnapshot_s
        self.bus = bus
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.index = PrefixIndex()
        self.ready = asyncio.Event()
        self.epoch: str | None = None
        self.delta_seq = -1
        self.start_timeout_s = start_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.retry_max_s = retry_max_s
        self.max_buffered = max_buffered
        self.snapshots = 0
        self.resyncs = 0
        self.deltas_applied = 0
        self.last_snapshot_s: float | None = None
        self._buffer: list[IndexDelta] | None = []  # buffering until the first snapshot
        self._want = asyncio.Event()
        self._attempted = asyncio.Event()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._maint: asyncio.Task[None] | None = None
        self._log = RateLimiter(60.0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if not isinstance(self.index, cindex.CPrefixIndex):
            log.info(
                "compiled index core off: prefix lookups use the pure-Python index (slower)",
                built=cindex.AVAILABLE,
            )
        subj = self.bus.subjects.kv_index_delta
        self._sub = await self.bus.client.subscribe(subj, cb=self._on_delta)
        self._want.set()
        self._task = asyncio.create_task(self._sync_loop(), name="index-replica-sync")
        self._maint = asyncio.create_task(self._maintain_loop(), name="index-replica-maint")
        await wait_event(self._attempted, self.start_timeout_s)  # the first attempt's outcome
        if not self.ready.is_set():
            log.warning(
                "no index snapshot yet; starting empty, will catch up", replica=self.replica_id
            )

    async def stop(self) -> None:
        await cancel_and_wait(t for t in (self._task, self._maint) if t is not None)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready.is_set(),
            "epoch": self.epoch,
            "delta_seq": self.delta_seq,
            "blocks": len(self.index),
            "workers": len(self.index.workers()),
            "snapshots": self.snapshots,
            "resyncs": self.resyncs,
            "last_snapshot_s": self.last_snapshot_s,
        }

    # ------------------------------------------------------------------ deltas
    def _request_snapshot(self, reason: str) -> None:
        if self._buffer is None:
            self._buffer = []
        if not self._want.is_set():
            self.resyncs += 1
            REPLICA_GAPS.labels(reason).inc()
            if self._log.allow(reason):
                log.info("index replica re-snapshot", reason=reason, replica=self.replica_id)
            self._want.set()

    async def _on_delta(self, msg: Any) -> None:
        try:
            delta: IndexDelta = decode(IndexDelta, msg.data)
        except SchemaError as exc:
            REPLICA_BAD.inc()
            if self._log.allow("bad"):
                log.warning("bad index delta dropped", error=str(exc))
            return
        if self._buffer is not None:
            if len(self._buffer) >= self.max_buffered:
                self._buffer.clear()
                self._request_snapshot("buffer_overflow")
            self._buffer.append(delta)
            return
        self._apply_delta(delta)

    def _apply_delta(self, delta: IndexDelta) -> None:
        if delta.epoch != self.epoch:
            self._request_snapshot("new_epoch")
            self._buffer = [delta]  # type: ignore[list-item]
            return
        if delta.seq <= self.delta_seq:
            return
        if delta.seq != self.delta_seq + 1:
            self._request_snapshot("gap")
            self._buffer = [delta]  # type: ignore[list-item]
            return
        apply_ops(self.index, delta.ops)
        self.delta_seq = delta.seq
        self.deltas_applied += 1

    # ------------------------------------------------------------------ snapshots
    async def _sync_loop(self) -> None:
        backoff = 0.25
        while True:
            await self._want.wait()
            try:
                await self._snapshot_once()  # clears _want before replaying the buffer
                backoff = 0.25
                self._attempted.set()
                if self._want.is_set():
                    # the buffered deltas still run ahead of the snapshot (a delta was lost
                    # after it): give the indexer a moment to move past them, don't spin
                    await asyncio.sleep(self.min_resnapshot_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no indexer yet, timeout, bad chunk: retry later
                REPLICA_SNAPSHOTS.labels("failed").inc()
                if self._log.allow("snapshot_failed"):
                    log.info("index snapshot unavailable, retrying", error=str(exc) or repr(exc))
                self._attempted.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max_s)

    async def fetch_chunks(self) -> list[SnapshotChunk]:
        nc = self.bus.client
        inbox = nc.new_inbox()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def on_chunk(msg: Any) -> None:
            queue.put_nowait(msg)

        sub = await nc.subscribe(inbox, cb=on_chunk)
        window = self.window_chunks
        subject = self.bus.subjects.kv_index_snapshot
        max_bytes = self.max_chunk_bytes or nc.max_payload
        try:
            req = SnapshotRequest(
                replica_id=self.replica_id, max_chunk_bytes=max_bytes, max_chunks=window
            )
            await nc.publish(subject, encode(req), reply=inbox)
            chunks: list[SnapshotChunk] = []
            total = None
            asked = window  # chunks asked for so far
            while total is None or len(chunks) < total:
                try:
                    async with asyncio.timeout(self.chunk_timeout_s):
                        msg = await queue.get()
                except TimeoutError:
                    raise NoIndexer("no snapshot reply in time") from None
                hdr = msg.headers or {}
                if hdr.get("Status") == "503" or (not msg.data and hdr):
                    raise NoIndexer("no indexer is serving snapshots")
                chunk: SnapshotChunk = decode(SnapshotChunk, msg.data)
                if chunk.error:
                    raise NoIndexer(chunk.error)
                if chunks and chunk.snapshot_id != chunks[0].snapshot_id:
                    continue  # not the snapshot being fetched
                chunks.append(chunk)
                total = chunk.chunks
                # two windows in flight: once the last one asked for is arriving, ask for the
                # next (an indexer that sends every chunk at once leaves window_end 0)
                if chunk.window_end and asked < total and len(chunks) > asked - window:
                    req = SnapshotRequest(
                        replica_id=self.replica_id,
                        max_chunk_bytes=max_bytes,
                        snapshot_id=chunk.snapshot_id,
                        first_chunk=asked,
                        max_chunks=window,
                    )
                    await nc.publish(subject, encode(req), reply=inbox)
                    asked += window
            return chunks
        finally:
            with contextlib.suppress(Exception, nats.errors.Error):
                await sub.unsubscribe()

    async def load(self, state: IndexState) -> None:
        """Make ``index`` equal ``state``: loaded step by step into a fresh index while this
        one keeps answering the router with its old content (10 M pairs at once held the
        event loop ~0.4 s), then taken over in one go."""
        fresh = PrefixIndex()
        for _ in fresh.load_steps(state, self.load_step_rows):
            await asyncio.sleep(0)
        self.index.adopt(fresh)

    async def _snapshot_once(self) -> None:
        if self._buffer is None:
            self._buffer = []
        t0 = time.perf_counter()
        chunks = await self.fetch_chunks()
        await self.load(chunks_to_state(chunks))  # raises on an incomplete / mixed snapshot
        first = chunks[0]
        self.epoch = first.epoch
        self.delta_seq = first.delta_seq
        buffered, self._buffer = self._buffer, None
        self._want.clear()
        for d in sorted(buffered, key=lambda d: (d.epoch != self.epoch, d.seq)):
            self._apply_delta(d)
            if self._buffer is not None:  # gap or new epoch inside the buffer: go again
                break
        self.snapshots += 1
        self.last_snapshot_s = time.perf_counter() - t0
        REPLICA_SNAPSHOTS.labels("ok").inc()
        self.ready.set()
        log.info(
            "index snapshot loaded",
            blocks=len(self.index),
            chunks=len(chunks),
            seconds=round(self.last_snapshot_s, 3),
            replica=self.replica_id,
        )

    async def _maintain_loop(self) -> None:
        """Scrub cleared workers from the dict in small steps between requests."""
        while True:
            await asyncio.sleep(0.05)
            self.index.maintain(32_768)
