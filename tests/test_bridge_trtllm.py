"""TensorRT-LLM bridge: polls a stand-in trtllm-serve (aiohttp, the engine's HTTP API shape:
``POST /kv_cache_events`` draining a queue, ``GET /health``) and feeds the real indexer."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.service import start_http
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.core.keys import block_keys
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.bridges.trtllm import TrtllmBridge
from tests.test_kv_support import connected, indexer, wait_until


def block(h: int, toks: list[int], level: int = 0) -> dict:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
        "cache_level": level,
        "priority": 35,
    }


class FakeTrtllmServe:
    def __init__(self) -> None:
        self.queue: list[dict] = []
        self.next_id = 0
        self.polls = 0

    def add(self, data: dict) -> None:
        self.queue.append({"event_id": self.next_id, "data": data, "window_size": 2048})
        self.next_id += 1

    def app(self) -> web.Application:
        async def events(_r: web.Request) -> web.Response:
            self.polls += 1
            out, self.queue = self.queue, []
            return web.json_response(out)

        async def health(_r: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/kv_cache_events", events)
        app.router.add_get("/health", health)
        return app


async def test_trtllm_bridge_polls_rekeys_and_heartbeats(
    bus: Bus, nats_url: str, subjects: Subjects
) -> None:
    await require_kv_events_stream(bus)
    eng = FakeTrtllmServe()
    port = free_port()
    runner = await start_http(eng.app(), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    tokens = list(range(300, 300 + 32 * 6))
    keys = block_keys(tokens, 32)
    eng.add({"type": "created", "num_blocks_per_cache_level": [777, 64]})
    eng.add(
        {
            "type": "stored",
            "parent_hash": None,
            "blocks": [block(10 + i, tokens[32 * i : 32 * i + 32]) for i in range(4)],
        }
    )
    stop = asyncio.Event()
    try:
        async with indexer(nats_url, subjects) as svc, connected(nats_url, subjects, "br") as b:
            rt = BridgeRuntime(
                b, "trt-a", engine="trtllm", model="m", engine_url=url, heartbeat_s=0.2
            )
            await rt.start()
            tb = TrtllmBridge(rt, url, poll_s=0.02)
            task = asyncio.create_task(tb.run(stop))
            try:
                await wait_until(lambda: svc.core.index.find_matches(keys) == {"trt-a": 4})
                ws = svc.core.workers["trt-a"]
                assert ws.engine == "trtllm" and ws.block_size == 32
                # the heartbeat carries the engine's capacity from the "created" event
                assert rt.capacity().num_gpu_blocks == 777
                eng.add(
                    {
                        "type": "stored",
                        "parent_hash": 13,
                        "blocks": [block(14, tokens[128:160]), block(15, tokens[160:192], 1)],
                    }
                )
                eng.add(
                    {
                        "type": "updated",
                        "block_hash": 11,
                        "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                        "priority": None,
                    }
                )
                eng.add({"type": "removed", "block_hashes": [14, 15]})
                await wait_until(lambda: tb.last_event_id == eng.next_id - 1)
                await wait_until(lambda: svc.core.workers["trt-a"].last_seq == rt.out_seq)
                assert svc.core.index.blocks_of("trt-a") == 4
                assert svc.core.index.find_matches(keys) == {"trt-a": 4}
                assert svc.core.index.tier_of("trt-a", keys[1]) == "cpu"
                assert tb.gaps == 0 and rt.rekeyer.counts == {}
                # lost events (ids jump) are counted
                eng.next_id += 5
                eng.add({"type": "removed", "block_hashes": [13]})
                await wait_until(lambda: tb.gaps == 1)
                await wait_until(lambda: svc.core.index.find_matches(keys) == {"trt-a": 3})
            finally:
                stop.set()
                await task
                await rt.stop()
    finally:
        await runner.cleanup()
