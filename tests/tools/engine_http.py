"""A stand-in for an engine's HTTP side, as the bridge reads it: ``/health``, ``/metrics``
(``process_start_time_seconds``, optionally vLLM's ``vllm:cache_config_info``) and SGLang's
``/get_server_info`` (``page_size``). The values are settable to play restarts and outages."""

from __future__ import annotations

from aiohttp import web

from services.common.embedded import free_port
from services.common.service import start_http


class HttpEngine:
    """An engine's HTTP side: /health, /metrics (process_start_time_seconds, optionally
    vllm:cache_config_info) and SGLang's /get_server_info."""

    def __init__(
        self,
        page_size: int | None = None,
        block_size: int | None = None,
        server_info: dict | None = None,
    ) -> None:
        self.page_size, self.block_size = page_size, block_size
        self.server_info = server_info  # SGLang's /server_info (resolved server args)
        self.start_time: float | None = 1_700_000_000.0
        self.healthy = True
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        text = ""
        if self.start_time is not None:
            text += (
                "# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {self.start_time}\n"
            )
        if self.block_size:
            text += (
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{self.block_size}",'
                'num_gpu_blocks="777"} 1.0\n'
            )
        return web.Response(text=text)

    async def _info(self, _: web.Request) -> web.Response:
        if self.page_size is None:
            return web.Response(status=404)
        return web.json_response({"page_size": self.page_size, "max_total_num_tokens": 4000})

    async def _server_info(self, _: web.Request) -> web.Response:
        if self.server_info is None:
            return web.Response(status=404)
        return web.json_response(self.server_info)

    async def __aenter__(self) -> HttpEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/get_server_info", self._info)
        app.router.add_get("/server_info", self._server_info)
        self.runner = await start_http(app, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
