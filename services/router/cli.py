"""``kvgate router``: the OpenAI-compatible routing proxy. (Skeleton; policies land with their issue.)"""

from __future__ import annotations

import argparse

from services.common import settings as S
from services.common.service import run_service

OPTIONS = S.COMMON + (
    S.option("host", "127.0.0.1", "address to listen on", env="KVGATE_ROUTER_HOST"),
    S.option(
        "port", 8080, "HTTP port (OpenAI base URL is http://host:port/v1)", env="KVGATE_ROUTER_PORT"
    ),
    S.option(
        "worker_timeout",
        3.0,
        "seconds without a heartbeat before a worker is dropped",
        env="KVGATE_ROUTER_WORKER_TIMEOUT",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def main(args: argparse.Namespace) -> int:
    from services.router.app import serve

    return run_service("router", serve, S.resolve(args, OPTIONS))
