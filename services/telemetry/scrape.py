"""Reading the sources: each engine's Prometheus ``/metrics`` and the node's GPUs (NVML).

:class:`Scraper` owns the engine side. Each tick it polls every target's request in flight on
its kept-alive connection (non-blocking reads), sends the next request on each connection
that finished, and hands each answer to its ``finish`` callback as an
:class:`~services.telemetry.engines.EngineReading` or the exception that replaced it.
Targets with no open connection, https targets, retries and ``name[]`` fallbacks go through
a task each (:meth:`Scraper.scrape`), bounded together with the polled ones by
:class:`Slots`. :class:`GpuThread` samples the GPUs off the event loop when kicked.

Invariants:
- A target never has two scrapes in flight (``ScrapeState.inflight``); a slow target does
  not delay the others; every scrape ends within ``scrape_timeout_s``.
- ``finish`` is called once per scrape, with a reading or an error, with one exception: a
  polled answer that only shows that the ``name[]`` filter is unusable is dropped (the filter
  is turned off for good for that target) instead of being reported as an error.
- Readings are never modified once made, so an identical answer reuses the last reading.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import aiohttp

from services.common.logging import get_logger
from services.common.schemas import GpuSample

from .engines import EngineReading, carry_slow, filter_query, parse_fast_vllm, parse_metrics
from .httpget import Conn, HttpError, request_bytes
from .nvml import GpuCollector
from .targets import Target

log = get_logger("telemetry")
LogOnce = Callable[..., None]  # (rate-limit key, event, **fields)


@dataclass
class ScrapeState:
    """One target's scrape bookkeeping (connection, request in flight, reading cache)."""

    inflight: bool = False  # a scrape is in flight (polled or in a task)
    polled: bool = False  # ... and it is a polled request on ``conn`` (sent by a tick)
    conn: Conn | None = None  # kept-alive connection (http targets)
    started: float = 0.0  # the polled request: wall time sent (the sample's ts) ...
    req_filtered: bool = False  # ... whether it asked for name[]-filtered series ...
    req_fast: bool = False  # ... and for the fast-changing ones only
    scrapes: int = 0  # scrapes started (the slow series are asked for every Nth)
    slow_reading: EngineReading | None = None  # the last reading with the slow series
    # URL -> ((host, port), request bytes)
    requests: dict[str, tuple[tuple[str, int], bytes]] = field(default_factory=dict)
    filter_ok: bool = True  # the endpoint answers the name[] filter usefully
    detected: str | None = None  # engine seen in the last reading (when not configured)
    urls: dict[tuple[str, str], str] = field(default_factory=dict)  # (url, query) -> URL
    # the last answer and its reading: an identical answer (an idle engine) is not parsed again
    last_answer: bytes = b""
    last_reading: EngineReading | None = None


class Scrapable(Protocol):
    target: Target
    scrape: ScrapeState


W = TypeVar("W", bound=Scrapable)
# (worker, wall time the request was sent, perf_counter at start or None, reading, error)
Finish = Callable[[W, float, float | None, EngineReading | None, BaseException | None], None]
Spawn = Callable[[Coroutine[Any, Any, Any], str], Any]


@dataclass(frozen=True)
class ScrapeSettings:
    scrape_timeout_s: float
    max_concurrency: int
    max_body_bytes: int
    filter_query: bool  # ask vLLM/SGLang/sim for only the needed series (name[]=...)
    engine_slow_every: int  # ... and for the slow ones (config, histograms) every N scrapes


class ScrapeError(Exception):
    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


def classify(exc: BaseException) -> tuple[str, str]:
    """(reason label for the error counter, text for the stale sample) of a failed scrape."""
    if isinstance(exc, ScrapeError | HttpError):
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


