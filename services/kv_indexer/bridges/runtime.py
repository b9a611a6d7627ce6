"""What every bridge does on the kvgate side (I/O shell): publish canonical KvEventBatch on
JetStream, heartbeat on the engine's behalf, answer kvdump requests, count bad input.

Invariants:
- outgoing ``seq`` is assigned when the Rekeyer's state changes (synchronously), so a dump
  answered at any moment carries the seq its content corresponds to; every instance starts
  with an AllBlocksCleared batch at seq 0; a batch whose publish
  fails still consumed its seq (the indexer sees the gap and asks us for a dump);
- heartbeats stop while the engine does not answer (so the indexer drops its blocks), and a
  new engine instance gets a new ``instance_id`` (so the indexer clears its old blocks);
- no heartbeat before the engine's block size is known (read from the engine or given with
  ``--block-size``): a guessed size would make the indexer drop the engine's first events;
  until the bridge has replayed the engine's history (``mark_ready``) heartbeats say
  ``state="starting"`` so routers do not trust the still-incomplete cache view;
- an engine whose ``process_start_time_seconds`` changes, or that comes back after its
  ``/health`` failed and its start time cannot be read, restarted: ``restart_detected`` is
  set for the bridge to start a new instance and replay from 0;
- engine history the bridge could not replay is recorded (``history``, a HistoryLedger) until
  the view is whole again, and every dump carries it: a dump never passes for the engine's
  cache when it is only the bridge's partial view of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.kvdump import KvDumpServer
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    AllBlocksCleared,
    EngineHistoryLost,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    WorkerCapacity,
    WorkerHeartbeat,
    to_builtins,
)
from services.common.service import metrics_handler
from services.common.streams import require_kv_events_stream
from services.kv_indexer.bridges.history import HistoryLedger, LossReason
from services.kv_indexer.bridges.pd_role import role_from_server_info
from services.kv_indexer.bridges.rekey import Rekeyer

log = get_logger("bridge")

BRIDGE_BAD = Counter(
    "kvgate_bridge_bad_input_total", "Engine KV inputs dropped by a bridge, by reason", ["reason"]
)
BRIDGE_BATCHES = Counter("kvgate_bridge_batches_total", "Canonical batches published")
BRIDGE_BLOCKS = Counter("kvgate_bridge_blocks_total", "Blocks re-keyed and published")
BRIDGE_GAPS = Counter("kvgate_bridge_seq_gaps_total", "Engine sequence gaps seen")
BRIDGE_REPLAYS = Counter("kvgate_bridge_replays_total", "Engine replays, by result", ["result"])
BRIDGE_PUBLISH_FAILED = Counter(
    "kvgate_bridge_publish_failed_total", "Canonical batches that could not be published"
)
BRIDGE_SKIPPED = Counter(
    "kvgate_bridge_skipped_events_total",
    "Engine KV events that are valid but not this worker's local prefix cache, by reason",
    ["reason"],
)
BRIDGE_RESETS = Counter(
    "kvgate_bridge_instance_resets_total",
    "Times a bridge dropped what it knew of its engine and resynced from the engine's replay "
    "(engine restart or history that cannot be recovered), by reason",
    ["reason"],
)
BRIDGE_HISTORY_LOST = Counter(
    "kvgate_bridge_history_lost_total",
    "Engine history a bridge could not replay (its view, and the index, may lack blocks the "
    "engine holds; index verify says unknown), by reason",
    ["reason"],
)
BRIDGE_UNVERIFIABLE = Gauge(
    "kvgate_bridge_history_incomplete",
    "1 while the bridge's view lacks engine history it could not replay (until the engine "
    "restarts or clears its cache), else 0",
)


@dataclass
class CapacityDefaults:
    """Fallbacks for what the engine does not report (never the block size: that one is
    read from the engine or given explicitly)."""

    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 8192


def lora_names(models: object) -> tuple[str, ...]:
    """LoRA adapters in an OpenAI ``/v1/models`` answer: vLLM (and the simulated worker) list
    each adapter as a model whose ``parent`` is the base model."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return ()
    return tuple(
        sorted(
            m["id"]
            for m in data
            if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)
        )
    )[:1024]


def parse_vllm_capacity(metrics_text: str) -> dict[str, int]:
    """``vllm:cache_config_info`` labels (block_size, num_gpu_blocks, ...) as ints."""
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name.removesuffix("_info").endswith("cache_config"):
            for s in fam.samples:
                for k, v in s.labels.items():
                    with contextlib.suppress(ValueError, TypeError):
                        out[k] = int(float(v))
    return out


