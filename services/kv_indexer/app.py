"""The kv_indexer service shell: NATS in and out, timers, HTTP. The logic is in core.py.

- KV events: durable JetStream push consumer on KV_EVENTS (ack-all at the end of each burst
  of messages, once its deltas are queued), so a restart resumes where it stopped; a
  restarted indexer rebuilds each worker's blocks by resyncing (full dump) as heartbeats
  show it.
- Heartbeats ``workers.heartbeat.*`` register workers; a timer expires them and spots gaps.
- Resyncs: ``workers.kvdump.<worker>`` chunked request/reply (services.common.kvdump),
  counted; a dump is applied as its difference with the index (no clear in between).
- While NATS is down no heartbeat can arrive, so workers are kept (the expiry clock stands
  still); when it is back, workers whose heartbeat shows lost batches resync at once.
- Verification (services.kv_indexer.verifier): ``kv.index.verify`` on request, and a
  background check paced to ``verify_cpu_share`` of a core that repairs what it finds; a
  repair is counted per worker and alerted once per incident (``index_repaired``, resolved
  after ``verify_alert_quiet_s`` without one).
- Deltas: ordered IndexDelta on ``kv.index.delta`` (one publisher task keeps the order);
  snapshots: SnapshotRequest on ``kv.index.snapshot`` answered with SnapshotChunk messages.
- Queries: ``kv.query`` (KvQuery -> KvQueryReply); HTTP /health, /metrics, /debug/workers,
  /debug/query.

Invariant: nothing that arrives from the bus can stop the service: every decode and handler
failure is counted (``kvgate_indexer_bad_input_total{reason}``) and logged at most once per
worker per minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Gauge, Histogram

from services.common import tracing
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.kvdump import fetch_kvdump
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    IndexDelta,
    IndexOp,
    IndexVerifyRequest,
    KvEventBatch,
    KvQuery,
    KvQueryReply,
    SchemaError,
    SnapshotChunk,
    SnapshotRequest,
    WorkerHeartbeat,
    decode,
    encode,
    now,
    to_builtins,
)
from services.common.streams import require_kv_events_stream
from services.core.snapshot import KeptSnapshots, error_chunk, state_to_chunks, window
from services.kv_indexer.core import IndexerCore, decode_batch
from services.kv_indexer.verifier import Verifier

log = get_logger("kv_indexer")

BAD_INPUT = Counter(
    "kvgate_indexer_bad_input_total", "KV inputs dropped or flagged, by reason", ["reason"]
)
BATCHES = Counter("kvgate_indexer_batches_total", "KV event batches received")
BLOCKS = Gauge("kvgate_indexer_blocks", "Stored (worker, block) pairs in the index")
KEYS = Gauge("kvgate_indexer_keys", "Distinct block keys in the index")
WORKERS = Gauge("kvgate_indexer_workers", "Workers registered by heartbeat")
EVICTED = Counter("kvgate_indexer_evicted_blocks_total", "Pairs pruned by the memory cap")
RESYNCS = Counter("kvgate_indexer_resyncs_total", "Worker resyncs (full dumps)", ["result"])
GAPS = Counter("kvgate_indexer_seq_gaps_total", "Sequence gaps seen (batch or heartbeat tail)")
DUPLICATES = Counter("kvgate_indexer_duplicate_batches_total", "Batches skipped as duplicates")
EXPIRED = Counter("kvgate_indexer_workers_expired_total", "Workers dropped: heartbeats stopped")
RESTARTS = Counter("kvgate_indexer_worker_restarts_total", "New instance ids seen")
DELTAS = Counter("kvgate_indexer_deltas_total", "Index deltas published")
SNAPSHOTS = Counter("kvgate_indexer_snapshots_total", "Snapshots served")
SNAPSHOTS_KEPT = 4  # snapshots being fetched in windows at once (more: the oldest restarts)
SNAPSHOT_KEEP_S = 30.0  # a windowed snapshot nobody asked for in this long is dropped
QUERIES = Counter("kvgate_indexer_queries_total", "kv.query requests answered")
APPLY_SECONDS = Histogram(
    "kvgate_indexer_burst_apply_seconds",
    "Time to apply one burst of stream messages (until the subscription queue drained)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)

MAX_DELTA_KEYS = 50_000  # keeps one delta well under 1 MB of msgpack


def split_ops(ops: list[IndexOp], max_keys: int = MAX_DELTA_KEYS) -> list[list[IndexOp]]:
    """Cut ops into groups of at most ~max_keys keys (a big op is cut too), order kept."""
    groups: list[list[IndexOp]] = []
    cur: list[IndexOp] = []
    n = 0
    for op in ops:
        keys = getattr(op, "keys", None)
        if keys is not None and len(keys) > max_keys:
            for i in range(0, len(keys), max_keys):
                part = msgspec.structs.replace(op, keys=keys[i : i + max_keys])
                if cur:
                    groups.append(cur)
                groups.append([part])
                cur, n = [], 0
            continue
        k = len(keys) if keys is not None else 1
        if n + k > max_keys and cur:
            groups.append(cur)
            cur, n = [], 0
        cur.append(op)
        n += k
    if cur:
        groups.append(cur)
    return groups


class IndexerService:
    def __init__(
        self,
        bus: Bus,
        *,
        max_blocks: int | None = 2_000_000,
        heartbeat_timeout_s: float = 3.0,
        tail_grace_s: float = 2.0,
        hash_seed: int = 0,
        default_block_size: int = 16,
        dump_timeout_s: float = 5.0,
        tick_s: float = 0.1,
        durable: str | None = None,
        ack_every: int = 512,  # ack-all every this many messages (and at each burst end)
        verify_cpu_share: float = 0.01,  # background verifier's share of a core (0: off)
        verify_alert_quiet_s: float = 300.0,  # a repair incident resolves after this quiet
        ha_id: str | None = None,  # join the namespace's HA group (services/kv_indexer/lease.py)
        lease_ttl_s: float = 1.5,
    ) -> None:
        self.bus = bus
        self.ack_every = ack_every
        self._log = RateLimiter(60.0)
        self.tracer = tracing.tracer("kvgate.indexer")  # None: tracing off
        self.core = IndexerCore(
            max_blocks=max_blocks,
            heartbeat_timeout_s=heartbeat_timeout_s,
            tail_grace_s=tail_grace_s,
            hash_seed=hash_seed,
            default_block_size=default_block_size,
            on_bad=self._on_bad,
        )
        self.epoch = uuid.uuid4().hex[:12]
        self.delta_seq = -1
        self.dump_timeout_s = dump_timeout_s
        self.tick_s = tick_s
        self.durable = durable or bus.subjects.durable(
            f"KV_INDEXER_PUSH_{ha_id}" if ha_id else "KV_INDEXER_PUSH"  # HA: one consumer each
        )
        # HA: a standby applies every event (a warm index) but publishes no delta and serves
        # no snapshot until it holds the lease; a lone indexer is always active
        self.active = ha_id is None
        self.lease = None
        if ha_id:
            from services.kv_indexer.lease import IndexerLease

            self.lease = IndexerLease(
                bus,
                ha_id,
                on_acquired=self._promote,
                on_lost=self._demote,
                ttl_s=lease_ttl_s,
                warm=self._warm,
            )
        self._started_at = time.monotonic()
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._out: asyncio.Queue[tuple[str, bytes, str | None]] = asyncio.Queue()
        self._snapshots = KeptSnapshots(SNAPSHOTS_KEPT, SNAPSHOT_KEEP_S)  # served in windows
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: list[Any] = []
        self._counted: dict[str, int] = {}
        self.consuming = asyncio.Event()
        self._psub: Any = None
        self._unacked: Any = None
        self._since_ack = 0
        self._burst_scheduled = False
        self._burst_t0: float | None = None
        self._bus_down = False
        self.verify_cpu_share = verify_cpu_share
        self.verifier = Verifier(
            bus,
            self.core,
            self._resync,
            cpu_share=verify_cpu_share or 0.01,
            chunk_timeout_s=dump_timeout_s,
            alert_quiet_s=verify_alert_quiet_s,
            indexer_name=ha_id or "indexer",
        )

    # ------------------------------------------------------------------ bad input
    def _on_bad(self, reason: str, worker: str | None, detail: str) -> None:
        BAD_INPUT.labels(reason).inc()
        key = (worker, reason)  # one line per worker and reason per minute, + suppressed count
        if self._log.allow(key):
            log.warning(
                "bad kv input",
                reason=reason,
                worker_id=worker,
                detail=detail[:300],
                suppressed=self._log.take_suppressed(key),
            )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.bus.subjects
        nc = self.bus.client
        await require_kv_events_stream(self.bus)
        self._tasks.append(asyncio.create_task(self._publisher(), name="indexer-publish"))
        self._subs.append(await nc.subscribe(s.heartbeat_all, cb=self._on_heartbeat))
        self._subs.append(await nc.subscribe(s.kv_index_snapshot, cb=self._on_snapshot))
        self._subs.append(await nc.subscribe(s.kv_query, cb=self._on_query))
        self._subs.append(
            await self.bus.serve(s.kv_index_verify, IndexVerifyRequest, self.verifier.verify)
        )
        if self.verify_cpu_share > 0:
            self._tasks.append(asyncio.create_task(self.verifier.run(), name="indexer-verify"))
        self._tasks.append(asyncio.create_task(self._consume(), name="indexer-consume"))
        self._tasks.append(asyncio.create_task(self._ticker(), name="indexer-tick"))
        if self.lease is not None:
            await self.lease.start()
        log.info("indexer started", epoch=self.epoch, durable=self.durable, active=self.active)

    async def stop(self) -> None:
        if self.lease is not None:
            await self.lease.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        self._flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._out.join(), timeout=2.0)
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
            self._psub = None

    # ------------------------------------------------------------------ output
    def _flush(self) -> None:
        """Journal -> numbered deltas, queued in order (no await between take and enqueue)."""
        ops = self.core.take_ops()
        if not ops or not self.active:
            return
        subject = self.bus.subjects.kv_index_delta
        ts = now()
        for group in split_ops(ops):
            self.delta_seq += 1
            delta = IndexDelta(epoch=self.epoch, seq=self.delta_seq, ts=ts, ops=group)
            self._out.put_nowait((subject, encode(delta), None))

    def _promote(self) -> None:
        """Lease won: a new epoch, announced at once by an empty delta, so every replica
        re-snapshots from this indexer (ops journaled before now are in that snapshot)."""
        self.core.take_ops()
        self.epoch = uuid.uuid4().hex[:12]
        self.delta_seq = 0
        self.active = True
        announce = IndexDelta(epoch=self.epoch, seq=0, ts=now(), ops=[])
        self._out.put_nowait((self.bus.subjects.kv_index_delta, encode(announce), None))
        log.info("indexer active", epoch=self.epoch)

    def _nats_server(self) -> str:
        """host:port of the NATS server this indexer is connected to now ('' when none)."""
        url = getattr(self.bus.nc, "connected_url", None)
        return f"{url.hostname}:{url.port}" if url is not None and url.hostname else ""

    def _warm(self) -> bool:
        """HA: whether this member's index is complete enough to publish from: it consumes the
        stream, it has run one heartbeat timeout (every live worker has been heard from), and
        every worker it knows is in sync (no resync running or due, every announced batch
        applied)."""
        if not self.consuming.is_set():
            return False
        if time.monotonic() - self._started_at < self._heartbeat_timeout_s:
            return False
        return all(
            not ws.resyncing and ws.retry_at is None and ws.last_seq >= ws.hb_kv_seq
            for ws in self.core.workers.values()
        )

    def _demote(self) -> None:
        self.active = False
        log.info("indexer standby", epoch=self.epoch)

    async def _publisher(self) -> None:
        nc = self.bus.client
        while True:
            subject, data, reply = await self._out.get()
            try:
                await nc.publish(subject, data, reply=reply or "")
                if subject == self.bus.subjects.kv_index_delta:
                    DELTAS.inc()
            except Exception as exc:  # disconnected: replicas will see a gap and re-snapshot
                if self._log.allow(("publish", subject)):
                    log.warning("publish failed", subject=subject, error=repr(exc))
            finally:
                self._out.task_done()

    # ------------------------------------------------------------------ inputs
    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            hb = decode(WorkerHeartbeat, msg.data)
        except SchemaError as exc:
            self.core.bad("invalid_heartbeat", msg.subject.rsplit(".", 1)[-1], str(exc))
            return
        self._resync(self.core.heartbeat(hb, time.monotonic()))
        WORKERS.set(len(self.core.workers))

    def on_batch_bytes(self, data: bytes) -> None:
        if self.tracer is None:
            self._apply_batch(data)
            return
        # one span per batch (a root: sampled at the configured ratio), current while it
        # applies: the log lines it causes carry its trace id
        with self.tracer.start_as_current_span(
            "indexer.apply_batch", attributes={"kvgate.batch_bytes": len(data)}
        ) as span:
            outcome, res = self._apply_batch(data)
            if span.is_recording():
                span.set_attribute("kvgate.outcome", outcome)
                if res is not None:
                    span.set_attributes(
                        {
                            "kvgate.worker": res.worker_id,
                            "kvgate.seq": res.seq,
                            "kvgate.events": len(res.events),
                        }
                    )

    def _apply_batch(self, data: bytes) -> tuple[str, KvEventBatch | None]:
        """Decode and apply one stored batch: ``applied``, ``resync`` (a gap: the worker's
        KV is fetched again) or why it was dropped; and the batch when it decoded."""
        BATCHES.inc()
        res = decode_batch(data)
        if isinstance(res, tuple):
            reason, worker, detail = res
            self.core.bad(reason, worker, detail)
            return reason, None
        try:
            gaps = self.core.batch(res)
            self._resync(gaps)
        except Exception as exc:  # a bug must not stop ingest; count it loudly
            self.core.bad("handler_error", res.worker_id, repr(exc))
            return "handler_error", res
        return ("resync" if gaps else "applied"), res

    async def _consume(self) -> None:
        """Bind the durable push consumer (retrying until JetStream answers).

        Push, not pull: nats-py's pull ``fetch`` costs a task per message (~17 k msgs/s
        here) while a push subscription with a callback runs ~100 k msgs/s. The server
        keeps at most ``max_ack_pending`` messages unacknowledged, which bounds our queue.
        """
        s = self.bus.subjects
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.ALL,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30.0,
            max_ack_pending=self.ack_every * 64,
        )
        while True:
            try:
                self._psub = await self.bus.js.subscribe(
                    s.kv_events_all,
                    durable=self.durable,
                    stream=s.kv_events_stream,
                    cb=self._on_js_msg,
                    manual_ack=True,
                    config=config,
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("consumer setup failed, retrying", error=repr(exc))
                await asyncio.sleep(0.5)
        self.consuming.set()

    async def _on_js_msg(self, msg: Any) -> None:
        """One stored KV batch. Messages queued on the subscription run back to back; when
        the burst ends, ``_end_burst`` publishes its deltas and acks (ack-all) the last one."""
        if self._burst_t0 is None:
            self._burst_t0 = time.perf_counter()
        self.on_batch_bytes(msg.data)
        self._unacked = msg
        self._since_ack += 1
        if self._since_ack >= self.ack_every:
            self._since_ack = 0
            self._unacked = None
            with contextlib.suppress(Exception):
                await msg.ack()
        if not self._burst_scheduled:
            self._burst_scheduled = True
            asyncio.get_running_loop().call_soon(self._end_burst)

    def _end_burst(self) -> None:
        self._burst_scheduled = False
        self._flush()
        if self._burst_t0 is not None:
            APPLY_SECONDS.observe(time.perf_counter() - self._burst_t0)
            self._burst_t0 = None
        self._update_gauges()
        last, self._unacked = self._unacked, None
        self._since_ack = 0
        if last is not None:
            task = asyncio.ensure_future(self._ack(last))
            self._tasks.append(task)

    @staticmethod
    async def _ack(msg: Any) -> None:
        with contextlib.suppress(Exception):
            await msg.ack()

    # ------------------------------------------------------------------ resync
    def _resync(self, workers: list[str]) -> None:
        for w in workers:
            GAPS.inc()
            self._tasks.append(asyncio.create_task(self._do_resync(w), name=f"resync:{w}"))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _do_resync(self, worker: str) -> None:
        try:
            fetched = await fetch_kvdump(
                self.bus, worker, reason="gap", chunk_timeout_s=self.dump_timeout_s
            )
            dump = fetched.batch
        except Exception as exc:  # timeout, refused, incomplete: retried with backoff
            RESYNCS.labels("failed").inc()
            if self._log.allow(("resync", worker)):
                log.warning("resync failed", worker_id=worker, error=str(exc) or repr(exc))
            self.core.dump_failed(worker, time.monotonic())
            self._flush()
            return
        RESYNCS.labels("ok").inc()
        log.info(
            "worker resynced",
            worker_id=worker,
            seq=dump.seq,
            blocks=fetched.blocks,
            chunks=fetched.chunks,
            bytes=fetched.bytes,
            seconds=round(fetched.seconds, 3),
        )
        self._resync(self.core.dump_received(worker, dump))
        self._flush()

    # ------------------------------------------------------------------ timers
    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                now = time.monotonic()
                if not self.bus.is_connected:
                    self._bus_down = True
                    self.core.keep_alive(now)  # no heartbeat can arrive: nobody expires
                elif self._bus_down:
                    self._bus_down = False
                    self.core.bus_restored(now)
                self._resync(self.core.tick(now))
                self.core.index.maintain(65_536)
                self._flush()
                self._update_gauges()
            except Exception as exc:  # pragma: no cover - defensive
                log.exception("indexer tick failed", error=repr(exc))

    def _update_gauges(self) -> None:
        idx = self.core.index
        BLOCKS.set(len(idx))
        KEYS.set(idx.num_keys)
        WORKERS.set(len(self.core.workers))
        for name, metric in (
            ("duplicates", DUPLICATES),
            ("expired", EXPIRED),
            ("restarts", RESTARTS),
        ):
            n = self.core.counts[name]
            if n > self._counted.get(name, 0):
                metric.inc(n - self._counted.get(name, 0))
                self._counted[name] = n
        if idx.evicted_pairs > self._counted.get("evicted", 0):
            EVICTED.inc(idx.evicted_pairs - self._counted.get("evicted", 0))
            self._counted["evicted"] = idx.evicted_pairs

    # ------------------------------------------------------------------ snapshots, queries
    def snapshot_chunks(self, max_chunk_bytes: int) -> list[SnapshotChunk]:
        """A consistent snapshot: pending ops are flushed first, so it sits exactly after
        delta ``delta_seq`` (no await between the flush and the export)."""
        self._flush()
        state = self.core.index.export_state()
        return state_to_chunks(
            state, self.epoch, uuid.uuid4().hex[:12], self.delta_seq, max_chunk_bytes
        )

    async def _on_snapshot(self, msg: Any) -> None:
        if not msg.reply or not self.active:
            return
        try:
            req = decode(SnapshotRequest, msg.data)
            if req.snapshot_id:  # the next window of a snapshot being fetched
                chunks = self._snapshots.get(req.snapshot_id, time.monotonic())
                if chunks is None:
                    err = error_chunk(
                        self.epoch,
                        req.snapshot_id,
                        self.delta_seq,
                        "snapshot no longer kept: request a new one",
                    )
                    self._out.put_nowait((msg.reply, encode(err), None))
                    return
            else:
                limit = min(req.max_chunk_bytes or (1 << 20), self.bus.client.max_payload)
                chunks = self.snapshot_chunks(limit)
                SNAPSHOTS.inc()
                if req.max_chunks:
                    self._snapshots.keep(chunks, time.monotonic())
        except Exception as exc:
            self._on_bad("invalid_snapshot_request", None, repr(exc))
            return
        for ch in window(chunks, req.first_chunk, req.max_chunks):
            self._out.put_nowait((msg.reply, encode(ch), None))

    async def _on_query(self, msg: Any) -> None:
        if not msg.reply:
            return
        try:
            q = decode(KvQuery, msg.data)
            reply = self.core.query(q)
        except SchemaError as exc:
            reply = KvQueryReply(error=str(exc))
        QUERIES.inc()
        with contextlib.suppress(Exception):
            await msg.respond(encode(reply))

    # ------------------------------------------------------------------ HTTP
    def make_app(self) -> web.Application:
        from services.common.service import metrics_handler

        async def health(_r: web.Request) -> web.Response:
            return web.json_response(
                {
                    "status": "ok",
                    "active": self.active,
                    "consuming": self.consuming.is_set(),
                    "epoch": self.epoch,
                    "delta_seq": self.delta_seq,
                    "workers": len(self.core.workers),
                    "blocks": len(self.core.index),
                    "keys": self.core.index.num_keys,
                    "nats_server": self._nats_server(),
                    "lease": None
                    if self.lease is None
                    else self.lease.status() | {"warm": self._warm()},
                }
            )

        async def debug_workers(_r: web.Request) -> web.Response:
            return web.json_response(
                {
                    "workers": self.core.describe(),
                    "blocks": len(self.core.index),
                    "max_blocks": self.core.index.max_blocks,
                    "evicted_pairs": self.core.index.evicted_pairs,
                    "counts": dict(self.core.counts),
                    "verify": self.verifier.status(),
                }
            )

        async def debug_query(r: web.Request) -> web.Response:
            try:
                if r.method == "POST":
                    body = await r.json()
                    q = msgspec.convert(body, KvQuery)
                else:
                    toks = r.query.get("tokens", "")
                    keys = r.query.get("keys", "")
                    q = KvQuery(
                        token_ids=[int(t) for t in toks.split(",") if t.strip()] if toks else None,
                        keys=[int(k, 0) for k in keys.split(",") if k.strip()] if keys else None,
                        block_size=int(r.query["block_size"]) if "block_size" in r.query else None,
                        lora=r.query.get("lora"),
                        salt=r.query.get("salt"),
                    )
            except (ValueError, msgspec.ValidationError, TypeError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
            reply = self.core.query(q)
            status = 400 if reply.error else 200
            return web.json_response(to_builtins(reply), status=status)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics_handler)
        app.router.add_get("/debug/workers", debug_workers)
        app.router.add_get("/debug/query", debug_query)
        app.router.add_post("/debug/query", debug_query)
        return app
