"""Helpers for the router tests (no tests here): a tiny OpenAI-compatible worker whose
behaviour each test controls, its heartbeats and KV events on the real bus, and a router
running in-process on a free port.

The fake worker is an HTTP engine endpoint (not NATS/Postgres), so faking it is allowed; it
tokenizes byte-level like the router and publishes canonical keys for prompts it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.schemas import (
    BlockStored,
    KvEventBatch,
    WorkerCapacity,
    WorkerHeartbeat,
    WorkerLoad,
)
from services.common.tokenizer import ByteTokenizer, prompt_from_request
from services.core.keys import block_keys
from services.router.app import Router, start_router_http
from services.router.cli import settings
from services.router.http_server import Server
from services.router.public_surface import server_ssl_context

BS = 16


async def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition that has no event to await, with a deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s: {what}")
        await asyncio.sleep(0.02)


async def shutdown(*steps: tuple[str, Any], each_s: float = 15.0) -> None:
    """Run teardown steps in order, each bounded, so one stuck step cannot hang the suite
    (a stuck step is reported on stderr and the rest still run)."""
    import sys

    for name, coro in steps:
        try:
            await asyncio.wait_for(coro, each_s)
        except TimeoutError:
            print(f"teardown step {name!r} did not finish in {each_s}s", file=sys.stderr)


@dataclass
class FakeWorker:
    """A controllable engine: answers completions / chat (streaming or not)."""

    worker_id: str
    model: str = "m"
    chunks: int = 4  # streamed chunks per answer
    chunk_text: str = "ab "
    mode: str = "ok"  # ok | 503 | 500 | hang | crash_mid | slow
    crash_after: int = 2  # chunks before dying (crash_mid)
    hold: asyncio.Event | None = None  # answers wait for this (keep requests in flight)
    delay_s: float = 0.0  # each answer takes this long first (a slow worker)
    role: str = "both"  # disaggregated serving: both | prefill | decode (its heartbeats say)
    capacity: WorkerCapacity = field(
        default_factory=lambda: WorkerCapacity(
            block_size=BS, num_gpu_blocks=4096, max_num_seqs=64, max_model_len=8192
        )
    )
    port: int = 0
    served: list[dict[str, Any]] = field(default_factory=list)
    held_keys: set[int] = field(default_factory=set)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    started: asyncio.Event = field(default_factory=asyncio.Event)  # a request arrived
    _runner: web.AppRunner | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _bus: Bus | None = None
    _seq: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def heartbeat(self, state: str = "ready") -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            url=self.url,
            model=self.model,
            capacity=self.capacity,
            state=state,  # type: ignore[arg-type]
            role=self.role,  # type: ignore[arg-type]
            ts=time.time(),
        )

    async def start(self, bus: Bus | None = None) -> FakeWorker:
        self._bus = bus
        self.port = free_port()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self._stopping.set()
        if self.hold is not None:
            self.hold.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _r: web.Request) -> web.Response:
        if self.mode in ("503", "500", "hang", "down"):
            return web.json_response({"status": "bad"}, status=503)
        return web.json_response({"status": "ok"})

    async def publish_kv(self, prompt: str) -> None:
        keys = block_keys(ByteTokenizer().encode(prompt), self.capacity.block_size)
        new = [k for k in keys if k not in self.held_keys]
        if not new or self._bus is None:
            return
        self.held_keys.update(keys)
        parent = keys[len(keys) - len(new) - 1] if len(keys) > len(new) else None
        self._seq += 1
        await self._bus.publish(
            self._bus.subjects.kv_events(self.worker_id),
            KvEventBatch(
                worker_id=self.worker_id,
                instance_id=self.instance_id,
                seq=self._seq,
                ts=time.time(),
                events=[BlockStored(keys=new, parent_key=parent, block_size=BS)],
            ),
        )

    async def _complete(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        chat = r.path.endswith("chat/completions")
        self.served.append({"body": body, "path": r.path, "headers": dict(r.headers)})
        self.started.set()
        if self.mode == "503":
            return web.json_response({"error": "overloaded"}, status=503)
        if self.mode == "500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "400":
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        if self.mode == "hang":
            await self._stopping.wait()
            return web.json_response({"error": "stopped"}, status=503)
        if self.hold is not None:
            await self.hold.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the slowness under test, not synchronisation
        prompt = prompt_from_request(ByteTokenizer(), body)
        prompt_tokens = len(ByteTokenizer().encode(prompt))
        held = block_keys(ByteTokenizer().encode(prompt), BS)
        cached = sum(1 for k in held if k in self.held_keys) * BS
        # byte-level: a chunk of k characters is k tokens; never more than max_tokens
        per = len(self.chunk_text)
        n = min(self.chunks, max(1, int(body.get("max_tokens") or 10**6) // per))
        text_chunks = [self.chunk_text] * n
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n * len(self.chunk_text),
            "total_tokens": prompt_tokens + n * len(self.chunk_text),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await self.publish_kv(prompt)
        rid = f"cmpl-{uuid.uuid4().hex[:8]}"
        if not body.get("stream"):
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text_chunks)},
                    "finish_reason": "length",
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": "".join(text_chunks), "finish_reason": "length"}
                obj = "text_completion"
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [choice],
                    "usage": usage,
                },
                headers={"x-served-by": self.worker_id},
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        for i, t in enumerate(text_chunks):
            if self.mode == "crash_mid" and i == self.crash_after:
                # die: drop the connection without [DONE]
                assert r.transport is not None
                r.transport.close()
                return resp
            last = i == len(text_chunks) - 1
            if chat:
                ch = {
                    "index": 0,
                    "delta": {"content": t},
                    "finish_reason": "length" if last else None,
                }
                obj = "chat.completion.chunk"
            else:
                ch = {"index": 0, "text": t, "finish_reason": "length" if last else None}
                obj = "text_completion"
            data = {"id": rid, "object": obj, "created": 1, "model": self.model, "choices": [ch]}
            await resp.write(b"data: " + _json(data) + b"\n\n")
            await asyncio.sleep(0)
        so = body.get("stream_options") or {}
        if so.get("include_usage"):
            data = {
                "id": rid,
                "object": "x",
                "created": 1,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(b"data: " + _json(data) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _json(obj: Any) -> bytes:
    import json

    return json.dumps(obj).encode()


class Beats:
    """Publish heartbeats (and optional telemetry) for workers every 0.2 s."""

    def __init__(self, bus: Bus, workers: list[FakeWorker]) -> None:
        self.bus = bus
        self.workers = workers
        self.loads: dict[str, WorkerLoad] = {}
        self.paused: set[str] = set()
        self._task: asyncio.Task | None = None

    async def beat_once(self) -> None:
        for w in self.workers:
            if w.worker_id in self.paused:
                continue
            await self.bus.publish(self.bus.subjects.heartbeat(w.worker_id), w.heartbeat())
            load = self.loads.get(w.worker_id)
            if load is not None:
                load.ts = time.time()
                await self.bus.publish(self.bus.subjects.telemetry(w.worker_id), load)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.beat_once()
            await asyncio.sleep(0.2)

    def start(self) -> Beats:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task:
            # re-cancels: nats-py can swallow a cancel that lands inside a publish
            await cancel_and_wait([self._task])


class Indexer:
    """The real kv_indexer service, in-process on its own bus connection (feeds the
    routers' index replicas)."""

    def __init__(self, nats_url: str, subjects) -> None:
        self.nats_url = nats_url
        self.subjects = subjects
        self.bus: Bus | None = None
        self.svc: Any = None

    async def start(self) -> Indexer:
        from services.kv_indexer.app import IndexerService

        self.bus = Bus(self.nats_url, "indexer-test", self.subjects)
        await self.bus.connect(max_wait_s=10)
        self.svc = IndexerService(self.bus, tick_s=0.02)
        await self.svc.start()
        return self

    async def stop(self) -> None:
        if self.svc is not None:
            await self.svc.stop()
        if self.bus is not None:
            await self.bus.close()


class RouterProc:
    """A Router on its own bus connection and a free port, in this event loop."""

    def __init__(self, nats_url: str, subjects, **overrides: Any) -> None:
        self.nats_url = nats_url
        self.subjects = subjects
        self.overrides = overrides
        self.port = free_port()
        self.bus: Bus | None = None
        self.router: Router | None = None
        self._server: Server | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.overrides.get("tls_cert") else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    async def start(self) -> RouterProc:
        st = settings(
            nats_url=self.nats_url,
            subject_prefix=self.subjects.prefix.rstrip("."),
            port=self.port,
            **{"queue_timeout": 5.0, "breaker_open_s": 0.3, **self.overrides},
        )
        self.bus = Bus(self.nats_url, "router-test", self.subjects)
        await self.bus.connect(max_wait_s=10)
        self.router = Router(st, self.bus)
        await self.router.start()
        self._server = await start_router_http(
            self.router,
            "127.0.0.1",
            self.port,
            shutdown_s=0.5,
            ssl_context=server_ssl_context(st.tls_cert, st.tls_key),
        )
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
        if self.router is not None:
            await self.router.stop()
        if self.bus is not None:
            await self.bus.close()

    async def wait_workers(self, n: int, timeout: float = 10.0) -> None:
        assert self.router is not None
        r = self.router
        await wait_until(lambda: r.state.routable_count() >= n, timeout, f"{n} routable workers")


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    # bounded, so a request the router never answers fails its test instead of hanging it
    timeout = aiohttp.ClientTimeout(total=60)
    async with session.post(url, json=body, headers=headers or {}, timeout=timeout) as r:
        return r.status, dict(r.headers), await r.read()
