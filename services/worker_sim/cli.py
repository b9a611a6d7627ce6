"""``kvgate sim-worker``: simulated inference worker(s). (Skeleton; the engine model lands with its issue.)"""

from __future__ import annotations

import argparse

from services.common import settings as S
from services.common.service import run_service

OPTIONS = S.COMMON + (
    S.option("host", "127.0.0.1", "address to listen on", env="KVGATE_SIM_HOST"),
    S.option("port", 8100, "first HTTP port (worker i listens on port + i)", env="KVGATE_SIM_PORT"),
    S.option("count", 1, "number of workers in this process", env="KVGATE_SIM_COUNT"),
    S.option(
        "worker_id",
        "sim",
        "worker id (with --count > 1: prefix, '-<i>' appended)",
        env="KVGATE_SIM_WORKER_ID",
    ),
    S.option("model", "sim-llama-8b", "model name served", env="KVGATE_SIM_MODEL"),
    S.option(
        "heartbeat_interval", 1.0, "seconds between heartbeats", env="KVGATE_SIM_HEARTBEAT_INTERVAL"
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def main(args: argparse.Namespace) -> int:
    from services.worker_sim.app import serve

    return run_service("sim-worker", serve, S.resolve(args, OPTIONS))
