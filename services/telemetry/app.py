"""The telemetry agent: discovery, scraping, NVML sampling, publishing, detection (the I/O shell).

Every ``interval_s`` (100 ms by default) the event loop wakes once and
1. reads, without waiting, each target's answer to the request sent at an earlier tick
   (polled on its kept-alive connection: no wake-up per answer) and sends it the next one,
2. turns the answers into one :class:`WorkerLoad` per worker, stamped with the time its
   request was sent and carrying the worker's latest GPU samples, and publishes them on
   ``telemetry.<worker>`` in one burst,
3. kicks the GPU thread, which samples every GPU through :mod:`services.telemetry.nvml`.
Targets without an open connection, https targets and retries go through a task each
(bounded by ``max_concurrency``); every scrape has ``scrape_timeout_s``.

Every ``detect_interval_s`` it evaluates the detectors over each worker's recent samples and
sends alert transitions with :func:`raise_alert` (retried while NATS is away).

Invariants:
- A failed or timed-out scrape is published as ``stale=True`` with the error text and None
  engine values (never zeros); GPU readings, which do not depend on the engine, are kept.
- A target never has two scrapes in flight; a slow target does not delay the others.
- No NVML or no GPUs: one log line at start, engine metrics only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from nats.aio.msg import Msg

from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    Alert,
    GpuSample,
    RouterOutcome,
    WorkerHeartbeat,
    WorkerLoad,
    encode,
)
from services.common.streams import ensure_alert_streams, raise_alert

from . import exporter, procmap
from .detectors import DetectorSet, Observation, build_rules
from .engines import EngineReading, carry_slow, filter_query, parse_fast_vllm, parse_metrics
from .httpget import Conn, HttpError, request_bytes
from .nvml import GpuCollector, open_collector
from .targets import GpuAssignment, Target, assign_gpus, metrics_url

log = get_logger("telemetry")
_SCRAPES_OK = exporter.SCRAPES.labels("ok")
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


@dataclass
class _Worker:
    target: Target
    inflight: bool = False  # a scrape is in flight (polled or in a task)
    polled: bool = False  # ... and it is a polled request on ``conn`` (sent by a tick)
    conn: Conn | None = None  # kept-alive connection (http targets)
    started: float = 0.0  # the polled request: wall time sent (the sample's ts) ...
    req_filtered: bool = False  # ... whether it asked for name[]-filtered series ...
    req_fast: bool = False  # ... and for the fast-changing ones only
    scrapes: int = 0  # scrapes started (the slow series are asked for every Nth)
    slow_reading: EngineReading | None = None  # the last reading with the slow series
    requests: dict[str, bytes] = field(default_factory=dict)  # URL -> request bytes
    window: deque[Observation] = field(default_factory=deque)
    last: WorkerLoad | None = None
    engine_gpus: tuple[GpuSample, ...] = ()  # GPUs the engine reports itself (simulated)
    hit_base: tuple[float, float, float] | None = None  # (ts, queries, hits)
    hit_rate: float | None = None
    prompt_obs: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    new_obs: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    pids: set[int] = field(default_factory=set)
    filter_ok: bool = True  # the endpoint answers the name[] filter usefully
    detected: str | None = None  # engine seen in the last reading (when not configured)
    urls: dict[tuple[str, str], str] = field(default_factory=dict)  # (url, query) -> URL
    # the last answer and its reading: an identical answer (an idle engine) is not parsed again
    last_answer: bytes = b""
    last_reading: EngineReading | None = None


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
        self._session: aiohttp.ClientSession | None = None  # https targets
        self._gpu_thread: _GpuThread | None = None
        self._slots = _Slots(config.max_concurrency)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending_alerts: deque[Alert] = deque(maxlen=10_000)
        self._subs: list[Any] = []
        self._err_log = RateLimiter(60.0)
        self._stopping = False
        self._outbox: list[WorkerLoad] = []
        self._ok_count = 0  # successful scrapes not yet added to the Prometheus counter
        self._subjects: dict[str, str] = {}  # worker -> telemetry subject
        self._skipped: set[str] = set()  # discovered workers left to other agents
        self._slow_every = max(1, config.engine_slow_every)
        self.ticks = 0
        self.published = 0
        self.alerts_sent: list[Alert] = []  # last transitions (bounded), for /health and tests
        self._collector = exporter.TelemetryCollector(self._gpu_rows, self.latest_loads)
        for t in config.static_targets.values():
            self.workers[t.worker_id] = _Worker(target=t)

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
            self._gpu_thread = _GpuThread(self)
            self._gpu_thread.start()
        exporter.register(self._collector)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.cfg.max_concurrency, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.cfg.scrape_timeout_s),
            auto_decompress=True,
        )
        s = self.bus.subjects
        await ensure_alert_streams(self.bus)
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
        if self._session is not None:
            await self._session.close()
        for w in self.workers.values():
            if w.conn is not None:
                w.conn.close()
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

    # ------------------------------------------------------------------ bus inputs
    async def _on_heartbeat(self, hb: WorkerHeartbeat, _raw: Msg) -> None:
        w = self.workers.get(hb.worker_id)
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
            log.info("worker discovered", worker=hb.worker_id, url=url, engine=hb.engine)
        t = w.target
        if not t.static:
            with contextlib.suppress(ValueError):
                t.url = metrics_url(hb.url)
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
            w.prompt_obs.append(o.prompt_tokens)
            w.new_obs.append(o.completion_tokens)

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
                self._scrape_tick()
            except Exception as exc:  # a bug must not stop sampling for good
                self._log_once("tick", "scrape tick failed", error=repr(exc))
            await self._flush_outbox()
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

    def _scrape_tick(self) -> None:
        """Poll every target's request in flight on its kept-alive connection (non-blocking
        reads: the answers have been sitting in the socket buffers since the last tick), send
        the next request right away on each connection that finished, then turn the answers
        into samples. Targets with no open connection (first scrape, reconnects), https
        targets and name[] fallbacks go through :meth:`_scrape` (a task)."""
        now, mono = time.time(), time.monotonic()
        timeout = self.cfg.scrape_timeout_s
        done: list[tuple[_Worker, float, bool, bool, Any]] = []
        for w in self.workers.values():
            if w.polled:
                conn = w.conn
                assert conn is not None
                res: Any
                try:
                    res = conn.poll()
                except Exception as exc:
                    res = exc
                if res is None:
                    if mono - conn.sent_at < timeout:
                        continue  # still coming (large or slow answer): next tick
                    conn.close()
                    res = TimeoutError("scrape timed out")
                w.polled = w.inflight = False
                self._slots.give()
                if isinstance(res, HttpError) and res.idle_close:
                    # the engine had closed the idle connection: retry once on a new one
                    w.conn = None
                    w.inflight = True
                    self._spawn(self._scrape(w, w.started), "scrape")
                    continue
                done.append((w, w.started, w.req_filtered, w.req_fast, res))
            if not w.inflight:
                self._start(w, now, mono)
        for w, started, filtered, fast, res in done:
            self._complete(w, started, filtered, fast, res)

    def _start(self, w: _Worker, now: float, mono: float) -> None:
        """Start a scrape of ``w``: polled on its open connection where there is one, else
        as a task (which connects)."""
        w.inflight = True
        conn = w.conn
        if conn is not None and not conn.closed and self._slots.try_take():
            url, filtered, fast = self._scrape_url(w, w.scrapes % self._slow_every != 0)
            req = w.requests.get(url)
            if req is None and url.startswith("http://"):
                req = w.requests[url] = request_bytes(url)[1]
            if req is not None:
                try:
                    conn.send(req)
                except (OSError, HttpError):
                    pass  # closed by send(): reconnect in the task below
                else:
                    w.polled = True
                    w.scrapes += 1
                    w.started, w.req_filtered, w.req_fast = now, filtered, fast
                    return
            self._slots.give()
        self._spawn(self._scrape(w), "scrape")

    def _complete(self, w: _Worker, started: float, filtered: bool, fast: bool, res: Any) -> None:
        """A polled answer (``(status, body)`` or the error) -> the worker's sample."""
        reading: EngineReading | None = None
        exc: BaseException | None = None
        try:
            if isinstance(res, BaseException):
                raise res
            status, body = res
            if status != 200:
                raise _ScrapeError("http", f"HTTP {status} from {w.target.url}")
            if body == w.last_answer and w.last_reading is not None:
                reading = w.last_reading  # readings are never modified once made
            else:
                w.last_reading = None
                base = w.slow_reading
                if fast and base is not None and (w.target.engine or w.detected) == "vllm":
                    # the usual vLLM answer: values straight from the bytes (None: not simple)
                    reading = parse_fast_vllm(body, base)
                if reading is None:
                    try:
                        text = body.decode("utf-8", errors="replace")
                        reading = parse_metrics(text, w.target.engine)
                    except ValueError:
                        if not filtered:
                            raise
                        # the engine stopped honouring name[] usefully: the next requests ask
                        # for everything (this answer is dropped, not published as an error)
                        self._drop_filter(w)
                        return
                    if not fast:
                        w.slow_reading = reading
                    elif base is not None:
                        carry_slow(reading, base)
                w.last_answer, w.last_reading = body, reading
            w.detected = reading.source
        except Exception as err:
            exc = err
        try:
            self._finish(w, started, None, reading, exc)
        except Exception as err:  # a bug here must not stop the other targets
            self._log_once("scrape-finish", "scrape bookkeeping failed", error=repr(err))

    def _gpus_for(self, worker: str) -> list[GpuSample]:
        gpus = self.assignment.gpus_of(worker)
        if not gpus:
            return []
        samples = self.gpu_samples
        if len(gpus) == 1:
            i = gpus[0]
            if i < len(samples) and samples[i].index == i:  # samples are in index order
                return [samples[i]]
        wanted = set(gpus)
        return [g for g in samples if g.index in wanted]

    async def _fetch(self, w: _Worker, url: str) -> str:
        await self._slots.take()
        try:
            if url.startswith("http://"):
                status, body = await self._fetch_http(w, url)
                if status != 200:
                    raise _ScrapeError("http", f"HTTP {status} from {url}")
                return body.decode("utf-8", errors="replace")
            return await self._fetch_aiohttp(url)
        finally:
            self._slots.give()

    async def _fetch_http(self, w: _Worker, url: str) -> tuple[int, bytes]:
        """GET on the worker's kept-alive connection, (re)connecting when needed; the
        connection is kept for the polled scrapes of the following ticks."""
        (host, port), req = request_bytes(url)
        timeout = self.cfg.scrape_timeout_s
        deadline = time.monotonic() + timeout
        conn = w.conn
        if conn is None or conn.closed or conn.resp is not None:
            if conn is not None:
                conn.close()
            w.conn = None
            conn = await Conn.open(host, port, timeout, self.cfg.max_body_bytes)
            if self._stopping:
                conn.close()
                raise asyncio.CancelledError
            w.conn = conn
        conn.send(req)
        return await conn.wait(max(0.0, deadline - time.monotonic()))

    async def _fetch_aiohttp(self, url: str) -> str:
        assert self._session is not None
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise _ScrapeError("http", f"HTTP {resp.status} from {url}")
            body = await resp.content.read(self.cfg.max_body_bytes + 1)
            if len(body) > self.cfg.max_body_bytes:
                raise _ScrapeError(
                    "too_large", f"metrics body over {self.cfg.max_body_bytes} bytes"
                )
            return body.decode("utf-8", errors="replace")

    async def _scrape(self, w: _Worker, started: float | None = None) -> None:
        """The general path of a scrape (connecting, https, name[] fallback)."""
        started = started or time.time()
        t0 = time.perf_counter()
        reading: EngineReading | None = None
        exc: Exception | None = None
        try:
            reading = await self._read_engine(w)
        except asyncio.CancelledError:
            w.inflight = False
            raise
        except Exception as err:
            exc = err
        try:
            self._finish(w, started, t0, reading, exc)
        finally:
            w.inflight = False

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
        if reading is not None:
            try:
                load = self._load_from(w, reading, started)
                typ = self._typicals(w, reading)
                self._ok_count += 1  # added to the counter once per tick
            except Exception as err:
                load, exc = None, err
        if load is None:
            reason, text = _classify(exc or ValueError("no reading"))
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
            load = WorkerLoad(
                worker_id=t.worker_id,
                ts=started,
                source=t.engine or "unknown",
                stale=True,
                error=text[:500],
                gpus=self._gpus_for(t.worker_id),
            )
        if t0 is not None:  # (a polled answer is read at the next tick: latency unknown)
            exporter.SCRAPE_SECONDS.observe(time.perf_counter() - t0)
        w.last = load
        self._remember(w, load, typ)
        self._outbox.append(load)
        return load

    async def _flush_outbox(self) -> None:
        out, self._outbox = self._outbox, []
        if self._ok_count:
            _SCRAPES_OK.inc(self._ok_count)
            self._ok_count = 0
        subjects = self._subjects
        publish = self.bus.client.publish
        for load in out:
            try:
                subject = subjects.get(load.worker_id)
                if subject is None:
                    subject = subjects[load.worker_id] = self.bus.subjects.telemetry(load.worker_id)
                await publish(subject, encode(load))
                self.published += 1
            except Exception as exc:
                _raise_if_cancelling()
                exporter.PUBLISH_ERRORS.inc()
                self._log_once("publish", "telemetry publish failed", error=repr(exc))

    def _scrape_url(self, w: _Worker, fast: bool = False) -> tuple[str, bool, bool]:
        """(URL to fetch, whether it carries the ``name[]`` filter, whether it asks for the
        fast-changing series only -- when ``fast`` is wanted, possible for the engine, and a
        full reading to complete it with exists)."""
        t = w.target
        if not (self.cfg.filter_query and w.filter_ok):
            return t.url, False, False
        engine = t.engine or w.detected
        fast = fast and w.slow_reading is not None and bool(filter_query(engine, True))
        query = filter_query(engine, fast)
        if not query:
            return t.url, False, False
        url = w.urls.get((t.url, query))
        if url is None:  # built once per (url, engine, variant)
            sep = "&" if "?" in t.url else "?"
            url = w.urls[(t.url, query)] = t.url + sep + query
        return url, True, fast

    def _drop_filter(self, w: _Worker) -> None:
        w.filter_ok = False
        log.info("metrics name filter not usable, scraping in full", worker=w.target.worker_id)

    async def _read_engine(self, w: _Worker) -> EngineReading:
        """Scrape and parse; asks for just the needed series (``name[]`` filter) where the
        engine's exposition supports it, and drops the filter for good for a target whose
        filtered answer holds none of them (an exposition that reads the query differently)."""
        t = w.target
        url, filtered, _ = self._scrape_url(w)
        text = await self._fetch(w, url)
        try:
            reading = parse_metrics(text, t.engine)
        except ValueError:
            if not filtered:
                raise
            self._drop_filter(w)
            reading = parse_metrics(await self._fetch(w, t.url), t.engine)
        w.detected = reading.source
        w.slow_reading = reading
        return reading

    def _typicals(self, w: _Worker, r: EngineReading) -> tuple[float | None, float | None]:
        cfg = self.cfg
        prompt: float | None = cfg.typical_prompt_tokens or None
        new: float | None = cfg.max_new_tokens or None
        if prompt is None:
            if r.prompt_tokens_count and r.prompt_tokens_count >= cfg.min_observed_requests:
                prompt = (r.prompt_tokens_sum or 0.0) / r.prompt_tokens_count
            elif len(w.prompt_obs) >= cfg.min_observed_requests:
                prompt = sum(w.prompt_obs) / len(w.prompt_obs)
        if new is None:
            if r.max_tokens_count and r.max_tokens_count >= cfg.min_observed_requests:
                new = (r.max_tokens_sum or 0.0) / r.max_tokens_count
            elif len(w.new_obs) >= cfg.min_observed_requests:
                new = sum(w.new_obs) / len(w.new_obs)
        return prompt, new

    def _load_from(self, w: _Worker, r: EngineReading, ts: float) -> WorkerLoad:
        cap = w.target.capacity
        max_batch = r.max_batch if r.max_batch is not None else (cap.max_num_seqs if cap else None)
        tpb = r.tokens_per_block or (cap.block_size if cap else None)
        cap_tokens = r.kv_capacity_tokens
        blocks_total = r.kv_blocks_total
        if cap_tokens is None and cap is not None:
            cap_tokens = cap.num_gpu_blocks * cap.block_size
            blocks_total = blocks_total or cap.num_gpu_blocks
        hit = r.cache_hit_rate
        if hit is None and r.prefix_cache_queries is not None and r.prefix_cache_hits is not None:
            hit = self._hit_rate(w, ts, r.prefix_cache_queries, r.prefix_cache_hits)
        w.engine_gpus = tuple(r.gpus)
        gpus = r.gpus + self._gpus_for(w.target.worker_id)
        return WorkerLoad(
            worker_id=w.target.worker_id,
            ts=ts,
            source=r.source,
            running=r.running,
            waiting=r.waiting,
            scheduled=r.scheduled,
            max_batch=max_batch,
            kv_usage=r.kv_usage,
            kv_blocks_total=blocks_total,
            kv_blocks_free=r.kv_blocks_free,
            tokens_per_block=tpb,
            prefix_cache_queries=r.prefix_cache_queries,
            prefix_cache_hits=r.prefix_cache_hits,
            gpus=gpus,
            kv_capacity_tokens=cap_tokens,
            cache_hit_rate=hit,
            prefix_caching=r.prefix_caching,
        )

    def _hit_rate(self, w: _Worker, ts: float, q: float, h: float) -> float | None:
        base = w.hit_base
        if base is None or q < base[1] or h < base[2]:  # first sight or counter reset
            w.hit_base = (ts, q, h)
            return w.hit_rate
        if ts - base[0] >= 1.0:
            dq = q - base[1]
            if dq > 0:
                w.hit_rate = min(1.0, max(0.0, (h - base[2]) / dq))
            w.hit_base = (ts, q, h)
        return w.hit_rate

    def _remember(
        self, w: _Worker, load: WorkerLoad, typ: tuple[float | None, float | None]
    ) -> None:
        o = Observation(
            ts=load.ts,
            stale=load.stale,
            error=load.error,
            source=load.source,
            running=load.running,
            waiting=load.waiting,
            scheduled=load.scheduled,
            max_batch=load.max_batch,
            kv_usage=load.kv_usage,
            kv_capacity_tokens=load.kv_capacity_tokens,
            tokens_per_block=load.tokens_per_block,
            prefix_caching=load.prefix_caching,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            kv_events=self.kv_events.get(w.target.worker_id, 0),
            typical_prompt_tokens=typ[0],
            typical_new_tokens=typ[1],
            gpus=tuple(load.gpus),
            url=w.target.url,
        )
        win = w.window
        win.append(o)
        horizon = o.ts - self.history_s
        while win and win[0].ts < horizon:
            win.popleft()

    # ------------------------------------------------------------------ detection
    async def _detect_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.cfg.detect_interval_s)
            try:
                await self.detect_once(time.time())
            except Exception as exc:  # a detector bug must not stop detection for good
                _raise_if_cancelling()
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
                out.extend(self.detectors.book.forget(wid, now))
                continue
            if w.window:
                out.extend(self.detectors.evaluate(wid, list(w.window), now))
        self._pending_alerts.extend(out)
        await self._flush_alerts()
        return out

    async def _flush_alerts(self) -> None:
        while self._pending_alerts:
            alert = self._pending_alerts[0]
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                _raise_if_cancelling()  # nats-py can turn a cancellation into a timeout error
                exporter.ALERT_SEND_ERRORS.inc()
                self._log_once("alert-send", "alert send failed, will retry", error=repr(exc))
                return
            self._pending_alerts.popleft()
            exporter.ALERTS.labels(alert.kind, alert.state).inc()
            self.alerts_sent.append(alert)
            del self.alerts_sent[:-100]
            log.warning(
                "alert " + alert.state,
                kind=alert.kind,
                worker=alert.worker_id,
                summary=alert.summary,
                remedy=alert.remedy,
            )

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
                for g in w.engine_gpus:
                    yield g, [wid]

    def _log_once(self, key: Any, event: str, **kw: Any) -> None:
        if self._err_log.allow(key):
            log.warning(event, suppressed=self._err_log.take_suppressed(key), **kw)


