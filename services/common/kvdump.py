"""Full KV-cache dumps of any size over NATS: request/reply with continuation.

A worker (simulated or behind a bridge) answers ``workers.kvdump.<worker>``; the indexer
fetches a dump when it resynchronises a worker and when it verifies the index.

Protocol (wire types in services.common.schemas):

1. The requester sends ``KvDumpRequest(worker_id, max_chunk_bytes=<its max_payload>)``.
   The responder takes the worker's cache *at once* (no await between reading the state and
   the batch seq: the dump is exactly the state after batch ``kv_seq``), keeps it under a new
   ``dump_id`` and answers chunk 0 as a ``KvDumpChunk``.
2. While ``next_cursor`` is not None the requester asks
   ``KvDumpRequest(dump_id=..., cursor=next_cursor)`` for the next chunk.
3. The requester checks every chunk belongs to the same dump and instance, in order, and that
   the keys received add up to ``blocks``; anything else raises :class:`DumpError`.

Why this design (and not a JetStream stream or an object-store bucket): each chunk is one
ordinary request/reply, so the requester paces the transfer (no slow-consumer drops however
slow it is), a lost chunk is one retry of one request, and nothing is left behind on the
server to clean up; JetStream would store (and replicate) tens of MB per dump for a transfer
that has exactly one reader. The price is one round trip per chunk (~1 MB), negligible next
to encoding.

Invariants:
- every chunk, encoded, is at most ``min(requester's max_chunk_bytes, responder's
  max_payload) - HEADROOM`` bytes, so it always fits in one NATS message;
- a frozen dump is dropped when its last chunk is sent, or when a request finds it idle
  for ``ttl_s``; at most ``max_open`` are kept (the oldest goes first): memory is bounded;
- a request for an unknown or expired ``dump_id`` raises in the responder, which
  :meth:`Bus.serve` turns into an error reply (the requester sees RemoteError);
- a bridge that lost engine history says so in every chunk (``history_lost``, read together
  with the cache): such a dump is the bridge's view, not the engine's cache, and a check
  that finds the index equal to it is ``unknown``, never ``equal``
  (services.kv_indexer.verifier.qualify_check).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import (
    EngineHistoryLost,
    KvDumpChunk,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    decode,
    encode,
)

log = get_logger("kvdump")

HEADROOM = 4096  # NATS headers and framing around a chunk's msgpack
_EVENT_OVERHEAD = 96  # upper bound of one event's msgpack bytes besides its keys
_KEY_BYTES = 9  # a uint64 in msgpack

DumpSource = Callable[[KvDumpRequest], Awaitable[KvEventBatch]]
HistorySource = Callable[[], EngineHistoryLost | None]


class DumpError(RuntimeError):
    """A dump came back incomplete, out of order or mixed with another dump."""


def _keys_of(ev: Any) -> list[int] | None:
    return getattr(ev, "keys", None)


def split_events(events: list[KvEvent], max_keys: int) -> list[KvEvent]:
    """Events with at most ``max_keys`` keys each, same order and meaning: a long stored
    chain is cut into consecutive parts, each part's parent the last key of the one before."""
    out: list[KvEvent] = []
    for ev in events:
        keys = _keys_of(ev)
        if keys is None or len(keys) <= max_keys:
            out.append(ev)
            continue
        has_parent = hasattr(ev, "parent_key")
        for i in range(0, len(keys), max_keys):
            part = keys[i : i + max_keys]
            if has_parent:
                parent = ev.parent_key if i == 0 else keys[i - 1]  # type: ignore[union-attr]
                out.append(msgspec.structs.replace(ev, keys=part, parent_key=parent))
            else:
                out.append(msgspec.structs.replace(ev, keys=part))
    return out


def count_blocks(events: list[KvEvent]) -> int:
    """Keys named by ``events`` (what ``KvDumpChunk.blocks`` counts)."""
    return sum(len(k) for ev in events if (k := _keys_of(ev)) is not None)


@dataclass
class FrozenDump:
    """One worker's cache as of batch ``batch.seq``, cut into pieces that each fit a chunk."""

    dump_id: str
    batch: KvEventBatch
    pieces: list[KvEvent]
    blocks: int
    limit: int
    last_used: float
    history_lost: EngineHistoryLost | None = None


