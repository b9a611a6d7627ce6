"""The telemetry agent: the wiring of discovery, scraping, sampling, detection and publishing.

Every ``interval_s`` (100 ms by default) the event loop wakes once and
1. has the :class:`~services.telemetry.scrape.Scraper` read, without waiting, each target's
   answer to the request sent at an earlier tick and send it the next one,
2. turns each answer into one :class:`WorkerLoad` (:mod:`services.telemetry.sample`),
   stamped with the time its request was sent and carrying the worker's latest GPU samples,
   and has the :class:`~services.telemetry.publish.LoadPublisher` send them on
   ``telemetry.<worker>`` in one burst,
3. kicks the GPU thread (:class:`~services.telemetry.scrape.GpuThread`), which samples every
   GPU through :mod:`services.telemetry.nvml`.

Every ``detect_interval_s`` it evaluates the detectors (:mod:`services.telemetry.detectors`)
over each worker's recent samples and hands the alert transitions to the
:class:`~services.telemetry.publish.AlertSender` (retried while NATS is away). Workers are
discovered from heartbeats and forgotten after ``forget_after_s`` without an accepted one.

Invariants:
- A failed or timed-out scrape is published as ``stale=True`` with the error text and None
  engine values (never zeros); GPU readings, which do not depend on the engine, are kept.
- A target never has two scrapes in flight; a slow target does not delay the others.
- No NVML or no GPUs: one log line at start, engine metrics only.
- The agent scrapes a discovered worker only at the URL its first accepted heartbeat named (a
  :class:`~services.core.url_pin.UrlPins` pin, as the routers keep): a later heartbeat naming
  another URL is refused (counted, logged) unless ``url_allow`` admits it, so a stolen worker
  credential cannot point the agent's HTTP requests at another host. Refused heartbeats do
  not keep a worker alive: an engine that really moved is scraped at its new URL once the
  old one is forgotten (``forget_after_s``), or at once when inside ``url_allow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from nats.aio.msg import Msg

from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.redact import redact_url
from services.common.schemas import Alert, GpuSample, RouterOutcome, WorkerHeartbeat, WorkerLoad
from services.common.streams import require_alert_streams
from services.core.url_pin import UrlAllowlist, UrlPins

from . import exporter, procmap, sample
from .detectors import DetectorSet, Observation, build_rules
from .engines import EngineReading
from .nvml import GpuCollector, open_collector
from .publish import AlertSender, LoadPublisher, raise_if_cancelling
from .sample import SampleState, TypicalSettings
from .scrape import GpuThread, Scraper, ScrapeSettings, ScrapeState, classify
from .targets import GpuAssignment, Target, assign_gpus, metrics_url

log = get_logger("telemetry")
_SCRAPES_ERR = exporter.SCRAPES.labels("error")


@dataclass
class AgentConfig:
    interval_s: float = 0.1
    scrape_timeout_s: float = 1.0
    max_concurrency: int = 128
    max_body_bytes: int = 8 << 20
    detect_interval_s: float = 1.0
    clear_s: float = 5.0
    forget_after_s: float = 60.0
    mapping_refresh_s: float = 10.0
    gpu_slow_every: int = 10
    static_targets: dict[str, Target] = field(default_factory=dict)
    gpu_map: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pid_map: dict[str, int] = field(default_factory=dict)
    detectors: dict[str, dict[str, Any]] = field(default_factory=dict)
    typical_prompt_tokens: float = 0.0  # > 0: configured, overrides observation
    max_new_tokens: float = 0.0
    min_observed_requests: int = 8
    use_nvml: bool = True
    filter_query: bool = True  # ask vLLM/SGLang/sim for only the needed series (name[]=...)
    engine_slow_every: int = 10  # ... and for the slow ones (config, histograms) every N scrapes
    # which heartbeat-discovered workers this agent scrapes (static targets always are):
    workers: tuple[str, ...] = ()  # fnmatch globs on the worker id; empty: every worker
    local_only: bool = False  # only workers whose engine URL's host is an address of this node
    # hosts a heartbeat may move a worker's URL to (and, when set, name at all): as the routers'
    url_allow: UrlAllowlist = field(default_factory=UrlAllowlist)


@dataclass
class _Worker:
    """One scraped worker: its target, scrape bookkeeping, sampling state and the detector
    window of its recent samples."""

    target: Target
    scrape: ScrapeState = field(default_factory=ScrapeState)
    sample: SampleState = field(default_factory=SampleState)
    window: deque[Observation] = field(default_factory=deque)
    last: WorkerLoad | None = None


class Agent:
    def __init__(self, bus: Bus, config: AgentConfig, nvml_lib: Any = None) -> None:
        self.bus = bus
        self.cfg = config
        self._nvml_lib = nvml_lib
        self.detectors = DetectorSet(build_rules(config.detectors), clear_s=config.clear_s)
        self.history_s = max(self.detectors.history_s, 2.0) * 1.25
        self.workers: dict[str, _Worker] = {}
        self.kv_events: dict[str, int] = {}
        self.gpu: GpuCollector | None = None
        self.nvml_reason = "not started"
        self.gpu_samples: list[GpuSample] = []
        self.assignment = GpuAssignment()
        self._gpu_thread: GpuThread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._err_log = RateLimiter(60.0)
        self._stopping = False
        self._skipped: set[str] = set()  # discovered workers left to other agents
        # pins live as long as the agent knows the worker (see the module's invariants)
        self.pins = UrlPins(config.url_allow)
        self._typical = TypicalSettings(
            config.typical_prompt_tokens, config.max_new_tokens, config.min_observed_requests
        )
        self.scraper: Scraper[_Worker] = Scraper(
            ScrapeSettings(
                config.scrape_timeout_s,
                config.max_concurrency,
                config.max_body_bytes,
                config.filter_query,
                config.engine_slow_every,
            ),
            self._finish,
            self._spawn,
            self._log_once,
        )
        self.loads = LoadPublisher(bus, self._log_once)
        self.alerts = AlertSender(bus, self._log_once)
        self.ticks = 0
        self._collector = exporter.TelemetryCollector(self._gpu_rows, self.latest_loads)
        for t in config.static_targets.values():
            self.workers[t.worker_id] = _Worker(target=t)

    @property
    def published(self) -> int:
        return self.loads.published

    @property
    def alerts_sent(self) -> list[Alert]:
        """The last alert transitions sent (bounded), for /health and tests."""
        return self.alerts.sent

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.cfg.use_nvml:
            self.gpu, self.nvml_reason = await asyncio.to_thread(
                open_collector, self._nvml_lib, self.cfg.gpu_slow_every
            )
        else:
            self.nvml_reason = "GPU collection disabled (--nvml false); engine metrics only"
        if self.gpu is None:
            log.warning("no GPU telemetry", reason=self.nvml_reason)
        else:
            self.nvml_reason = ""
            log.info("NVML ready", gpus=len(self.gpu.devices))
            self._gpu_thread = GpuThread(lambda: self.gpu, self._store_gpu, self._log_once)
            self._gpu_thread.start()
        exporter.register(self._collector)
        self.scraper.open()
        s = self.bus.subjects
        await require_alert_streams(self.bus)
        self._subs.append(
            await self.bus.subscribe(s.heartbeat_all, WorkerHeartbeat, self._on_heartbeat)
        )
        self._subs.append(await self.bus.client.subscribe(s.kv_events_all, cb=self._on_kv_event))
        self._subs.append(
            await self.bus.subscribe(s.router_outcomes, RouterOutcome, self._on_outcome)
        )
        self._spawn(self._tick_loop(), "telemetry-tick")
        self._spawn(self._detect_loop(), "telemetry-detect")
        self._spawn(self._mapping_loop(), "telemetry-mapping")

    async def stop(self) -> None:
        self._stopping = True  # loops end even if a library swallowed their cancellation
        self.scraper.stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            if stuck:
                log.warning("tasks did not stop in time", tasks=sorted(t.get_name() for t in stuck))
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.scraper.close(self.workers.values())
        exporter.unregister(self._collector)
        if self._gpu_thread is not None:
            await asyncio.to_thread(self._gpu_thread.stop)
            self._gpu_thread = None
        if self.gpu is not None:
            await asyncio.to_thread(self.gpu.close)
            self.gpu = None

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _store_gpu(self, samples: list[GpuSample]) -> None:
        self.gpu_samples = samples  # read by the next tick (GIL-atomic swap)

    # ------------------------------------------------------------------ bus inputs
    async def _on_heartbeat(self, hb: WorkerHeartbeat, _raw: Msg) -> None:
        w = self.workers.get(hb.worker_id)
        if w is None or not w.target.static:
            refusal = self.pins.check(hb.worker_id, hb.url)
            if refusal is not None:
                exporter.HEARTBEATS_REFUSED.labels(refusal).inc()
                pinned = self.pins.pinned(hb.worker_id)
                self._log_once(
                    ("hb-refused", hb.worker_id),
                    "heartbeat refused: it moves the worker's engine URL",
                    worker=hb.worker_id,
                    reason=refusal,
                    url=redact_url(hb.url),
                    pinned=redact_url(pinned) if pinned else None,
                    hint="if the engine really moved, it is scraped at the new URL once the "
                    "old one is forgotten (--forget-after), or add its network to "
                    "--worker-url-allow",
                )
                return
        if w is None:
            if hb.worker_id in self._skipped:
                return
            try:
                url = metrics_url(hb.url)
            except ValueError as exc:
                self._log_once(
                    ("hb-url", hb.worker_id),
                    "bad heartbeat url",
                    worker=hb.worker_id,
                    error=str(exc),
                )
                return
            why = await self._not_ours(hb.worker_id, url)
            if why:
                # decided once per worker id (an engine does not move between nodes)
                self._skipped.add(hb.worker_id)
                log.info("worker not scraped by this agent", worker=hb.worker_id, reason=why)
                return
            w = self.workers[hb.worker_id] = _Worker(
                target=Target(worker_id=hb.worker_id, url=url, engine=_engine_name(hb.engine))
            )
            self.pins.accept(hb.worker_id, hb.url)
            log.info("worker discovered", worker=hb.worker_id, url=url, engine=hb.engine)
        t = w.target
        if not t.static:
            with contextlib.suppress(ValueError):
                t.url = metrics_url(hb.url)
                self.pins.accept(hb.worker_id, hb.url)
            t.engine = _engine_name(hb.engine) or t.engine
        t.capacity = hb.capacity
        t.kv_events_declared = hb.kv_events
        t.last_heartbeat = time.time()

    async def _not_ours(self, worker: str, url: str) -> str:
        """Why a discovered worker is left to other agents ('' when this agent scrapes it):
        not matched by ``workers`` globs, or (``local_only``) its engine is on another node."""
        globs = self.cfg.workers
        if globs and not any(fnmatch.fnmatchcase(worker, g) for g in globs):
            return "not in --workers"
        if self.cfg.local_only:
            host = urlsplit(url).hostname or ""
            if not await asyncio.to_thread(procmap.is_local_host, host):
                return f"engine host {host} is not this node (--local-only)"
        return ""

    async def _on_kv_event(self, msg: Msg) -> None:
        worker = msg.subject.rsplit(".", 1)[-1]
        self.kv_events[worker] = self.kv_events.get(worker, 0) + 1

    async def _on_outcome(self, o: RouterOutcome, _raw: Msg) -> None:
        if not o.worker_id or o.status != "ok":
            return
        w = self.workers.get(o.worker_id)
        if w is not None:
            w.sample.prompt_obs.append(o.prompt_tokens)
            w.sample.new_obs.append(o.completion_tokens)

    # ------------------------------------------------------------------ sampling
    async def _tick_loop(self) -> None:
        """One wake-up per tick: read the answers to the previous tick's requests, send the
        next requests, publish the finished samples in one burst, then kick the GPU thread
        (whose samples the next tick's records carry)."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.interval_s
        next_at = loop.time()
        while not self._stopping:
            self.ticks += 1
            try:
                self.scraper.tick(self.workers.values())
            except Exception as exc:  # a bug must not stop sampling for good
                self._log_once("tick", "scrape tick failed", error=repr(exc))
            await self.loads.flush()
            if self._gpu_thread is not None:
                # after this tick's work, not during it: two threads running Python at once
                # hand the GIL back and forth at every socket call (each one a context switch)
                self._gpu_thread.kick()
            next_at += interval
            delay = next_at - loop.time()
            if delay < 0:  # fell behind (overloaded host): skip missed ticks, do not burst
                next_at = loop.time()
                delay = 0
            await asyncio.sleep(delay)

    def _finish(
        self,
        w: _Worker,
        started: float,
        t0: float | None,
        reading: EngineReading | None,
        exc: BaseException | None,
    ) -> WorkerLoad:
        """A scrape's result -> the worker's :class:`WorkerLoad` (stale with the error text
        when it failed), remembered for the detectors and queued for the next publish burst."""
        t = w.target
        load: WorkerLoad | None = None
        typ: tuple[float | None, float | None] = (None, None)
        gpus = sample.gpus_for(self.assignment, self.gpu_samples, t.worker_id)
        if reading is not None:
            try:
                load = sample.load_from(t, w.sample, reading, started, gpus)
                typ = sample.typicals(self._typical, w.sample, reading)
            except Exception as err:
                load, exc = None, err
        ok = load is not None
        if load is None:
            reason, text = classify(exc or ValueError("no reading"))
            _SCRAPES_ERR.inc()
            exporter.SCRAPE_ERRORS.labels(t.worker_id, reason).inc()
            self._log_once(
                ("scrape", t.worker_id, reason),
                "scrape failed",
                worker=t.worker_id,
                url=t.url,
                error=text,
            )
            typ = (None, None)
            load = sample.stale_load(t, started, text, gpus)
        if t0 is not None:  # (a polled answer is read at the next tick: latency unknown)
            exporter.SCRAPE_SECONDS.observe(time.perf_counter() - t0)
        w.last = load
        obs = sample.observation(t, load, self.kv_events.get(t.worker_id, 0), typ)
        sample.remember(w.window, obs, self.history_s)
        self.loads.add(load, ok)
        return load

    # ------------------------------------------------------------------ detection
    async def _detect_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.cfg.detect_interval_s)
            try:
                await self.detect_once(time.time())
            except Exception as exc:  # a detector bug must not stop detection for good
                raise_if_cancelling()
                self._log_once("detect", "detector evaluation failed", error=repr(exc))

    async def detect_once(self, now: float) -> list[Alert]:
        out: list[Alert] = []
        for wid, w in list(self.workers.items()):
            t = w.target
            if (
                not t.static
                and t.last_heartbeat
                and now - t.last_heartbeat > self.cfg.forget_after_s
            ):
                log.info("worker forgotten (no heartbeat)", worker=wid)
                del self.workers[wid]
                self.pins.drop(wid)
                out.extend(self.detectors.book.forget(wid, now))
                continue
            if w.window:
                out.extend(self.detectors.evaluate(wid, list(w.window), now))
        await self.alerts.send(out)
        return out

    # ------------------------------------------------------------------ GPU mapping
    async def _mapping_loop(self) -> None:
        while not self._stopping:
            if self.gpu is not None:
                try:
                    await self.refresh_mapping()
                except Exception as exc:
                    self._log_once("mapping", "GPU mapping refresh failed", error=repr(exc))
            await asyncio.sleep(self.cfg.mapping_refresh_s)

    async def refresh_mapping(self) -> None:
        workers = list(self.workers)
        need_pids = [w for w in workers if w not in self.cfg.gpu_map]
        gpu_pids: dict[int, set[int]] = {}
        worker_pids: dict[str, set[int]] = {}
        if need_pids and self.gpu is not None:
            gpu_pids = await asyncio.to_thread(self.gpu.running_pids)
            worker_pids = await asyncio.to_thread(self._worker_pids, need_pids)
        self.assignment = assign_gpus(workers, self.cfg.gpu_map, worker_pids, gpu_pids)

    def _worker_pids(self, workers: list[str]) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for wid in workers:
            base: set[int] = set()
            if wid in self.cfg.pid_map:
                base = {self.cfg.pid_map[wid]}
            else:
                w = self.workers.get(wid)
                if w is None:
                    continue
                parts = urlsplit(w.target.url)
                if parts.hostname in ("127.0.0.1", "localhost", "::1") and parts.port:
                    base = procmap.listening_pids(parts.port)
            out[wid] = procmap.with_descendants(base)
        return out

    # ------------------------------------------------------------------ views
    def latest_loads(self) -> dict[str, WorkerLoad]:
        return {wid: w.last for wid, w in self.workers.items() if w.last is not None}

    def _gpu_rows(self) -> Iterable[tuple[GpuSample, list[str]]]:
        """NVML's GPUs (mapped to their workers), then the GPUs engines report themselves
        (the simulated workers'), each labelled with its one worker."""
        for g in self.gpu_samples:
            yield g, self.assignment.workers_of(g.index)
        for wid, w in self.workers.items():
            if w.last is not None and not w.last.stale:
                for g in w.sample.engine_gpus:
                    yield g, [wid]

    def _log_once(self, key: Any, event: str, **kw: Any) -> None:
        if self._err_log.allow(key):
            log.warning(event, suppressed=self._err_log.take_suppressed(key), **kw)


def _engine_name(engine: str | None) -> str | None:
    if not engine:
        return None
    low = engine.lower()
    if low in ("trt", "trtllm", "tensorrt-llm", "tensorrt_llm", "triton"):
        return "trtllm"
    if low in ("vllm", "sglang", "sim"):
        return low
    return None