def _raise_if_cancelling() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _GpuThread(threading.Thread):
    """Samples the GPUs off the event loop (NVML calls block, a sick driver for long) when
    the tick loop kicks it, and stores the result in ``agent.gpu_samples`` without waking
    the event loop: samples are read at the next tick. A kick while a sample is still being
    taken is remembered once (a slow driver skips ticks rather than piling them up)."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(name="telemetry-gpu", daemon=True)
        self.agent = agent
        self._kick = threading.Event()
        self._halt = False

    def kick(self) -> None:
        self._kick.set()

    def run(self) -> None:
        agent = self.agent
        while True:
            self._kick.wait()
            self._kick.clear()
            gpu = agent.gpu
            if self._halt or gpu is None:
                return
            try:
                agent.gpu_samples = gpu.sample()
            except Exception as exc:  # a broken driver must not end sampling
                agent._log_once("gpu-sample", "GPU sampling failed", error=repr(exc))

    def stop(self, timeout: float = 5.0) -> None:
        self._halt = True
        self._kick.set()
        self.join(timeout)


class _Slots:
    """At most ``n`` scrapes in flight, counted over both paths: :meth:`try_take` for the
    callback path (never waits), :meth:`take` for tasks (waits, first come first served)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # a slot handed over by give()
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give()  # handed a slot, then cancelled: pass it on
            raise

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class _ScrapeError(Exception):
    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


def _classify(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, _ScrapeError | HttpError):
        return exc.reason, str(exc)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timeout", "scrape timed out"
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionError):
        return "connect", f"cannot connect: {exc}"
    if isinstance(exc, aiohttp.ClientError):
        return "http", f"HTTP error: {exc!r}"
    if isinstance(exc, ValueError):
        return "parse", f"unreadable metrics: {exc}"
    return "error", repr(exc)


def _engine_name(engine: str | None) -> str | None:
    if not engine:
        return None
    low = engine.lower()
    if low in ("trt", "trtllm", "tensorrt-llm", "tensorrt_llm", "triton"):
        return "trtllm"
    if low in ("vllm", "sglang", "sim"):
        return low
    return None