@dataclass
class KvDumpServer:
    """Answers one worker's ``workers.kvdump.<worker>`` requests chunk by chunk.

    ``source`` returns the worker's whole cache as a KvEventBatch whose ``seq`` is the last
    batch the cache reflects; it must not await between reading the cache and the seq.
    ``history_lost`` (bridges) is read right after it, with no await between, so it
    describes exactly the cache dumped."""

    bus: Bus
    worker_id: str
    source: DumpSource
    history_lost: HistorySource | None = None
    ttl_s: float = 30.0
    max_open: int = 4
    clock: Callable[[], float] = time.monotonic
    dumps_started: int = 0
    chunks_sent: int = 0
    _open: OrderedDict[str, FrozenDump] = field(default_factory=OrderedDict)
    _sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.serve(
            self.bus.subjects.kv_dump(self.worker_id), KvDumpRequest, self.respond
        )

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # connection already closed: nothing left to undo
                log.debug("kvdump unsubscribe failed", error=repr(exc))
            self._sub = None
        self._open.clear()

    def _limit(self, req: KvDumpRequest) -> int:
        server = self.bus.client.max_payload
        asked = req.max_chunk_bytes or server
        return max(1024, min(asked, server) - HEADROOM)

    def _expire(self, now: float) -> None:
        for dump_id in [d for d, fd in self._open.items() if now - fd.last_used > self.ttl_s]:
            del self._open[dump_id]
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)

    async def respond(self, req: KvDumpRequest) -> bytes:
        now = self.clock()
        self._expire(now)
        if req.dump_id is None:
            batch = await self.source(req)
            lost = self.history_lost() if self.history_lost is not None else None
            limit = self._limit(req)
            max_keys = max(1, (limit - 2 * _EVENT_OVERHEAD) // _KEY_BYTES)
            pieces = split_events(batch.events, max_keys)
            fd = FrozenDump(
                uuid.uuid4().hex[:16], batch, pieces, count_blocks(pieces), limit, now, lost
            )
            self._open[fd.dump_id] = fd
            self._expire(now)
            self.dumps_started += 1
            # the background verifier dumps every worker now and then: not worth a line each
            emit = log.debug if req.reason == "verify" else log.info
            emit(
                "kv dump started",
                worker=self.worker_id,
                reason=req.reason,
                blocks=fd.blocks,
                kv_seq=batch.seq,
            )
            cursor = 0
        else:
            fd_or_none = self._open.get(req.dump_id)
            if fd_or_none is None:
                raise DumpError(f"unknown or expired dump id {req.dump_id!r}: start a new dump")
            fd = fd_or_none
            fd.last_used = now
            cursor = req.cursor
            if cursor > len(fd.pieces):
                raise DumpError(f"cursor {cursor} past the dump's end ({len(fd.pieces)})")
        data, next_cursor = self._chunk(fd, cursor)
        self.chunks_sent += 1
        if next_cursor is None:
            self._open.pop(fd.dump_id, None)
        return data

    def _chunk(self, fd: FrozenDump, cursor: int) -> tuple[bytes, int | None]:
        """Encode the pieces from ``cursor`` that fit in ``fd.limit`` bytes (at least one)."""
        pieces = fd.pieces
        budget = fd.limit - 512  # the chunk's own fields
        end = cursor
        size = 0
        while end < len(pieces):
            keys = _keys_of(pieces[end])
            size += _EVENT_OVERHEAD + (_KEY_BYTES * len(keys) if keys is not None else 0)
            if size > budget and end > cursor:
                break
            end += 1
        while True:
            next_cursor = end if end < len(pieces) else None
            data = encode(
                KvDumpChunk(
                    worker_id=fd.batch.worker_id,
                    instance_id=fd.batch.instance_id,
                    dump_id=fd.dump_id,
                    kv_seq=fd.batch.seq,
                    cursor=cursor,
                    next_cursor=next_cursor,
                    blocks=fd.blocks,
                    ts=fd.batch.ts,
                    events=pieces[cursor:end],
                    history_lost=fd.history_lost,
                )
            )
            if len(data) <= fd.limit or end - cursor <= 1:
                return data, next_cursor
            end = cursor + (end - cursor) // 2  # the estimate was short (unusual fields)


@dataclass
class FetchedDump:
    """A complete dump as one KvEventBatch (``seq`` = the dump's ``kv_seq``) and its cost."""

    batch: KvEventBatch
    blocks: int
    chunks: int
    bytes: int
    seconds: float
    history_lost: EngineHistoryLost | None = None


async def fetch_kvdump(
    bus: Bus,
    worker_id: str,
    *,
    reason: str = "",
    chunk_timeout_s: float = 5.0,
    max_chunk_bytes: int | None = None,
) -> FetchedDump:
    """Fetch ``worker_id``'s whole cache, chunk by chunk. Raises TimeoutError (no responder
    or a chunk did not come), RemoteError (the responder refused), SchemaError (a chunk did
    not decode) or DumpError (chunks inconsistent or missing blocks)."""
    subject = bus.subjects.kv_dump(worker_id)
    limit = max_chunk_bytes or bus.client.max_payload
    t0 = time.perf_counter()
    data = await bus.request_bytes(
        subject,
        KvDumpRequest(worker_id=worker_id, reason=reason, max_chunk_bytes=limit),
        timeout=chunk_timeout_s,
    )
    first: KvDumpChunk = decode(KvDumpChunk, data)
    if first.worker_id != worker_id or first.cursor != 0:
        raise DumpError(f"first chunk names worker {first.worker_id!r}, cursor {first.cursor}")
    events: list[KvEvent] = list(first.events)
    chunks = 1
    nbytes = len(data)
    chunk = first
    while chunk.next_cursor is not None:
        cursor = chunk.next_cursor
        data = await bus.request_bytes(
            subject,
            KvDumpRequest(
                worker_id=worker_id,
                reason=reason,
                dump_id=first.dump_id,
                cursor=cursor,
                max_chunk_bytes=limit,
            ),
            timeout=chunk_timeout_s,
        )
        chunk = decode(KvDumpChunk, data)
        if (
            chunk.dump_id != first.dump_id
            or chunk.instance_id != first.instance_id
            or chunk.cursor != cursor
            or (chunk.next_cursor is not None and chunk.next_cursor <= cursor)
        ):
            raise DumpError(
                f"chunk of dump {chunk.dump_id} at cursor {chunk.cursor} does not continue "
                f"dump {first.dump_id} at cursor {cursor}"
            )
        events.extend(chunk.events)
        chunks += 1
        nbytes += len(data)
    got = count_blocks(events)
    if got != first.blocks:
        raise DumpError(f"dump {first.dump_id} announced {first.blocks} blocks, got {got}")
    batch = KvEventBatch(
        worker_id=first.worker_id,
        instance_id=first.instance_id,
        seq=first.kv_seq,
        ts=first.ts,
        events=events,
    )
    return FetchedDump(batch, got, chunks, nbytes, time.perf_counter() - t0, first.history_lost)
