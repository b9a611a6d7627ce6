"""``kvgate indexer``: the KV indexer (skeleton; the full service lands with its issue)."""

from __future__ import annotations

import argparse
import asyncio

from services.common import settings as S
from services.common.service import metrics_handler, run_service, start_http

OPTIONS = S.COMMON + (
    S.option(
        "host",
        "127.0.0.1",
        "address of the HTTP (health, metrics) endpoint",
        env="KVGATE_INDEXER_HOST",
    ),
    S.option(
        "port", 8082, "port of the HTTP (health, metrics) endpoint", env="KVGATE_INDEXER_PORT"
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


async def serve(st, stop: asyncio.Event) -> None:
    from aiohttp import web

    from services.common.bus import Bus
    from services.common.subjects import Subjects

    bus = Bus(st.nats_url, "indexer", Subjects(st.subject_prefix))
    await bus.connect()

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    runner = await start_http(app, st.host, st.port)
    await stop.wait()
    await runner.cleanup()
    await bus.close()


def main(args: argparse.Namespace) -> int:
    return run_service("indexer", serve, S.resolve(args, OPTIONS))