def parse_start_time(metrics_text: str) -> float | None:
    """``process_start_time_seconds`` of a Prometheus exposition (vLLM and SGLang export the
    client library's process collector), None when absent."""
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "process_start_time_seconds":
            for sm in fam.samples:
                return float(sm.value)
    return None


class BridgeRuntime:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        *,
        engine: str,
        model: str,
        engine_url: str = "",
        worker_url: str = "",
        hash_seed: int = 0,
        block_size: int | None = None,
        capacity: CapacityDefaults | None = None,
        heartbeat_s: float = 1.0,
        role: str | None = None,
        bootstrap_port: int = 0,
    ) -> None:
        self.bus = bus
        # disaggregated serving (services/kv_indexer/bridges/pd_role.py): None = learn it
        # from the engine (SGLang's /server_info), else what the flags said
        self.role_given = role
        self.role = role or "both"
        self.bootstrap_port = bootstrap_port
        self.worker_id = worker_id
        self.engine = engine
        self.model = model
        self.loras: tuple[str, ...] = ()  # from the engine's /v1/models (probe_engine)
        self.engine_url = engine_url.rstrip("/")
        # what heartbeats announce (routers and the gateway send there): a proxy in front of
        # the engine (llm-d's routing sidecar), or the engine itself
        self.worker_url = worker_url.rstrip("/") or self.engine_url
        self.heartbeat_s = heartbeat_s
        self.defaults = capacity or CapacityDefaults()
        self._log = RateLimiter(60.0)
        self.rekeyer = Rekeyer(hash_seed, block_size, on_bad=self._on_bad, on_skip=self._on_skip)
        self.block_size_known = asyncio.Event()
        if block_size:
            self.block_size_known.set()
        self.ready = False  # history replayed: heartbeats say "ready"
        self.restart_detected = asyncio.Event()
        self.engine_start_time: float | None = None
        self._engine_was_down = False
        self.resets: dict[str, int] = {}
        self.history = HistoryLedger()
        self.instance_id = uuid.uuid4().hex[:16]
        self.out_seq = -1  # last assigned
        self.published_seq = -1
        self.engine_ok = not self.engine_url
        self._engine_caps: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._queue: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self._tasks: list[asyncio.Task[Any]] = []
        self._sub: KvDumpServer | None = None
        self.dumps_served = 0

    # ------------------------------------------------------------------ bad input
    def _on_bad(self, reason: str, detail: str) -> None:
        BRIDGE_BAD.labels(reason).inc()
        if self._log.allow(("bad", reason)):
            log.warning(
                "bad engine KV input",
                worker_id=self.worker_id,
                reason=reason,
                detail=detail[:300],
                suppressed=self._log.take_suppressed(("bad", reason)),
            )

    def _on_skip(self, reason: str, detail: str) -> None:
        BRIDGE_SKIPPED.labels(reason).inc()
        if self._log.allow(("skip", reason)):
            log.info(
                "engine KV events skipped",
                worker_id=self.worker_id,
                reason=reason,
                detail=detail[:300],
                suppressed=self._log.take_suppressed(("skip", reason)),
            )

    def bad(self, reason: str, detail: str) -> None:
        self.rekeyer.bad(reason, detail)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await require_kv_events_stream(self.bus)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        self._sub = KvDumpServer(  # chunked dumps, each saying which engine history is lost
            self.bus, self.worker_id, self._on_dump, history_lost=self.history_report
        )
        await self._sub.start()
        self.emit([AllBlocksCleared()])  # seq 0: this instance starts empty (dumps need a seq)
        self._tasks.append(asyncio.create_task(self._publisher(), name="bridge-publish"))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="bridge-heartbeat"))

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._queue.join(), timeout=2.0)
        await cancel_and_wait(self._tasks)
        if self._sub is not None:
            await self._sub.stop()
        if self._session is not None:
            await self._session.close()

    def new_instance(self, reason: str = "engine_restarted") -> None:
        """The engine restarted (or its history cannot be recovered): forget its blocks,
        number batches afresh; the indexer clears the old instance's blocks."""
        self.rekeyer.reset()
        self.history.forget()  # a caller that lost history notes it after the reset
        BRIDGE_UNVERIFIABLE.set(0)
        self.instance_id = uuid.uuid4().hex[:16]
        self.out_seq = -1
        self.published_seq = -1
        self.emit([AllBlocksCleared()])
        BRIDGE_RESETS.labels(reason).inc()
        self.resets[reason] = self.resets.get(reason, 0) + 1
        log.warning(
            "engine state reset: new instance",
            worker_id=self.worker_id,
            reason=reason,
            instance=self.instance_id,
        )

    def history_lost(
        self,
        reason: LossReason,
        first_lost_seq: int,
        last_lost_seq: int,
        view_from_seq: int,
        detail: str = "",
    ) -> None:
        """Engine batches ``first_lost_seq..last_lost_seq`` will never be applied: until the
        view is whole again, dumps say so (index verify: unknown, not equal)."""
        lost = self.history.note_loss(
            reason,
            first_lost_seq,
            last_lost_seq,
            view_from_seq,
            self.rekeyer,
            kv_seq=self.out_seq,
            detail=detail,
        )
        BRIDGE_HISTORY_LOST.labels(reason).inc()
        BRIDGE_UNVERIFIABLE.set(1)
        log.warning(
            "engine history lost: the index cannot be verified against the engine",
            worker_id=self.worker_id,
            reason=reason,
            first_lost_seq=lost.first_lost_seq,
            last_lost_seq=lost.last_lost_seq,
            view_from_seq=lost.view_from_seq,
            detail=detail,
        )

    def history_report(self) -> EngineHistoryLost | None:
        """The engine history this bridge lost, with its evidence so far (None: none)."""
        return self.history.report(self.rekeyer)

    def mark_ready(self) -> None:
        """The engine's history has been replayed (as far as it keeps one)."""
        if not self.ready:
            self.ready = True
            log.info("bridge ready", worker_id=self.worker_id, block_size=self.rekeyer.block_size)

    def set_block_size(self, block_size: int) -> None:
        if self.rekeyer.block_size is None and block_size > 0:
            self.rekeyer.block_size = block_size
            self.block_size_known.set()

    # ------------------------------------------------------------------ output
    def emit(self, events: list[KvEvent], ts: float | None = None) -> None:
        """Queue canonical events as the next batch (no await: seq order = state order)."""
        if self.history.after_batch(self.rekeyer):
            BRIDGE_UNVERIFIABLE.set(0)
            log.info(
                "engine cleared its cache: the lost history no longer matters",
                worker_id=self.worker_id,
            )
        if not events:
            return
        self.out_seq += 1
        batch = KvEventBatch(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            seq=self.out_seq,
            ts=ts or time.time(),
            events=events,
        )
        self._queue.put_nowait(batch)

    async def _publisher(self) -> None:
        subject = self.bus.subjects.kv_events(self.worker_id)
        while True:
            batch = await self._queue.get()
            try:
                for attempt in range(3):
                    try:
                        await self.bus.js_publish(subject, batch, timeout=2.0)
                        BRIDGE_BATCHES.inc()
                        BRIDGE_BLOCKS.inc(sum(len(getattr(e, "keys", ())) for e in batch.events))
                        self.published_seq = batch.seq
                        break
                    except Exception as exc:
                        if attempt == 2:
                            BRIDGE_PUBLISH_FAILED.inc()
                            if self._log.allow("publish"):
                                log.warning("publish failed", error=repr(exc), seq=batch.seq)
                        else:
                            await asyncio.sleep(0.2)
            finally:
                self._queue.task_done()

    async def _on_dump(self, req: KvDumpRequest) -> KvEventBatch:
        self.dumps_served += 1
        return KvEventBatch(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            seq=self.out_seq,  # >= 0: start() emits seq 0
            ts=time.time(),
            events=self.rekeyer.dump(),
        )

    # ------------------------------------------------------------------ heartbeat
    async def probe_engine(self) -> bool:
        """Is the engine up? Refresh its capacity from /metrics (vllm:cache_config_info) or
        SGLang's /get_server_info when those answer."""
        if not self.engine_url or self._session is None:
            return True
        s = self._session
        try:
            async with s.get(f"{self.engine_url}/health") as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if not ok:
            self._engine_was_down = True
            return False
        start: float | None = None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            async with s.get(f"{self.engine_url}/metrics") as r:
                if r.status == 200:
                    text = await r.text()
                    caps = parse_vllm_capacity(text)
                    self._engine_caps.update(caps)
                    start = parse_start_time(text)
        self._check_identity(start)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            async with s.get(f"{self.engine_url}/v1/models") as r:
                if r.status == 200:
                    self.loras = lora_names(await r.json())
        if self.engine == "sglang" and "block_size" not in self._engine_caps:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
                async with s.get(f"{self.engine_url}/get_server_info") as r:
                    if r.status == 200:
                        info = await r.json()
                        page = int(info.get("page_size") or 1)
                        self._engine_caps["block_size"] = page
                        if info.get("max_total_num_tokens"):
                            self._engine_caps["num_gpu_blocks"] = int(
                                info["max_total_num_tokens"]
                            ) // max(page, 1)
                        if info.get("max_running_requests"):
                            self._engine_caps["max_num_seqs"] = int(info["max_running_requests"])
                        if info.get("context_length"):
                            self._engine_caps["max_model_len"] = int(info["context_length"])
        if self.engine == "sglang" and self.role_given is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
                async with s.get(f"{self.engine_url}/server_info") as r:
                    if r.status == 200:
                        learned = role_from_server_info(await r.json())
                        if learned is not None:
                            self.role, port = learned
                            self.bootstrap_port = self.bootstrap_port or port
        if "block_size" in self._engine_caps:
            self.set_block_size(self._engine_caps["block_size"])
        return True

    def _check_identity(self, start: float | None) -> None:
        """Engine start time changed, or the engine came back from a failed /health and its
        start time cannot be told: a new engine process (its seq restarts at 0)."""
        was_down, self._engine_was_down = self._engine_was_down, False
        known = self.engine_start_time
        if start is not None:
            self.engine_start_time = start
            if known is not None and abs(start - known) > 1e-3:
                self.restart_detected.set()
        elif was_down and self.ready:
            self.restart_detected.set()

    async def wait_block_size(self, stop: asyncio.Event, every_s: float = 1.0) -> bool:
        """Until the engine's block size is known (probing it), saying so now and then.
        False when stopped first."""
        waited = 0.0
        while not self.block_size_known.is_set():
            if stop.is_set():
                return False
            if not self.engine_url:
                if waited == 0.0:
                    log.error(
                        "block size unknown: no --engine-url to read it from and no "
                        "--block-size given; waiting",
                        worker_id=self.worker_id,
                    )
            else:
                await self.probe_engine()
                if self.block_size_known.is_set():
                    break
                if self._log.allow("block_size_wait"):
                    log.warning(
                        "waiting for the engine's block size (/metrics vllm:cache_config_info "
                        "or /get_server_info page_size); or pass --block-size",
                        worker_id=self.worker_id,
                        engine_url=self.engine_url,
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.block_size_known.wait(), every_s)
            waited += every_s
        return True

    def capacity(self) -> WorkerCapacity:
        c = self._engine_caps
        d = self.defaults
        block = self.rekeyer.block_size or c.get("block_size") or 1
        blocks = self.rekeyer.num_gpu_blocks or c.get("num_gpu_blocks") or d.num_gpu_blocks
        return WorkerCapacity(
            block_size=block,
            num_gpu_blocks=max(1, blocks),
            max_num_seqs=max(1, c.get("max_num_seqs") or d.max_num_seqs),
            max_model_len=max(1, c.get("max_model_len") or d.max_model_len),
        )

    def health(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "instance_id": self.instance_id,
            "ready": self.ready,
            "engine_ok": self.engine_ok,
            "block_size": self.rekeyer.block_size,
            "kv_seq": self.out_seq,
            "published_seq": self.published_seq,
            "blocks": self.rekeyer.blocks(),
            "bad_input": dict(self.rekeyer.counts),
            "skipped": dict(self.rekeyer.skipped),
            "resets": dict(self.resets),
            "history_lost": to_builtins(lost) if (lost := self.history_report()) else None,
        }

    def make_app(self) -> web.Application:
        """``GET /health`` (200 once ready and the engine answers, else 503; JSON status)
        and ``GET /metrics`` (the ``kvgate_bridge_*`` counters)."""

        async def health(_: web.Request) -> web.Response:
            body = self.health()
            ok = self.ready and self.engine_ok
            return web.json_response(body, status=200 if ok else 503)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics_handler)
        return app

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            url=self.worker_url,
            model=self.model,
            capacity=self.capacity(),
            engine=self.engine,
            state="ready" if self.ready else "starting",
            kv_seq=self.out_seq,
            ts=time.time(),
            loras=self.loras,
            role=self.role,  # type: ignore[arg-type]
            bootstrap_port=self.bootstrap_port if self.role == "prefill" else 0,
        )

    async def _heartbeat_loop(self) -> None:
        subject = self.bus.subjects.heartbeat(self.worker_id)
        while True:
            self.engine_ok = await self.probe_engine()
            if self.engine_ok and self.block_size_known.is_set():
                with contextlib.suppress(Exception):
                    await self.bus.publish(subject, self.heartbeat())
            await asyncio.sleep(self.heartbeat_s)
