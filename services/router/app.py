"""Router skeleton: workers from heartbeats, round robin, proxy."""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
from aiohttp import web

from services.common.bus import Bus
from services.common.schemas import WorkerHeartbeat
from services.common.service import metrics_handler, start_http
from services.common.subjects import Subjects


async def serve(st, stop: asyncio.Event) -> None:
    bus = Bus(st.nats_url, "router", Subjects(st.subject_prefix))
    await bus.connect()
    workers: dict[str, tuple[WorkerHeartbeat, float]] = {}
    rr = itertools.count()

    async def on_hb(hb: WorkerHeartbeat, _raw) -> None:
        workers[hb.worker_id] = (hb, time.monotonic())

    await bus.subscribe(bus.subjects.heartbeat_all, WorkerHeartbeat, on_hb)

    def live() -> list[WorkerHeartbeat]:
        now = time.monotonic()
        return sorted(
            (hb for hb, seen in workers.values() if now - seen < st.worker_timeout),
            key=lambda h: h.worker_id,
        )

    session = aiohttp.ClientSession()

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": len(live())})

    async def proxy(r: web.Request) -> web.Response:
        candidates = live()
        if not candidates:
            return web.json_response(
                {"error": {"message": "no workers available", "type": "unavailable"}}, status=503
            )
        hb = candidates[next(rr) % len(candidates)]
        body = await r.read()
        async with session.post(
            hb.url + r.path, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            data = await resp.read()
            return web.Response(
                body=data,
                status=resp.status,
                content_type="application/json",
                headers={"x-kvgate-worker": hb.worker_id, "x-kvgate-policy": "round_robin"},
            )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_post("/v1/completions", proxy)
    runner = await start_http(app, st.host, st.port)
    await stop.wait()
    await runner.cleanup()
    await session.close()
    await bus.close()
