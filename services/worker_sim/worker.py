"""One live simulated worker: the engine on real time, its OpenAI HTTP server, its bus and ZMQ
publishers, its metrics and its faults. Several run in one process (see app.py).

Timing: the engine loop runs a step, sleeps for ``duration * slow_factor / speedup`` wall
seconds, then delivers the step's tokens (so the first token arrives after its prefill).
When the loop falls behind (CPU contention) it catches up by up to ``MAX_LAG_S`` of wall time
instead of drifting, and yields to the event loop at least every few steps.

Invariants:
- nothing on the engine path awaits the network: KV batches go to per-sink queues drained by
  their own tasks; when NATS is down they are dropped and counted, and HTTP keeps serving;
- KV batch ``seq`` increases by exactly one per batch per ``instance_id``, starting at 0 with an
  ``AllBlocksCleared`` batch (a restarted worker starts empty); a batch dropped by a fault still
  uses its seq; heartbeats carry ``kv_seq`` = the last seq handled (published or dropped);
- a kvdump (services.common.kvdump, chunked: any cache size) carries the latest assigned seq
  and the full cache as of exactly that seq. The engine changes its cache when a step is
  scheduled, but the loop publishes the step's events after the step's simulated duration;
  a dump that arrives in between first publishes them (giving them their seq), so the cache
  it reads is never ahead of the seq it names. (It used to be: the indexer's verifier then
  compared the index at seq S with a cache at S + 1 and "repaired" a divergence that the next
  batch would have closed.)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common import tracing
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
from services.common.tokenizer import Tokenizer, adds_special_tokens, completion_prompts
from services.core.engine import (
    AdmissionError,
    Engine,
    EngineConfig,
    FinishedRequest,
    SimRequest,
    StepOutput,
)
from services.core.kvcache import EventMeta
from services.worker_sim.faults import Faults
from services.worker_sim.gpu import GpuGauges, GpuModel
from services.worker_sim.metrics import WorkerMetrics
from services.worker_sim.openai_api import (
    ApiError,
    Choice,
    ParsedRequest,
    chunk,
    full_response,
    parse_request,
    usage,
)
from services.worker_sim.outputs import Output
from services.worker_sim.pd import (
    PULL_PATH,
    Handshake,
    PdSettings,
    PrefillSide,
    nixl_response_params,
    parse_handshake,
    pull_kv,
)
from services.worker_sim.zmq_pub import ZmqPublisher
from services.worker_sim.zmq_wire import encode_batch

log = get_logger("sim-worker")
MAX_LAG_S = 0.05
YIELD_EVERY = 8
SERVED_BY = "x-kvgate-served-by"


@dataclass
class WorkerSettings:
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str = ""  # host in the announced URL (default: host)
    model: str = "sim-llama-8b"
    loras: tuple[str, ...] = ()
    speedup: float = 1.0
    default_max_tokens: int = 0  # 0: vLLM's defaults (completions 16, chat the rest of the context)
    strict_model: bool = False
    heartbeat_interval: float = 1.0
    kv_queue_max: int = 10_000
    # ZMQ (vLLM wire format); port 0 = off
    zmq_port: int = 0
    zmq_replay_port: int = 0
    zmq_host: str = "127.0.0.1"
    zmq_topic: str = "kv@{worker}@{model}"
    zmq_event_form: str = "map"
    zmq_batch_form: str = "array"
    zmq_hash: str = "uint64"
    zmq_replay_topic_frame: bool = False
    zmq_buffer_steps: int = 10_000
    faults: dict[str, Any] = field(default_factory=dict)
    fault_seed: int = 0
    pd: PdSettings = field(default_factory=PdSettings)  # P/D role, link, lease


class SimWorker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine_config: EngineConfig,
        tokenizer: Tokenizer,
        bus: Bus | None = None,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.bus = bus
        self.url = f"http://{settings.advertise_host or settings.host}:{settings.port}"
        self.faults = Faults().update(settings.faults) if settings.faults else Faults()
        self._rng = random.Random(f"{engine_config.seed}:{settings.fault_seed}:{self.worker_id}")
        self.metrics = WorkerMetrics(lambda: self, settings.model, self.worker_id)
        self.kv_published = 0
        self.kv_dropped: dict[str, int] = {}
        self.busy_sim_s = 0.0  # simulated seconds the GPU spent stepping (incl. slow-down)
        self.alive = False
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._dump_sub: KvDumpServer | None = None  # answers kvdump requests (chunked)
        self._restart_task: asyncio.Task[None] | None = None
        self._crash_task: asyncio.Task[None] | None = None
        self._drop_log = RateLimiter(30.0)
        self._lora_ids = {name: i + 1 for i, name in enumerate(settings.loras)}
        self._http: Any = None  # aiohttp session of the decoder's KV pulls (lazy)
        self.pd_recomputed = 0  # decode requests whose KV pull failed (NIXL: prefilled here)
        self.tracer = tracing.tracer("kvgate.worker_sim")  # None: tracing off
        self._new_instance()

    # ------------------------------------------------------------------ lifecycle
    def _new_instance(self) -> None:
        self.engine = Engine(self.engine_config, self.worker_id)
        self.gpu = GpuModel(self.engine_config)
        self.instance_id = uuid.uuid4().hex[:12]
        self.kv_seq = -1  # last assigned
        self.kv_seq_done = -1  # last handled by the NATS sink (published or dropped)
        self._kv_queue: asyncio.Queue[tuple[int, KvEventBatch, int]] = asyncio.Queue(
            maxsize=self.settings.kv_queue_max
        )
        # engine request id -> its HTTP request's queue of (event, engine request id, value)
        self._streams: dict[str, asyncio.Queue[tuple[str, str, Any]]] = {}
        self._wake = asyncio.Event()
        self._not_hung = asyncio.Event()
        if not self.faults.hang:
            self._not_hung.set()
        self._busy_until = 0.0
        # the running step's KV events: in the engine's cache already, published (given a
        # seq) when the step's simulated duration is over, or earlier by a kvdump
        self._step_kv: tuple[list[KvEvent], list[EventMeta | None]] | None = None
        self.zmq: ZmqPublisher | None = None
        # P/D: this instance's held prefill KV; engine request id -> its prefill key; decode
        # requests' transfers (engine request id -> handshake, and the future of its outcome)
        self.pd_prefill = PrefillSide(self.settings.pd, self._release_held, self.settings.speedup)
        self._pd_keys: dict[str, str] = {}
        self._pd_pulls: dict[str, tuple[Handshake, asyncio.Future[bool]]] = {}
        self._pd_tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        s = self.settings
        if s.zmq_port:
            topic = s.zmq_topic.format(worker=self.worker_id, model=s.model, pod=self.worker_id)
            self.zmq = ZmqPublisher(
                f"tcp://{s.zmq_host}:{s.zmq_port}",
                f"tcp://{s.zmq_host}:{s.zmq_replay_port}" if s.zmq_replay_port else None,
                topic,
                buffer_steps=s.zmq_buffer_steps,
                replay_topic_frame=s.zmq_replay_topic_frame,
            )
            self.zmq.start()
        self._tasks = [
            asyncio.create_task(self._engine_loop(), name=f"engine:{self.worker_id}"),
            asyncio.create_task(self._kv_sink(), name=f"kv-sink:{self.worker_id}"),
        ]
        self._emit_kv([AllBlocksCleared()], [None])  # seq 0: this instance starts empty
        app = self.make_app()
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port, reuse_address=True, shutdown_timeout=0.5)
        await site.start()
        self.alive = True
        await self.attach_bus()
        log.info("worker started", worker=self.worker_id, url=self.url, instance=self.instance_id)

    async def attach_bus(self) -> None:
        """Answer kvdump requests (call again after the bus connects)."""
        if self.bus is None or not self.bus.is_connected or self._dump_sub is not None:
            return
        if not self.alive:
            return
        dumps = KvDumpServer(self.bus, self.worker_id, self._on_kvdump)
        await dumps.start()
        self._dump_sub = dumps

    def _release_held(self, engine_rid: str) -> None:
        if self.engine.release_held(engine_rid):
            self._wake.set()  # freed blocks may admit a waiting request

    async def stop(self) -> None:
        self.alive = False
        self.pd_prefill.close()
        for _h, fut in self._pd_pulls.values():
            if not fut.done():
                fut.set_result(False)
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._dump_sub is not None:
            await self._dump_sub.stop()
            self._dump_sub = None
        await cancel_and_wait(self._tasks + list(self._pd_tasks))
        self._tasks = []
        for q in self._streams.values():
            q.put_nowait(("crash", "", None))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.zmq is not None:
            await self.zmq.close()
            self.zmq = None

    async def close(self) -> None:
        if self._restart_task is not None:
            self._restart_task.cancel()
        await self.stop()

    async def crash(self, restart_after_s: float | None) -> None:
        log.warning(
            "fault: worker crashing", worker=self.worker_id, restart_after_s=restart_after_s
        )
        await self.stop()
        if restart_after_s is not None:
            self._restart_task = asyncio.create_task(self._restart(restart_after_s))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)  # the fault's downtime, not a synchronisation
        self.faults = Faults()
        self._new_instance()
        await self.start()

    # ------------------------------------------------------------------ status
    def capacity(self) -> WorkerCapacity:
        c = self.engine_config
        return WorkerCapacity(
            block_size=c.block_size,
            num_gpu_blocks=c.num_gpu_blocks,
            max_num_seqs=c.max_num_seqs,
            max_model_len=c.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
        )

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            url=self.url,
            model=self.settings.model,
            capacity=self.capacity(),
            engine="sim",
            state="ready",
            kv_seq=self.kv_seq_done,
            kv_events=True,
            ts=time.time(),
            loras=tuple(self.settings.loras),
            role=self.settings.pd.role,  # type: ignore[arg-type]
            # the simulated bootstrap server is the HTTP port (services/worker_sim/pd.py)
            bootstrap_port=self.settings.port if self.settings.pd.role == "prefill" else 0,
        )

    @property
    def beating(self) -> bool:
        """Heartbeats go out while the worker is up and not hung."""
        return self.alive and not self.faults.hang

    def gpu_gauges(self) -> GpuGauges:
        return self.gpu.sample(time.monotonic(), self.engine)

    def _count_drop(self, reason: str, n: int = 1) -> None:
        self.kv_dropped[reason] = self.kv_dropped.get(reason, 0) + n
        if self._drop_log.allow(reason):
            log.warning(
                "kv event batch dropped",
                worker=self.worker_id,
                reason=reason,
                suppressed=self._drop_log.take_suppressed(reason),
            )

    # ------------------------------------------------------------------ engine loop
    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        steps = 0
        while True:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                self._busy_until = loop.time()  # idle time is not lag to catch up on
            if not self._not_hung.is_set():
                await self._not_hung.wait()
                self._busy_until = loop.time()
            now = loop.time()
            speed = self.settings.speedup
            out = self.engine.step(now * speed)
            if out is None:
                continue
            if out.kv_events:
                self._step_kv = (out.kv_events, out.kv_event_meta)
            self.busy_sim_s += out.duration_s * self.faults.slow_factor
            dur = out.duration_s * self.faults.slow_factor / speed
            start = max(self._busy_until, now - MAX_LAG_S)
            self._busy_until = start + dur
            delay = self._busy_until - loop.time()
            steps += 1
            if delay > 0:
                await asyncio.sleep(delay)  # the simulated GPU is computing this step
                steps = 0
            elif steps >= YIELD_EVERY:
                await asyncio.sleep(0)
                steps = 0
            # busy from the step's scheduled start to its end (back to back while there is
            # work, whatever the Python overhead between steps)
            mono_shift = time.monotonic() - loop.time()
            self.gpu.record_step(start + mono_shift, self._busy_until + mono_shift, out)
            self._deliver(out)
            self._publish_step_kv()
            for rid in out.kv_transfers:  # decode side: blocks reserved, the KV transfer starts
                task = asyncio.create_task(self._pd_receive(rid))
                self._pd_tasks.add(task)
                task.add_done_callback(self._pd_tasks.discard)

    def _publish_step_kv(self) -> None:
        """Give the running step's KV events their seq and queue them (once)."""
        step_kv, self._step_kv = self._step_kv, None
        if step_kv is not None:
            self._emit_kv(*step_kv)

    def _deliver(self, out: StepOutput) -> None:
        for rid, toks in out.tokens.items():
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(("tokens", rid, toks))
        for fin in out.finished:
            key = self._pd_keys.pop(fin.request_id, None)
            if key is not None:  # a prefill for a decoder: its KV is held (or it failed)
                if fin.finish_reason == "abort":
                    self.pd_prefill.failed(key)
                else:
                    held = fin.request_id in self.engine.held
                    self.pd_prefill.finished(key, fin.request_id, fin.prompt_tokens, held)
            q = self._streams.get(fin.request_id)
            if q is not None:
                q.put_nowait(("done", fin.request_id, fin))

    # ------------------------------------------------------------------ KV events
    def _emit_kv(self, events: list[KvEvent], meta: list[EventMeta | None]) -> None:
        self.kv_seq += 1
        seq = self.kv_seq
        copies = 1
        if self.faults.drop_kv and self._rng.random() < self.faults.drop_kv:
            copies = 0
        elif self.faults.dup_kv and self._rng.random() < self.faults.dup_kv:
            copies = 2
        ts = time.time()
        batch = KvEventBatch(
            worker_id=self.worker_id, instance_id=self.instance_id, seq=seq, ts=ts, events=events
        )
        try:
            self._kv_queue.put_nowait((seq, batch, copies))
        except asyncio.QueueFull:
            self._count_drop("queue_full")
            self.kv_seq_done = max(self.kv_seq_done, seq)
        if self.zmq is not None:
            s = self.settings
            payload = encode_batch(
                ts,
                events,
                meta,
                form=s.zmq_event_form,
                hash_mode=s.zmq_hash,
                lora_ids=self._lora_ids,
                batch_form=s.zmq_batch_form,
            )
            self.zmq.publish(payload, copies)

    async def _kv_sink(self) -> None:
        q = self._kv_queue
        while True:
            seq, batch, copies = await q.get()
            bus = self.bus
            if copies == 0:
                self._count_drop("fault")
            elif bus is None or not bus.is_connected:
                self._count_drop("nats_down")
            else:
                subject = bus.subjects.kv_events(self.worker_id)
                try:
                    for _ in range(copies):
                        await bus.js_publish(subject, batch, timeout=2.0)
                    self.kv_published += 1
                except Exception as exc:
                    self._count_drop("nats_error")
                    log.debug("kv publish failed", worker=self.worker_id, error=repr(exc))
            self.kv_seq_done = max(self.kv_seq_done, seq)

    # ------------------------------------------------------------------ P/D transfers
    async def _pd_receive(self, engine_rid: str) -> None:
        """Decode side: read the prompt's KV from the prefill worker into the reserved blocks.
        A failed read: NIXL recomputes the prompt here; bootstrap fails the request."""
        entry = self._pd_pulls.pop(engine_rid, None)
        if entry is None:
            return
        h, fut = entry
        if self._http is None:
            import aiohttp

            self._http = aiohttp.ClientSession()
        wait_s = self.settings.pd.bootstrap_timeout_s / self.settings.speedup + 60.0
        tokens = await pull_kv(self._http, h, wait_s)
        ok = tokens is not None
        if ok:
            self.engine.kv_received(engine_rid)
        elif h.kind == "nixl":
            self.pd_recomputed += 1
            self.engine.kv_failed(engine_rid)
            ok = True
        else:
            self.engine.abort(engine_rid)
        log.debug("kv transfer", worker=self.worker_id, kind=h.kind, tokens=tokens)
        if not fut.done():
            fut.set_result(ok)
        self._wake.set()

    async def _pd_pull(self, r: web.Request) -> web.Response:
        """Prefill side: a decoder reads a held prompt's KV (see services/worker_sim/pd.py)."""
        try:
            body = await _json_body(r)
            kind, key = body.get("kind"), body.get("key")
            if kind not in ("nixl", "bootstrap") or not isinstance(key, str):
                raise ApiError(400, "a pull needs 'kind' (nixl | bootstrap) and 'key'")
        except ApiError as exc:
            return _error(exc)
        if kind == "nixl" and body.get("engine_id") != self.instance_id:
            tokens = None  # another instance's blocks: gone with its restart
        else:
            tokens = await self.pd_prefill.pull(f"{kind}:{key}", wait=kind == "bootstrap")
        if tokens is None:
            return _error(ApiError(404, f"no KV held for {kind} {key}", None, "NotFoundError"))
        return web.json_response({"tokens": tokens})

    async def _on_kvdump(self, req: KvDumpRequest) -> KvEventBatch:
        # the cache already holds the running step's changes: name their seq (no await
        # between this, reading the cache and reading the seq)
        self._publish_step_kv()
        events: list[KvEvent] = [AllBlocksCleared()]
        events.extend(self.engine.dump_cache())  # KvDumpServer logs the dump
        return KvEventBatch(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            seq=max(self.kv_seq, 0),
            ts=time.time(),
            events=events,
        )

    # ------------------------------------------------------------------ faults
    async def apply_faults(self, patch: dict[str, Any]) -> None:
        self.faults.update(patch)
        if self.faults.hang:
            self._not_hung.clear()
        else:
            self._not_hung.set()
        if self.faults.crash and self.alive:
            # keep a reference: the loop holds tasks weakly
            self._crash_task = asyncio.create_task(self.crash(self.faults.restart_after_s))

    # ------------------------------------------------------------------ HTTP
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        if self.tracer is not None:  # the generation routes continue the router's trace
            app.middlewares.append(
                tracing.aiohttp_middleware(self.tracer, "worker", skip=_UNTRACED)
            )

        async def add_header(_req: web.Request, resp: web.StreamResponse) -> None:
            resp.headers[SERVED_BY] = self.worker_id

        app.on_response_prepare.append(add_header)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_route("*", "/ping", self._ping)
        # SGLang-style info endpoints (sglang-router and the bridge's capacity probe read them)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self._server_info)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self._model_info)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post(PULL_PATH, self._pd_pull)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_post("/admin/faults", self._post_faults)
        return app

    def _status(self) -> dict[str, Any]:
        e = self.engine
        return {
            "status": "ok",
            "worker_id": self.worker_id,
            "instance_id": self.instance_id,
            "model": self.settings.model,
            "running": e.num_running,
            "waiting": e.num_waiting,
            "kv_usage": e.kv_usage,
            "num_free_blocks": e.num_free_blocks,
            "kv_seq": self.kv_seq,
            "pd": {
                "role": self.settings.pd.role,
                "held": len(self.engine.held),
                "receiving": len(self.engine.receiving),
                "pulled": self.pd_prefill.pulled,
                "lease_expired": self.pd_prefill.lease_expired,
                "recomputed": self.pd_recomputed,
            },
        }

    async def _health(self, _r: web.Request) -> web.Response:
        if self.faults.hang:
            await self._not_hung.wait()
        return web.json_response(self._status())

    async def _models(self, _r: web.Request) -> web.Response:
        created = int(time.time())
        c = self.engine_config
        data = [
            {
                "id": self.settings.model,
                "object": "model",
                "created": created,
                "owned_by": "kvgate",
                "root": self.settings.model,
                "parent": None,
                "max_model_len": c.max_model_len,
            }
        ]
        for lora in self.settings.loras:
            data.append(
                {
                    "id": lora,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvgate",
                    "root": lora,
                    "parent": self.settings.model,
                    "max_model_len": c.max_model_len,
                }
            )
        return web.json_response({"object": "list", "data": data})

    async def _server_info(self, _r: web.Request) -> web.Response:
        c = self.engine_config
        return web.json_response(
            {
                "model_path": self.settings.model,
                "served_model_name": self.settings.model,
                "tokenizer_path": getattr(self.tokenizer, "name", "bytes"),
                "page_size": c.block_size,
                "max_total_num_tokens": c.kv_capacity_tokens,
                "max_running_requests": c.max_num_seqs,
                "chunked_prefill_size": c.max_num_batched_tokens,
                "context_length": c.max_model_len,
                "enable_prefix_caching": True,
                "worker_id": self.worker_id,
                "version": "kvgate-sim",
            }
        )

    async def _model_info(self, _r: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.settings.model,
                "tokenizer_path": getattr(self.tokenizer, "name", "bytes"),
                "is_generation": True,
            }
        )

    async def _version(self, _r: web.Request) -> web.Response:
        return web.json_response({"version": "kvgate-sim"})

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _get_faults(self, _r: web.Request) -> web.Response:
        return web.json_response({"worker_id": self.worker_id, "faults": self.faults.to_dict()})

    async def _post_faults(self, r: web.Request) -> web.Response:
        try:
            patch = await r.json()
            await self.apply_faults(patch)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(ApiError(400, str(exc)))
        log.warning("faults set", worker=self.worker_id, faults=self.faults.to_dict())
        return web.json_response({"worker_id": self.worker_id, "faults": self.faults.to_dict()})

    async def _tokenize(self, r: web.Request) -> web.Response:
        """vLLM's /tokenize: a completion (``prompt``) or a chat (``messages`` and the template
        inputs) -> ``{count, max_model_len, tokens, token_strs}``."""
        try:
            body = await _json_body(r)
            if "messages" in body:
                p = parse_request("chat", body, self.tokenizer, self.settings.model)
                ids = p.prompts[0].token_ids
            elif isinstance(body.get("prompt"), str):
                try:
                    special = adds_special_tokens(body, chat=False)
                except ValueError as exc:
                    raise ApiError(400, str(exc), "add_special_tokens") from None
                ids = self.tokenizer.encode(body["prompt"], special)
            else:
                raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt")
        except ApiError as exc:
            return _error(exc)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine_config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [self.tokenizer.decode([i]) for i in ids]
        return web.json_response(out)

    async def _detokenize(self, r: web.Request) -> web.Response:
        try:
            body = await _json_body(r)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        except ApiError as exc:
            return _error(exc)
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def _model(self, r: web.Request) -> web.Response:
        want = r.match_info["model_id"]
        resp = await self._models(r)
        data = json.loads(resp.body)["data"]  # type: ignore[arg-type]
        for card in data:
            if card["id"] == want:
                return web.json_response(card)
        return _error(
            ApiError(404, f"The model `{want}` does not exist.", "model", "NotFoundError")
        )

    async def _ping(self, _r: web.Request) -> web.Response:
        return web.Response(text="")

    async def _embeddings(self, r: web.Request) -> web.Response:
        """Synthetic, deterministic embeddings (vLLM's /v1/embeddings shape): each input's
        vector is a unit vector derived from its token ids, so equal inputs embed equally."""
        try:
            body = await _json_body(r)
            if "input" not in body:
                raise ApiError(400, "'input' is required", "input")
            try:
                inputs = completion_prompts({"prompt": body["input"]})
            except ValueError as exc:
                raise ApiError(400, str(exc).replace("prompt", "input"), "input") from None
            dims = body.get("dimensions")
            if dims is None:
                dims = EMBEDDING_DIMS
            if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 4096:
                raise ApiError(400, "'dimensions' must be an integer in [1, 4096]", "dimensions")
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise ApiError(
                    400, "'encoding_format' must be 'float' or 'base64'", "encoding_format"
                )
        except ApiError as exc:
            return _error(exc)
        data = []
        total = 0
        for i, item in enumerate(inputs):
            ids = self.tokenizer.encode(item) if isinstance(item, str) else item
            total += len(ids)
            vec = synthetic_embedding(ids, dims)
            emb: Any = vec
            if fmt == "base64":
                import base64
                import struct

                emb = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": emb})
        return web.json_response(
            {
                "id": "embd-" + uuid.uuid4().hex,
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model") or self.settings.model,
                "data": data,
                "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
            }
        )

    async def _completions(self, r: web.Request) -> web.StreamResponse:
        return await self._generate(r, "completion")

    async def _chat(self, r: web.Request) -> web.StreamResponse:
        return await self._generate(r, "chat")

    async def _generate(self, r: web.Request, kind: str) -> web.StreamResponse:
        t0 = time.monotonic()
        s = self.settings
        c = self.engine_config
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        try:
            body = await _json_body(r)
            p = parse_request(
                kind,  # type: ignore[arg-type]
                body,
                self.tokenizer,
                s.model,
                s.loras,
                s.strict_model,
                c.max_model_len,
                c.output_vocab,
                c.scheduling == "priority",
            )
            # vLLM builds the response id from the client's request_id (or X-Request-Id)
            rid = prefix + (p.request_id or r.headers.get("x-request-id") or uuid.uuid4().hex)
            if f"{rid}-0-0" in self._streams:
                rid = prefix + uuid.uuid4().hex  # a reused id must not mix two requests' outputs
            if self.faults.reject and self._rng.random() < self.faults.reject:
                raise ApiError(503, "the worker is overloaded (injected fault)")
            pd = parse_handshake(body, self.settings.pd.role)
            if pd is not None and (len(p.prompts) != 1 or p.n != 1):
                raise ApiError(400, "a disaggregated (P/D) request takes one prompt and n = 1")
            outs: list[Output] = []
            for pi, prompt in enumerate(p.prompts):
                mt = p.max_tokens_for(len(prompt.token_ids), c.max_model_len, s.default_max_tokens)
                if pd is not None and pd.side == "prefill":
                    mt = 1  # a prefill engine computes the prompt and its first token only
                try:
                    self.engine.check(len(prompt.token_ids), mt)
                except AdmissionError as exc:
                    param = "prompt" if kind == "completion" else "messages"
                    raise ApiError(400, str(exc), "max_tokens" if p.max_tokens else param) from None
                for j in range(p.n):
                    outs.append(
                        Output(
                            request_id=f"{rid}-{pi}-{j}",
                            index=pi * p.n + j,
                            prompt_index=pi,
                            prompt=prompt,
                            max_tokens=mt,
                            seed=p.choice_seed(pi, j),
                            p=p,
                            tokenizer=self.tokenizer,
                            vocab=c.output_vocab,
                        )
                    )
        except ApiError as exc:
            return _error(exc)
        q: asyncio.Queue[tuple[str, str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        now = loop.time() * s.speedup
        kv_in: asyncio.Future[bool] | None = None
        for o in outs:
            self._streams[o.request_id] = q
            if pd is not None and pd.side == "prefill":
                self._pd_keys[o.request_id] = f"{pd.kind}:{pd.key or o.request_id}"
            elif pd is not None:
                kv_in = loop.create_future()
                self._pd_pulls[o.request_id] = (pd, kv_in)
            self.engine.add_request(
                SimRequest(
                    o.request_id,
                    o.prompt.token_ids,
                    o.max_tokens,
                    p.lora,
                    now,
                    sample_seed=o.seed,
                    cache_salt=p.cache_salt,
                    output_vocab=p.vocab,
                    kv_from_remote=pd is not None and pd.side == "decode",
                    hold_blocks=pd is not None and pd.side == "prefill",
                    priority=p.priority,
                ),
                now,
            )
        self._wake.set()
        arrival_ns = time.time_ns()
        done = False
        try:
            if kv_in is not None and pd is not None and pd.kind == "bootstrap":
                # SGLang: nothing is answered before the prompt's KV is here (a failed
                # transfer is an error the router can retry, not a broken stream)
                if not await kv_in:
                    return _error(ApiError(503, "the KV transfer from the prefill worker failed"))
            if pd is not None and pd.side == "prefill" and pd.kind == "nixl" and not p.stream:
                resp = await self._collect(r, p, rid, outs, q, t0)
                o = outs[0]
                if resp.status == 200 and o.finish_reason != "abort":
                    payload = json.loads(resp.body)  # type: ignore[arg-type]
                    payload["kv_transfer_params"] = nixl_response_params(
                        self.instance_id,
                        o.request_id,
                        self.engine.held.get(o.request_id, []),
                        s.advertise_host or s.host,
                        s.port,
                        len(o.prompt.token_ids),
                    )
                    resp = web.json_response(payload)
                done = True
                return resp
            if p.stream:
                resp = await self._stream(r, p, rid, outs, q, t0)
            else:
                resp = await self._collect(r, p, rid, outs, q, t0)
            done = True
            return resp
        finally:
            for o in outs:
                self._streams.pop(o.request_id, None)
                if not done or not o.engine_done:
                    self.engine.abort(o.request_id)
            if self.tracer is not None:
                self._trace_steps(rid, outs, arrival_ns, now)

    def _trace_steps(self, rid: str, outs: list[Output], arrival_ns: int, arrival: float) -> None:
        """The request's engine steps under its server span: ``worker.queue`` (arrival until
        the engine admitted it), ``worker.prefill`` (until its first tokens reached the
        handler), ``worker.decode`` (until now); the first choice stands for all."""
        from opentelemetry import trace

        span = trace.get_current_span()
        if not span.is_recording() or not outs:
            return
        o = outs[0]
        end = time.time_ns()
        span.set_attributes(
            {
                "kvgate.worker": self.worker_id,
                "kvgate.request_id": rid,
                "kvgate.prompt_tokens": len(o.prompt.token_ids),
                "kvgate.cached_tokens": o.cached_tokens or 0,
                "kvgate.completion_tokens": sum(x.num_tokens for x in outs),
                "kvgate.choices": len(outs),
            }
        )
        if o.admitted_time is None:
            return  # never admitted (aborted while waiting)
        admitted = arrival_ns + int((o.admitted_time - arrival) / self.settings.speedup * 1e9)
        admitted = min(max(admitted, arrival_ns), end)
        first = o.first_ns or end
        steps = [("worker.queue", arrival_ns, admitted), ("worker.prefill", admitted, first)]
        if o.first_ns:
            steps.append(("worker.decode", first, end))
        parent = trace.set_span_in_context(span)
        for name, s, e in steps:
            self.tracer.start_span(name, context=parent, start_time=s).end(max(s, e))

    def _observe_ttft(self, t0: float) -> None:
        self.metrics.ttft.observe(time.monotonic() - t0)
        self.metrics.ttft_sim.observe((time.monotonic() - t0) * self.settings.speedup)

    async def _next_event(
        self, q: asyncio.Queue[tuple[str, str, Any]], by_id: dict[str, Output]
    ) -> tuple[str, Output | None, Any]:
        """The next engine event for one of this request's outputs; a stop string aborts the
        output's engine request at once (its KV blocks free up, like vLLM)."""
        kind, sub, val = await q.get()
        o = by_id.get(sub)
        if kind == "tokens" and o is not None and not o.first_ns and self.tracer is not None:
            o.first_ns = time.time_ns()
        if kind == "tokens" and o is not None and o.feed(val):
            self.engine.abort(o.request_id)
            self._wake.set()
        elif kind == "done" and o is not None:
            fin: FinishedRequest = val
            o.finish(fin.cached_tokens, fin.finish_reason)
            o.admitted_time = fin.admitted_time
        return kind, o, val

    @staticmethod
    def _usage(p: ParsedRequest, outs: list[Output]) -> dict[str, Any]:
        """vLLM's usage: each prompt counted once (whatever ``n``), every output's tokens."""
        firsts = {o.prompt_index: o for o in reversed(outs)}
        prompt = sum(len(o.prompt.token_ids) for o in firsts.values())
        cached = sum(o.cached_tokens or 0 for o in firsts.values())
        return usage(prompt, sum(o.num_tokens for o in outs), cached)

    async def _collect(
        self,
        r: web.Request,
        p: ParsedRequest,
        rid: str,
        outs: list[Output],
        q: asyncio.Queue[tuple[str, str, Any]],
        t0: float,
    ) -> web.StreamResponse:
        by_id = {o.request_id: o for o in outs}
        first = True
        while not all(o.engine_done for o in outs):
            kind, _o, _val = await self._next_event(q, by_id)
            if kind == "tokens" and first:
                self._observe_ttft(t0)
                first = False
            elif kind == "crash":  # the connection just breaks
                return _cut(r)
        choices = [
            Choice(
                index=o.index,
                text=o.full_text(),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                logprobs=o.full_logprobs(),
                token_ids=list(o.token_ids),
                prompt_token_ids=list(o.prompt.token_ids),
            )
            for o in outs
        ]
        body = full_response(p, rid, choices, self._usage(p, outs))
        if p.prompt_logprobs is not None:
            for ch, o in zip(body["choices"], outs, strict=True):
                ch["prompt_logprobs"] = o.prompt_logprobs()
        return web.json_response(body)

    async def _stream(
        self,
        r: web.Request,
        p: ParsedRequest,
        rid: str,
        outs: list[Output],
        q: asyncio.Queue[tuple[str, str, Any]],
        t0: float,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(r)
        created = int(time.time())
        by_id = {o.request_id: o for o in outs}

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        def running_usage(o: Output) -> dict[str, Any] | None:
            if not (p.include_usage and p.continuous_usage):
                return None
            return usage(len(o.prompt.token_ids), o.num_tokens, None)

        sent_final: set[int] = set()
        for o in outs:
            if p.kind == "chat":
                await send(chunk(p, rid, created, "", role=True, index=o.index))
            if p.echo:
                text, lp = o.stream_echo()
                if text or lp:
                    await send(chunk(p, rid, created, text, index=o.index, logprobs=lp))
        first = True
        while len(sent_final) < len(outs):
            kind, o, _val = await self._next_event(q, by_id)
            if kind == "crash":  # cut the stream
                return _cut(r, resp)
            if o is None or o.index in sent_final:
                continue
            if kind == "tokens":
                if first:
                    self._observe_ttft(t0)
                    first = False
                if not o.done and o.num_tokens % p.stream_interval:
                    continue  # stream_interval: one chunk every N tokens
                text, lp = o.take_delta(final=False)
                if o.done:  # stopped or at max_tokens: this chunk is its last
                    await send(
                        chunk(
                            p,
                            rid,
                            created,
                            text,
                            o.finish_reason,
                            index=o.index,
                            logprobs=lp,
                            stop_reason=o.stop_reason,
                            use=running_usage(o),
                        )
                    )
                    sent_final.add(o.index)
                elif text or lp is not None and lp.get("content", lp.get("tokens")):
                    await send(
                        chunk(
                            p, rid, created, text, index=o.index, logprobs=lp, use=running_usage(o)
                        )
                    )
            elif kind == "done":
                text, lp = o.take_delta(final=True)
                await send(
                    chunk(
                        p,
                        rid,
                        created,
                        text,
                        o.finish_reason,
                        index=o.index,
                        logprobs=lp,
                        stop_reason=o.stop_reason,
                        use=running_usage(o),
                    )
                )
                sent_final.add(o.index)
        if p.include_usage:
            while not all(o.engine_done for o in outs):  # cached_tokens of stopped outputs
                kind, _o, _v = await self._next_event(q, by_id)
                if kind == "crash":
                    return _cut(r, resp)
            await send(chunk(p, rid, created, None, use=self._usage(p, outs)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


EMBEDDING_DIMS = 64
# probes, scrapes and admin: no spans (the generation routes and the rest are traced)
_UNTRACED = ("/health", "/metrics", "/ping", "/admin/", "/v1/models", "/version")


def synthetic_embedding(ids: list[int], dims: int) -> list[float]:
    """A deterministic unit vector for a token sequence (equal inputs, equal vectors)."""
    import math

    import xxhash

    seed = xxhash.xxh3_64_intdigest(repr(ids).encode())
    raw = [
        (xxhash.xxh3_64_intdigest(i.to_bytes(4, "little"), seed=seed) % 20001 - 10000) / 10000
        for i in range(dims)
    ]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


async def _json_body(r: web.Request) -> dict[str, Any]:
    try:
        body = await r.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _cut(r: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """A crashed worker's connection breaks without an HTTP answer."""
    if r.transport is not None:
        r.transport.abort()
    return resp or web.Response(status=500)


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)