class Scraper(Generic[W]):
    """Scrapes every target's ``/metrics``: polled on kept-alive connections at each
    :meth:`tick`, or as a task (:meth:`scrape`) where there is no usable connection."""

    def __init__(
        self, settings: ScrapeSettings, finish: Finish[W], spawn: Spawn, log_once: LogOnce
    ) -> None:
        self.cfg = settings
        self._finish = finish
        self._spawn = spawn
        self._log_once = log_once
        self._slots = Slots(settings.max_concurrency)
        self._slow_every = max(1, settings.engine_slow_every)
        self._session: aiohttp.ClientSession | None = None  # https targets
        self.stopping = False

    def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.cfg.max_concurrency, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.cfg.scrape_timeout_s),
            auto_decompress=True,
        )

    async def close(self, workers: Iterable[W]) -> None:
        if self._session is not None:
            await self._session.close()
        for w in workers:
            if w.scrape.conn is not None:
                w.scrape.conn.close()

    def tick(self, workers: Iterable[W]) -> None:
        """Poll every target's request in flight on its kept-alive connection (non-blocking
        reads: the answers have been sitting in the socket buffers since the last tick), send
        the next request right away on each connection that finished, then turn the answers
        into readings. Targets with no open connection (first scrape, reconnects), https
        targets and name[] fallbacks go through :meth:`scrape` (a task)."""
        now, mono = time.time(), time.monotonic()
        timeout = self.cfg.scrape_timeout_s
        done: list[tuple[W, float, bool, bool, Any]] = []
        for w in workers:
            st = w.scrape
            if st.polled:
                conn = st.conn
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
                st.polled = st.inflight = False
                self._slots.give()
                if isinstance(res, HttpError) and res.idle_close:
                    # the engine had closed the idle connection: retry once on a new one
                    st.conn = None
                    st.inflight = True
                    self._spawn(self.scrape(w, st.started), "scrape")
                    continue
                done.append((w, st.started, st.req_filtered, st.req_fast, res))
            if not st.inflight:
                self._start(w, now, mono)
        for w, started, filtered, fast, res in done:
            self._complete(w, started, filtered, fast, res)

    def _start(self, w: W, now: float, mono: float) -> None:
        """Start a scrape of ``w``: polled on its open connection where there is one, else
        as a task (which connects)."""
        st = w.scrape
        st.inflight = True
        conn = st.conn
        if conn is not None and not conn.closed and self._slots.try_take():
            url, filtered, fast = self._scrape_url(w, st.scrapes % self._slow_every != 0)
            req = None
            addressed = st.requests.get(url)
            if addressed is None and url.startswith("http://"):
                addressed = st.requests[url] = request_bytes(url)
            if addressed is not None and addressed[0] != conn.addr:
                # the target moved (an allowed heartbeat re-pointed it): the kept connection
                # is to the old engine; the task below connects to the new one
                conn.close()
                st.conn = None
            elif addressed is not None:
                req = addressed[1]
            if req is not None:
                try:
                    conn.send(req)
                except (OSError, HttpError):
                    pass  # closed by send(): reconnect in the task below
                else:
                    st.polled = True
                    st.scrapes += 1
                    st.started, st.req_filtered, st.req_fast = now, filtered, fast
                    return
            self._slots.give()
        self._spawn(self.scrape(w), "scrape")

    def _complete(self, w: W, started: float, filtered: bool, fast: bool, res: Any) -> None:
        """A polled answer (``(status, body)`` or the error) -> ``finish``."""
        st = w.scrape
        reading: EngineReading | None = None
        exc: BaseException | None = None
        try:
            if isinstance(res, BaseException):
                raise res
            status, body = res
            if status != 200:
                raise ScrapeError("http", f"HTTP {status} from {w.target.url}")
            if body == st.last_answer and st.last_reading is not None:
                reading = st.last_reading  # readings are never modified once made
            else:
                st.last_reading = None
                base = st.slow_reading
                if fast and base is not None and (w.target.engine or st.detected) == "vllm":
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
                        st.slow_reading = reading
                    elif base is not None:
                        carry_slow(reading, base)
                st.last_answer, st.last_reading = body, reading
            st.detected = reading.source
        except Exception as err:
            exc = err
        try:
            self._finish(w, started, None, reading, exc)
        except Exception as err:  # a bug here must not stop the other targets
            self._log_once("scrape-finish", "scrape bookkeeping failed", error=repr(err))

    async def _fetch(self, w: W, url: str) -> str:
        await self._slots.take()
        try:
            if url.startswith("http://"):
                status, body = await self._fetch_http(w, url)
                if status != 200:
                    raise ScrapeError("http", f"HTTP {status} from {url}")
                return body.decode("utf-8", errors="replace")
            return await self._fetch_aiohttp(url)
        finally:
            self._slots.give()

    async def _fetch_http(self, w: W, url: str) -> tuple[int, bytes]:
        """GET on the worker's kept-alive connection, (re)connecting when needed; the
        connection is kept for the polled scrapes of the following ticks."""
        st = w.scrape
        (host, port), req = request_bytes(url)
        timeout = self.cfg.scrape_timeout_s
        deadline = time.monotonic() + timeout
        conn = st.conn
        if conn is None or conn.closed or conn.resp is not None or conn.addr != (host, port):
            if conn is not None:
                conn.close()
            st.conn = None
            conn = await Conn.open(host, port, timeout, self.cfg.max_body_bytes)
            if self.stopping:
                conn.close()
                raise asyncio.CancelledError
            st.conn = conn
        conn.send(req)
        return await conn.wait(max(0.0, deadline - time.monotonic()))

    async def _fetch_aiohttp(self, url: str) -> str:
        assert self._session is not None
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise ScrapeError("http", f"HTTP {resp.status} from {url}")
            body = await resp.content.read(self.cfg.max_body_bytes + 1)
            if len(body) > self.cfg.max_body_bytes:
                raise ScrapeError("too_large", f"metrics body over {self.cfg.max_body_bytes} bytes")
            return body.decode("utf-8", errors="replace")

    async def scrape(self, w: W, started: float | None = None) -> None:
        """The general path of a scrape (connecting, https, name[] fallback)."""
        started = started or time.time()
        t0 = time.perf_counter()
        reading: EngineReading | None = None
        exc: Exception | None = None
        try:
            reading = await self._read_engine(w)
        except asyncio.CancelledError:
            w.scrape.inflight = False
            raise
        except Exception as err:
            exc = err
        try:
            self._finish(w, started, t0, reading, exc)
        finally:
            w.scrape.inflight = False

    def _scrape_url(self, w: W, fast: bool = False) -> tuple[str, bool, bool]:
        """(URL to fetch, whether it carries the ``name[]`` filter, whether it asks for the
        fast-changing series only -- when ``fast`` is wanted, possible for the engine, and a
        full reading to complete it with exists)."""
        t, st = w.target, w.scrape
        if not (self.cfg.filter_query and st.filter_ok):
            return t.url, False, False
        engine = t.engine or st.detected
        fast = fast and st.slow_reading is not None and bool(filter_query(engine, True))
        query = filter_query(engine, fast)
        if not query:
            return t.url, False, False
        url = st.urls.get((t.url, query))
        if url is None:  # built once per (url, engine, variant)
            sep = "&" if "?" in t.url else "?"
            url = st.urls[(t.url, query)] = t.url + sep + query
        return url, True, fast

    def _drop_filter(self, w: W) -> None:
        w.scrape.filter_ok = False
        log.info("metrics name filter not usable, scraping in full", worker=w.target.worker_id)

    async def _read_engine(self, w: W) -> EngineReading:
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
        w.scrape.detected = reading.source
        w.scrape.slow_reading = reading
        return reading


class Slots:
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


class GpuThread(threading.Thread):
    """Samples the GPUs off the event loop (NVML calls block, a sick driver for long) when
    kicked, and hands the result to ``store`` without waking the event loop: samples are
    read at the next tick. A kick while a sample is still being taken is remembered once
    (a slow driver skips ticks rather than piling them up). Ends when ``collector()`` is
    None or after :meth:`stop`."""

    def __init__(
        self,
        collector: Callable[[], GpuCollector | None],
        store: Callable[[list[GpuSample]], None],
        log_once: LogOnce,
    ) -> None:
        super().__init__(name="telemetry-gpu", daemon=True)
        self._collector = collector
        self._store = store
        self._log_once = log_once
        self._kick = threading.Event()
        self._halt = False

    def kick(self) -> None:
        self._kick.set()

    def run(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            gpu = self._collector()
            if self._halt or gpu is None:
                return
            try:
                self._store(gpu.sample())
            except Exception as exc:  # a broken driver must not end sampling
                self._log_once("gpu-sample", "GPU sampling failed", error=repr(exc))

    def stop(self, timeout: float = 5.0) -> None:
        self._halt = True
        self._kick.set()
        self.join(timeout)
