"""What every bridge does on the kvgate side (I/O shell): publish canonical KvEventBatch on
JetStream, heartbeat on the engine's behalf, answer kvdump requests, count bad input.

Invariants:
- outgoing ``seq`` is assigned when the Rekeyer's state changes (synchronously), so a dump
  answered at any moment carries the seq its content corresponds to; every instance starts
  with an AllBlocksCleared batch at seq 0; a batch whose publish
  fails still consumed its seq (the indexer sees the gap and asks us for a dump);
- heartbeats stop while the engine does not answer (so the indexer drops its blocks), and a
  new engine instance gets a new ``instance_id`` (so the indexer clears its old blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.kvdump import KvDumpServer
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    AllBlocksCleared,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    WorkerCapacity,
    WorkerHeartbeat,
)
from services.common.streams import ensure_kv_events_stream
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


@dataclass
class CapacityDefaults:
    block_size: int = 16
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


class BridgeRuntime:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        *,
        engine: str,
        model: str,
        engine_url: str = "",
        hash_seed: int = 0,
        block_size: int | None = None,
        capacity: CapacityDefaults | None = None,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.engine = engine
        self.model = model
        self.loras: tuple[str, ...] = ()  # from the engine's /v1/models (probe_engine)
        self.engine_url = engine_url.rstrip("/")
        self.heartbeat_s = heartbeat_s
        self.defaults = capacity or CapacityDefaults()
        self._log = RateLimiter(60.0)
        self.rekeyer = Rekeyer(hash_seed, block_size, on_bad=self._on_bad)
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
        if self._log.allow(self.worker_id):
            log.warning(
                "bad engine KV input", worker_id=self.worker_id, reason=reason, detail=detail[:300]
            )

    def bad(self, reason: str, detail: str) -> None:
        self.rekeyer.bad(reason, detail)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await ensure_kv_events_stream(self.bus)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        self._sub = KvDumpServer(self.bus, self.worker_id, self._on_dump)  # chunked dumps
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

    def new_instance(self) -> None:
        """The engine restarted: forget its blocks, number batches afresh."""
        self.rekeyer.reset()
        self.instance_id = uuid.uuid4().hex[:16]
        self.out_seq = -1
        self.published_seq = -1
        self.emit([AllBlocksCleared()])
        log.info(
            "engine restarted: new instance", worker_id=self.worker_id, instance=self.instance_id
        )

    # ------------------------------------------------------------------ output
    def emit(self, events: list[KvEvent], ts: float | None = None) -> None:
        """Queue canonical events as the next batch (no await: seq order = state order)."""
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
            return False
        if not ok:
            return False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            async with s.get(f"{self.engine_url}/metrics") as r:
                if r.status == 200:
                    caps = parse_vllm_capacity(await r.text())
                    self._engine_caps.update(caps)
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
        return True

    def capacity(self) -> WorkerCapacity:
        c = self._engine_caps
        d = self.defaults
        block = self.rekeyer.block_size or c.get("block_size") or d.block_size
        blocks = self.rekeyer.num_gpu_blocks or c.get("num_gpu_blocks") or d.num_gpu_blocks
        return WorkerCapacity(
            block_size=block,
            num_gpu_blocks=max(1, blocks),
            max_num_seqs=max(1, c.get("max_num_seqs") or d.max_num_seqs),
            max_model_len=max(1, c.get("max_model_len") or d.max_model_len),
        )

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            url=self.engine_url,
            model=self.model,
            capacity=self.capacity(),
            engine=self.engine,
            kv_seq=self.out_seq,
            ts=time.time(),
            loras=self.loras,
        )

    async def _heartbeat_loop(self) -> None:
        subject = self.bus.subjects.heartbeat(self.worker_id)
        while True:
            self.engine_ok = await self.probe_engine()
            if self.engine_ok:
                with contextlib.suppress(Exception):
                    await self.bus.publish(subject, self.heartbeat())
            await asyncio.sleep(self.heartbeat_s)
