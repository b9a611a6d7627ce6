"""The indexer's pure core: KV event batches + heartbeats -> PrefixIndex + ordered index ops.

No I/O: the shell (services.kv_indexer.app) feeds it decoded messages and the clock, performs
the resyncs it asks for (``workers.kvdump.<worker>`` request/reply) and publishes the ops it
journals as IndexDelta messages.

Invariants:
- Every change to ``index`` is journaled in ``ops`` in apply order, so a replica that applies
  the ops to a snapshot taken at any point between two :meth:`take_ops` calls ends up equal.
- Per worker and instance, batches apply in ``seq`` order exactly once: a seq at or below the
  last applied one is a duplicate (skipped, counted); a seq above the next one is a gap: the
  batch is held and the worker is resynchronised from a full dump (then the held batches above
  the dump's seq are applied). A heartbeat ``kv_seq`` ahead of the applied seq for longer
  than ``tail_grace_s`` is a tail gap and is resynchronised the same way.
- A worker is known only through heartbeats. Its blocks go when its heartbeats stop for
  ``heartbeat_timeout_s`` (the clock of that timeout stands still while the shell reports
  the bus down, :meth:`keep_alive`: no heartbeat can arrive then), when it sends
  AllBlocksCleared, and when a new ``instance_id`` (a restart) appears. Batches of unknown
  workers or of superseded instances are dropped.
- A resync replaces a worker's blocks by its dump through the *difference* (removed, then
  stored pairs), never a clear: replicas never see the worker empty in between, and a dump
  that agrees with the index costs no delta at all.
- Verification (:meth:`verify_begin` / :meth:`verify_check`) compares the index with a dump
  taken at batch seq S only once the worker's batches up to S are applied, replaying onto
  the dump the batches applied after S; anything that replaces the worker's state meanwhile
  (resync, restart, best-effort apply after a failed dump) makes the check inconclusive.
- Bad input is counted per reason (``on_bad(reason, worker, detail)``) and never applied
  partially in a way that breaks the invariants above; nothing here raises on bad input.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.common.schemas import (
    SCHEMA_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexCleared,
    IndexEvicted,
    IndexOp,
    IndexRemoved,
    IndexStored,
    KvEventBatch,
    KvQuery,
    KvQueryMatch,
    KvQueryReply,
    WorkerDivergence,
    WorkerHeartbeat,
)
from services.core.index import PrefixIndex
from services.core.keys import block_keys, block_seed
from services.kv_indexer.divergence import (
    apply_events,
    diff_gpu_keys,
    diff_pairs,
    gpu_dump_keys,
    gpu_replay,
    repair_steps,
)

BAD_REASONS = (
    "malformed_msgpack",
    "wrong_hash_type",
    "invalid_schema",
    "unsupported_version",
    "unknown_worker",
    "stale_instance",
    "block_size_mismatch",
    "unknown_parent",
)

_batch_decoder = msgspec.msgpack.Decoder(KvEventBatch)
_any_decoder = msgspec.msgpack.Decoder()


def decode_batch(raw: bytes | memoryview) -> KvEventBatch | tuple[str, str | None, str]:
    """A valid batch, or ``(reason, worker_id or None, detail)`` naming why not."""
    try:
        batch = _batch_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        worker = None
        try:
            obj = _any_decoder.decode(raw)
            if isinstance(obj, dict) and isinstance(obj.get("worker_id"), str):
                worker = obj["worker_id"][:128]
        except msgspec.DecodeError:
            pass
        reason = "invalid_schema"
        if "keys" in text or "parent_key" in text:
            reason = "wrong_hash_type"
        return reason, worker, text
    except msgspec.DecodeError as exc:
        return "malformed_msgpack", None, str(exc)
    if batch.v != SCHEMA_VERSION:
        return "unsupported_version", batch.worker_id, f"v={batch.v}"
    return batch


@dataclass
class WorkerState:
    worker_id: str
    instance_id: str
    block_size: int | None = None
    url: str = ""
    model: str = ""
    engine: str = ""
    state: str = "ready"
    last_seq: int = -1  # last applied batch seq of this instance (-1: none)
    last_hb: float = 0.0
    hb_kv_seq: int = -1
    tail_gap_since: float | None = None
    resyncing: bool = False
    retry_at: float | None = None
    retry_backoff_s: float = 1.0
    pending: list[KvEventBatch] = field(default_factory=list)
    old_instances: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=8)
    )
    batches: int = 0
    resyncs: int = 0
    gaps: int = 0
    # verification in progress: batches applied since it began (None: none running)
    verify_log: list[KvEventBatch] | None = None
    verify_aborted: str = ""


def _noop_bad(reason: str, worker: str | None, detail: str) -> None:
    return None


class IndexerCore:
    def __init__(
        self,
        max_blocks: int | None = None,
        heartbeat_timeout_s: float = 3.0,
        tail_grace_s: float = 2.0,
        hash_seed: int = 0,
        default_block_size: int = 16,
        on_bad: Callable[[str, str | None, str], None] = _noop_bad,
        max_pending: int = 10_000,
    ) -> None:
        self.index = PrefixIndex(max_blocks=max_blocks, record_evictions=True)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tail_grace_s = tail_grace_s
        self.hash_seed = hash_seed
        self.default_block_size = default_block_size
        self.on_bad = on_bad
        self.max_pending = max_pending
        self.workers: dict[str, WorkerState] = {}
        self.ops: list[IndexOp] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.now = 0.0  # latest clock reading seen (heartbeat / tick)
        self.eager_until = float("-inf")  # see bus_restored

    # ------------------------------------------------------------------ helpers
    def bad(self, reason: str, worker: str | None, detail: str) -> None:
        self.counts[f"bad:{reason}"] += 1
        self.on_bad(reason, worker, detail)

    def take_ops(self) -> list[IndexOp]:
        ops, self.ops = self.ops, []
        return ops

    def _clear(self, ws: WorkerState) -> None:
        self.index.clear_worker(ws.worker_id)
        self.ops.append(IndexCleared(worker_id=ws.worker_id))

    def _abort_verify(self, ws: WorkerState, why: str) -> None:
        if ws.verify_log is not None and not ws.verify_aborted:
            ws.verify_aborted = why

    def _restart(self, ws: WorkerState, instance_id: str) -> None:
        """A new instance: the old one's blocks are gone and its seq numbering with it."""
        self._abort_verify(ws, "the worker restarted")
        self._clear(ws)
        ws.old_instances.append(ws.instance_id)
        ws.instance_id = instance_id
        ws.last_seq = -1
        ws.hb_kv_seq = -1
        ws.pending.clear()
        ws.resyncing = False
        ws.retry_at = None
        ws.tail_gap_since = None
        self.counts["restarts"] += 1

    def _start_resync(self, ws: WorkerState, reason: str) -> list[str]:
        if ws.resyncing:
            return []
        ws.resyncing = True
        ws.retry_at = None
        ws.tail_gap_since = None
        self.counts[f"resync:{reason}"] += 1
        return [ws.worker_id]

    # ------------------------------------------------------------------ heartbeats
    def keep_alive(self, now: float) -> None:
        """The bus is down, so no heartbeat can arrive: keep every known worker (as the
        routers do) and forget tail gaps (a heartbeat will tell again when the bus is back)."""
        self.now = max(self.now, now)
        for ws in self.workers.values():
            ws.last_hb = max(ws.last_hb, now)  # a full timeout from the bus coming back
            ws.tail_gap_since = None

    def bus_restored(self, now: float) -> None:
        """The bus is back: batches published meanwhile are lost, so for the next heartbeat
        timeout a heartbeat ahead of the applied seq resyncs at once (no tail grace)."""
        self.eager_until = now + self.heartbeat_timeout_s

    def heartbeat(self, hb: WorkerHeartbeat, now: float) -> list[str]:
        """Register / refresh a worker. Returns workers to resynchronise (right after the bus
        came back: those whose heartbeat says batches were lost)."""
        self.now = max(self.now, now)
        ws = self.workers.get(hb.worker_id)
        if ws is None:
            ws = self.workers[hb.worker_id] = WorkerState(hb.worker_id, hb.instance_id)
            self.counts["registered"] += 1
        elif hb.instance_id != ws.instance_id:
            if hb.instance_id in ws.old_instances:
                self.bad("stale_instance", hb.worker_id, f"heartbeat of old {hb.instance_id}")
                return []
            self._restart(ws, hb.instance_id)
        ws.last_hb = now
        ws.hb_kv_seq = hb.kv_seq
        ws.block_size = hb.capacity.block_size
        ws.url, ws.model, ws.engine, ws.state = hb.url, hb.model, hb.engine, hb.state
        if now < self.eager_until and hb.kv_seq > ws.last_seq and ws.retry_at is None:
            ws.gaps += 1
            return self._start_resync(ws, "reconnect")
        return []

    def tick(self, now: float) -> list[str]:
        """Expire silent workers, spot tail gaps, retry failed resyncs."""
        self.now = max(self.now, now)
        out: list[str] = []
        for ws in list(self.workers.values()):
            if now - ws.last_hb > self.heartbeat_timeout_s:
                self._clear(ws)
                del self.workers[ws.worker_id]
                self.counts["expired"] += 1
                continue
            if ws.resyncing:
                continue
            if ws.retry_at is not None:
                if now >= ws.retry_at:
                    out += self._start_resync(ws, "retry")
                continue
            if ws.hb_kv_seq > ws.last_seq:
                if ws.tail_gap_since is None:
                    ws.tail_gap_since = now
                elif now - ws.tail_gap_since >= self.tail_grace_s:
                    ws.gaps += 1
                    out += self._start_resync(ws, "tail_gap")
            else:
                ws.tail_gap_since = None
        return out

    # ------------------------------------------------------------------ batches
    def batch(self, batch: KvEventBatch) -> list[str]:
        """Apply one batch (in seq order). Returns workers to resynchronise."""
        ws = self.workers.get(batch.worker_id)
        if ws is None:
            self.bad("unknown_worker", batch.worker_id, f"seq {batch.seq}, no heartbeat")
            return []
        if batch.instance_id != ws.instance_id:
            if batch.instance_id in ws.old_instances:
                self.bad("stale_instance", ws.worker_id, f"batch of old {batch.instance_id}")
                return []
            self._restart(ws, batch.instance_id)
        if ws.resyncing:
            if len(ws.pending) >= self.max_pending:
                ws.pending.pop(0)
            ws.pending.append(batch)
            return []
        expected = ws.last_seq + 1
        if batch.seq < expected:
            self.counts["duplicates"] += 1
            return []
        if batch.seq > expected:
            ws.gaps += 1
            ws.pending.append(batch)
            return self._start_resync(ws, "seq_gap")
        self._apply(ws, batch)
        ws.last_seq = batch.seq
        if ws.verify_log is not None:
            ws.verify_log.append(batch)
        return []

    def _store(self, w: str, keys: list[int], tier: Any) -> None:
        index = self.index
        index.apply_stored(w, keys, tier)
        self.ops.append(IndexStored(worker_id=w, keys=keys, tier=tier))
        if index.evicted:
            self.ops.append(IndexEvicted(keys=index.take_evicted()))

    def _accepts(self, ws: WorkerState, count: bool = True) -> Callable[[BlockStored], bool]:
        """The rule ``_apply`` stores by (the worker's block size), for dumps and checks."""

        def accept(ev: BlockStored) -> bool:
            if ws.block_size is not None and ev.block_size != ws.block_size:
                if count:
                    self.bad(
                        "block_size_mismatch",
                        ws.worker_id,
                        f"event block_size {ev.block_size} != worker's {ws.block_size}",
                    )
                return False
            return True

        return accept

    def _apply(self, ws: WorkerState, batch: KvEventBatch) -> None:
        w = ws.worker_id
        index = self.index
        ops = self.ops
        ws.batches += 1
        for ev in batch.events:
            t = type(ev)
            if t is BlockStored:
                if ws.block_size is not None and ev.block_size != ws.block_size:
                    self.bad(
                        "block_size_mismatch",
                        w,
                        f"event block_size {ev.block_size} != worker's {ws.block_size}",
                    )
                    continue
                if ev.parent_key is not None and not index.holds(w, ev.parent_key):
                    # chained keys are self-certifying: store them anyway, but count it
                    self.bad("unknown_parent", w, f"parent {ev.parent_key:#x} not held")
                index.apply_stored(w, ev.keys, ev.tier)
                ops.append(IndexStored(worker_id=w, keys=ev.keys, tier=ev.tier))
                if index.evicted:
                    ops.append(IndexEvicted(keys=index.take_evicted()))
            elif t is BlockRemoved:
                index.apply_removed(w, ev.keys, ev.tier)
                ops.append(IndexRemoved(worker_id=w, keys=ev.keys, tier=ev.tier))
            elif t is AllBlocksCleared:
                self._clear(ws)
        self.counts["batches"] += 1

    # ------------------------------------------------------------------ resync
    def dump_received(self, worker_id: str, dump: KvEventBatch) -> list[str]:
        """A full dump answered a resync: replace the worker's blocks, then apply what was
        held back above the dump's seq. Returns workers to resynchronise (again)."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return []
        ws.resyncing = False
        if dump.worker_id != worker_id:
            self.bad("invalid_schema", worker_id, f"dump names worker {dump.worker_id}")
            return self.dump_failed(worker_id, None)
        if dump.instance_id != ws.instance_id:
            if dump.instance_id in ws.old_instances:
                return self.dump_failed(worker_id, None)
            self._restart(ws, dump.instance_id)
        self._abort_verify(ws, "the worker was resynced")
        self._replace(ws, dump)
        ws.last_seq = dump.seq
        ws.resyncs += 1
        ws.retry_backoff_s = 1.0
        self.counts["resyncs"] += 1
        held, ws.pending = sorted(ws.pending, key=lambda b: b.seq), []
        out: list[str] = []
        for b in held:
            if b.instance_id == ws.instance_id:
                out += self.batch(b)
        return out

    def _replace(self, ws: WorkerState, dump: KvEventBatch) -> int:
        """Make the worker's pairs those of ``dump`` by their difference; returns the pairs
        that changed."""
        w = ws.worker_id
        accept = self._accepts(ws)
        fast = gpu_dump_keys(dump.events, accept)
        actual = self.index.gpu_keys_of(w) if fast is not None else None
        if fast is not None and actual is not None:
            diff = diff_gpu_keys(fast, actual)
        else:
            diff = diff_pairs(apply_events({}, dump.events, accept), self.index.pairs_of(w))
        for kind, tier, keys in repair_steps(diff):
            if kind == "removed":
                self.index.apply_removed(w, keys, tier)
                self.ops.append(IndexRemoved(worker_id=w, keys=keys, tier=tier))  # type: ignore[arg-type]
            else:
                self._store(w, keys, tier)
        ws.batches += 1
        return diff.blocks

    def dump_failed(self, worker_id: str, now: float | None) -> list[str]:
        """No dump came: apply what was held (best effort), retry later with backoff."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return []
        ws.resyncing = False
        self.counts["resync_failures"] += 1
        if ws.pending:
            self._abort_verify(ws, "batches applied past a gap")
        for b in sorted(ws.pending, key=lambda b: b.seq):
            if b.instance_id == ws.instance_id and b.seq > ws.last_seq:
                self._apply(ws, b)
                ws.last_seq = b.seq
        ws.pending.clear()
        ws.retry_at = (self.now if now is None else now) + ws.retry_backoff_s
        ws.retry_backoff_s = min(ws.retry_backoff_s * 2, 30.0)
        return []

    # ------------------------------------------------------------------ verification
    def verify_begin(self, worker_id: str) -> bool:
        """Start recording the worker's applied batches (before asking it for a dump)."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return False
        ws.verify_log = []
        ws.verify_aborted = ""
        return True

    def verify_end(self, worker_id: str) -> None:
        ws = self.workers.get(worker_id)
        if ws is not None:
            ws.verify_log = None
            ws.verify_aborted = ""

    def verify_check(
        self, worker_id: str, dump: KvEventBatch, max_sample: int = 10
    ) -> WorkerDivergence | None:
        """The index against ``dump`` (taken after verify_begin), or None when the index has
        not yet applied the worker's batches up to the dump's seq (check again later)."""

        def inconclusive(why: str) -> WorkerDivergence:
            return WorkerDivergence(
                worker_id=worker_id, status="inconclusive", kv_seq=dump.seq, detail=why
            )

        ws = self.workers.get(worker_id)
        if ws is None or ws.verify_log is None:
            return inconclusive("the worker is no longer registered")
        if dump.instance_id != ws.instance_id:
            return inconclusive("the dump is of another instance of the worker")
        if ws.verify_aborted:
            return inconclusive(ws.verify_aborted)
        if ws.resyncing:
            return inconclusive("a resync is in progress")
        if ws.last_seq < dump.seq:
            return None
        accept = self._accepts(ws, count=False)
        later: list[Any] = []
        want = dump.seq + 1
        for b in ws.verify_log:
            if b.seq <= dump.seq:
                continue
            if b.seq != want:
                return inconclusive(f"batch {want} was not applied in order")
            later.extend(b.events)
            want += 1
        if want != ws.last_seq + 1:
            return inconclusive("batches applied after the dump were not all recorded")
        fast = gpu_dump_keys(dump.events, accept)
        if fast is not None:
            fast = gpu_replay(fast, later, accept)
        actual_keys = self.index.gpu_keys_of(worker_id) if fast is not None else None
        if fast is not None and actual_keys is not None:
            diff = diff_gpu_keys(fast, actual_keys)
            worker_blocks, index_blocks = len(fast), len(actual_keys)
        else:
            expected = apply_events(apply_events({}, dump.events, accept), later, accept)
            actual = self.index.pairs_of(worker_id)
            diff = diff_pairs(expected, actual)
            worker_blocks, index_blocks = len(expected), len(actual)
        return WorkerDivergence(
            worker_id=worker_id,
            status="divergent" if diff.blocks else "equal",
            kv_seq=dump.seq,
            worker_blocks=worker_blocks,
            index_blocks=index_blocks,
            missing=len(diff.missing),
            extra=len(diff.extra),
            missing_sample=list(diff.missing)[:max_sample],
            extra_sample=list(diff.extra)[:max_sample],
        )

    def request_repair(self, worker_id: str) -> list[str]:
        """Resync a worker the verification found divergent."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return []
        self.counts["verify_repairs"] += 1
        return self._start_resync(ws, "verify")

    # ------------------------------------------------------------------ queries
    def query(self, q: KvQuery) -> KvQueryReply:
        if q.keys is not None:
            keys = q.keys
        elif q.token_ids is not None:
            bs = q.block_size or self.default_block_size
            try:
                keys = block_keys(q.token_ids, bs, block_seed(self.hash_seed, q.lora, q.salt))
            except OverflowError:
                return KvQueryReply(error="token ids must fit in uint32")
        else:
            return KvQueryReply(error="give token_ids or keys")
        matches = [
            KvQueryMatch(worker_id=w, matched_blocks=n, gpu_blocks=g, cpu_blocks=c, disk_blocks=d)
            for w, (n, g, c, d) in sorted(
                self.index.find_matches_by_tier(keys).items(), key=lambda kv: -kv[1][0]
            )
        ]
        return KvQueryReply(blocks=len(keys), matches=matches)

    def describe(self) -> list[dict[str, Any]]:
        """Per worker state for the operators' debug view."""
        return [
            {
                "worker_id": ws.worker_id,
                "instance_id": ws.instance_id,
                "engine": ws.engine,
                "model": ws.model,
                "url": ws.url,
                "state": ws.state,
                "block_size": ws.block_size,
                "blocks": self.index.blocks_of(ws.worker_id),
                "last_seq": ws.last_seq,
                "heartbeat_kv_seq": ws.hb_kv_seq,
                "resyncing": ws.resyncing,
                "pending_batches": len(ws.pending),
                "batches": ws.batches,
                "gaps": ws.gaps,
                "resyncs": ws.resyncs,
            }
            for ws in sorted(self.workers.values(), key=lambda w: w.worker_id)
        ]
