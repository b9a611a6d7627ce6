"""Simulated worker skeleton: OpenAI-compatible answers and heartbeats on the bus."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from services.common.bus import Bus
from services.common.schemas import WorkerCapacity, WorkerHeartbeat
from services.common.service import start_http
from services.common.subjects import Subjects


def make_app(worker_id: str, model: str) -> web.Application:
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker_id": worker_id})

    async def models(_r: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "kvgate"}]}
        )

    async def chat(r: web.Request) -> web.Response:
        body = await r.json()
        text = f"hello from {worker_id}"
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", model),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            },
            headers={"x-kvgate-served-by": worker_id},
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def serve(st, stop: asyncio.Event) -> None:
    bus = Bus(st.nats_url, "sim-worker", Subjects(st.subject_prefix))
    await bus.connect()
    runners, beats = [], []
    for i in range(st.count):
        wid = st.worker_id if st.count == 1 else f"{st.worker_id}-{i}"
        port = st.port + i
        runners.append(await start_http(make_app(wid, st.model), st.host, port))
        hb = WorkerHeartbeat(
            worker_id=wid,
            instance_id=uuid.uuid4().hex[:12],
            url=f"http://{st.host}:{port}",
            model=st.model,
            capacity=WorkerCapacity(
                block_size=16, num_gpu_blocks=4096, max_num_seqs=64, max_model_len=8192
            ),
        )
        beats.append(hb)

    async def heartbeat() -> None:
        while True:
            for hb in beats:
                hb.ts = time.time()
                await bus.publish(bus.subjects.heartbeat(hb.worker_id), hb)
            await asyncio.sleep(st.heartbeat_interval)

    bus.spawn(heartbeat(), "heartbeat")
    await stop.wait()
    await bus.close()
    for r in runners:
        await r.cleanup()
