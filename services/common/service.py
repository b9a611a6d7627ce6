"""Running a service process: logging, uvloop, graceful stop on SIGINT / SIGTERM.

A service is ``async def serve(settings, stop: asyncio.Event) -> None``: it starts, waits for
``stop``, and then shuts down in order (stop taking work, drain the bus, close servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common import tracing
from services.common.logging import configure_logging, get_logger

ServeFn = Callable[[Any, asyncio.Event], Awaitable[None]]


def run_service(name: str, serve: ServeFn, settings: Any) -> int:
    configure_logging(
        name, getattr(settings, "log_level", "info"), getattr(settings, "log_format", "auto")
    )
    log = get_logger(name)
    try:
        tracing.setup(name, settings)
    except tracing.TracingError as exc:
        log.error("tracing not set up", error=str(exc))
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        pass

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        log.exception("service failed", error=repr(exc))
        return 1
    log.info("service stopped")
    return 0


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start an aiohttp app on host:port (no access log spam); returns the runner to clean up."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner


async def metrics_handler(_request: web.Request) -> web.Response:
    """Prometheus exposition of this process's default registry."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})
