"""``kvgate telemetry``: the telemetry agent (one per node).

Scrapes every worker's engine ``/metrics`` (vLLM, SGLang, TensorRT-LLM, simulated) and the
node's GPUs through NVML, publishes ``WorkerLoad`` on ``telemetry.<worker>`` every
``--interval`` seconds, and raises alerts (KV-starved batching, KV capacity below the batch,
overload, GPU memory, stale telemetry, XID errors, missing KV events). See docs/telemetry.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from services.common import settings as S
from services.common.service import metrics_handler, run_service, start_http
from services.core.url_pin import UrlAllowlist, parse_allowlist


def _env(name: str) -> str:
    return f"KVGATE_TELEMETRY_{name.upper()}"


OPTIONS = S.COMMON + (
    S.option(
        "host", "127.0.0.1", "address of the HTTP (health, metrics) endpoint", env=_env("host")
    ),
    S.option("port", 8083, "port of the HTTP (health, metrics) endpoint", env=_env("port")),
    S.option(
        "interval", 0.1, "seconds between samples / publishes per worker", env=_env("interval")
    ),
    S.option(
        "scrape_timeout",
        1.0,
        "timeout of one engine /metrics scrape (s)",
        env=_env("scrape_timeout"),
    ),
    S.option(
        "max_concurrency", 128, "most engine scrapes in flight at once", env=_env("max_concurrency")
    ),
    S.option(
        "targets",
        "",
        "static targets for engines without a kvgate heartbeat: "
        "'id=http://host:port[/metrics][@vllm|sglang|trtllm|sim]; ...'",
        env=_env("targets"),
    ),
    S.option(
        "gpu_map", "", "GPU indices per worker: 'worker-a=0,1; worker-b=2'", env=_env("gpu_map")
    ),
    S.option(
        "pid_map",
        "",
        "engine pid per worker, matched against NVML's running processes: 'worker-a=4242'",
        env=_env("pid_map"),
    ),
    S.option(
        "workers",
        "",
        "heartbeat-discovered workers this agent scrapes: worker-id globs, comma-separated "
        "(e.g. 'node7-*,gpu-a'); empty: all (static --targets are always scraped)",
        env=_env("workers"),
    ),
    S.option(
        "local_only",
        False,
        "scrape only heartbeat-discovered workers whose engine URL's host is this node "
        "(one agent per GPU node)",
        env=_env("local_only"),
    ),
    S.option(
        "worker_url_allow",
        "",
        "hosts a heartbeat may move a worker's engine URL to (and, when set, the only ones "
        "scraped): CIDRs, host names, '*.suffix', comma-separated; empty: a worker is "
        "scraped only at the URL it first announced",
        env=_env("worker_url_allow"),
    ),
    S.option("nvml", True, "collect GPU metrics through NVML", env=_env("nvml")),
    S.option(
        "gpu_slow_every",
        10,
        "read clocks, temperature, power and ECC every N samples (others every sample)",
        env=_env("gpu_slow_every"),
    ),
    S.option(
        "engine_slow_every",
        10,
        "ask engines for their slow series (cache config, request-length histograms) every N "
        "scrapes, carrying them in between (others every scrape)",
        env=_env("engine_slow_every"),
    ),
    S.option(
        "detect_interval", 1.0, "seconds between detector evaluations", env=_env("detect_interval")
    ),
    S.option(
        "alert_clear",
        5.0,
        "seconds a condition must stay clear before its alert resolves",
        env=_env("alert_clear"),
    ),
    S.option(
        "detectors",
        "",
        "detector settings as JSON or @file.json, e.g. "
        '\'{"kv_starved": {"window_s": 3, "kv_full": 0.85}, "no_kv_events": {"enabled": false}}\'',
        env=_env("detectors"),
    ),
    S.option(
        "typical_prompt_tokens",
        0.0,
        "typical prompt length for the KV capacity check (0: observe from engine / router)",
        env=_env("typical_prompt_tokens"),
    ),
    S.option(
        "max_new_tokens",
        0.0,
        "typical max new tokens for the KV capacity check (0: observe)",
        env=_env("max_new_tokens"),
    ),
    S.option(
        "forget_after",
        60.0,
        "forget a heartbeat-discovered worker silent this long (s)",
        env=_env("forget_after"),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def load_detector_config(text: str) -> dict[str, dict[str, Any]]:
    text = text.strip()
    if not text:
        return {}
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"invalid --detectors JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise SystemExit('--detectors must be a JSON object of objects: {"kv_starved": {...}}')
    return value


def agent_config(st: Any) -> Any:
    """Settings -> AgentConfig (clear SystemExit on bad input)."""
    from services.telemetry.app import AgentConfig
    from services.telemetry.detectors import build_rules
    from services.telemetry.targets import parse_gpu_map, parse_pid_map, parse_targets

    try:
        detectors = load_detector_config(st.detectors)
        build_rules(detectors)  # validate names and fields now
        return AgentConfig(
            interval_s=st.interval,
            scrape_timeout_s=st.scrape_timeout,
            max_concurrency=st.max_concurrency,
            detect_interval_s=st.detect_interval,
            clear_s=st.alert_clear,
            forget_after_s=st.forget_after,
            gpu_slow_every=st.gpu_slow_every,
            engine_slow_every=st.engine_slow_every,
            static_targets=parse_targets(st.targets),
            gpu_map=parse_gpu_map(st.gpu_map),
            pid_map=parse_pid_map(st.pid_map),
            detectors=detectors,
            typical_prompt_tokens=st.typical_prompt_tokens,
            max_new_tokens=st.max_new_tokens,
            use_nvml=st.nvml,
            workers=tuple(g for g in st.workers.replace(" ", ",").split(",") if g),
            local_only=st.local_only,
            url_allow=_allowlist(st.worker_url_allow),
        )
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"telemetry: {exc}") from exc


def _allowlist(text: str) -> UrlAllowlist:
    try:
        return parse_allowlist(text)
    except ValueError as exc:
        raise ValueError(f"invalid --worker-url-allow: {exc}") from exc


async def serve(st: Any, stop: asyncio.Event) -> None:
    from aiohttp import web

    from services.common.bus import Bus, NatsAuth
    from services.common.schemas import to_builtins
    from services.common.subjects import Subjects
    from services.telemetry.app import Agent

    config = agent_config(st)
    bus = Bus(
        st.nats_url,
        "telemetry",
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role="telemetry",
    )
    await bus.connect()
    agent = Agent(bus, config)
    await agent.start()

    async def health(_r: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "workers": len(agent.workers),
                "gpus": len(agent.gpu.devices) if agent.gpu else 0,
                "nvml": agent.nvml_reason or "ok",
                "firing": sorted(agent.detectors.book.firing),
            }
        )

    async def workers(_r: web.Request) -> web.Response:
        return web.json_response({w: to_builtins(load) for w, load in agent.latest_loads().items()})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/workers", workers)
    runner = await start_http(app, st.host, st.port)
    await stop.wait()
    await runner.cleanup()
    await agent.stop()
    await bus.close()


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    agent_config(st)  # fail fast on bad flags, before connecting
    return run_service("telemetry", serve, st)
