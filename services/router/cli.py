"""``kvgate router``: the OpenAI-compatible routing proxy (docs/router.md)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from services.common import settings as S
from services.common.service import run_service
from services.common.tracing import OPTIONS as TRACING_OPTIONS
from services.router.breaker import OPTIONS as BREAKER_OPTIONS
from services.router.outlier import OPTIONS as OUTLIER_OPTIONS
from services.router.public_surface import OPTIONS as PUBLIC_SURFACE_OPTIONS
from services.router.readiness import OPTIONS as READINESS_OPTIONS
from services.router.stall import OPTIONS as STALL_OPTIONS

OPTIONS = S.COMMON + (
    *PUBLIC_SURFACE_OPTIONS,
    S.HASH_SEED,
    S.TRUSTED_SIGNERS,
    S.SIGNED_MAX_AGE_S,
    S.SIGNED_MAX_SKEW_S,
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
    S.option(
        "worker_url_allow",
        "",
        "hosts a worker's heartbeat URL may name (comma-separated CIDRs, host names, "
        "*.suffix wildcards; e.g. the pod CIDR 10.244.0.0/16): a worker may move to one "
        "without an operator's re-pin, and no URL outside them is accepted, the first "
        "included; empty: each worker stays at the first URL this router saw for it until "
        "re-pinned (POST /api/v1/workers/<id>/repin). Set it in production",
        env="KVGATE_ROUTER_WORKER_URL_ALLOW",
    ),
    S.option(
        "worker_pin_keep_s",
        86400.0,
        "seconds a departed worker's URL pin is kept (its id cannot be claimed at another "
        "URL meanwhile)",
        env="KVGATE_ROUTER_WORKER_PIN_KEEP_S",
    ),
    S.option(
        "policy",
        "kv_aware",
        "default policy until one is published on policy.updated: a name "
        '(kv_aware, slo_aware, prefix, least_request, ...) or a JSON spec {"name":..,"params":{..}}',
        env="KVGATE_ROUTER_POLICY",
    ),
    S.option(
        "tokenizer",
        "",
        "local HuggingFace tokenizer.json (or its directory); empty = byte-level. "
        "Must match the workers' tokenizer",
        env="KVGATE_TOKENIZER",
    ),
    S.option(
        "router_id", "", "this replica's id (default router-<random>)", env="KVGATE_ROUTER_ID"
    ),
    S.option(
        "queue_size",
        1024,
        "max requests waiting for capacity, per model (a higher band takes a lower one's place)",
        env="KVGATE_ROUTER_QUEUE_SIZE",
    ),
    S.option(
        "queue_timeout",
        30.0,
        "max seconds a request waits for capacity before 429",
        env="KVGATE_ROUTER_QUEUE_TIMEOUT",
    ),
    S.option(
        "engine_priority",
        False,
        "send each request's flow-control order to its worker as the body's 'priority' "
        "(band, then whether its tenant holds more than its share; lower first). Only for "
        "engines that schedule by it: vLLM --scheduling-policy priority, SGLang "
        "--enable-priority-scheduling --schedule-low-priority-values-first",
        env="KVGATE_ROUTER_ENGINE_PRIORITY",
    ),
    S.option(
        "protect_prefill",
        False,
        "keep workers free of best-effort prompt work for protected requests (critical, or "
        "standard from a tenant under its share), as many as the measured protected load calls "
        "for at --protect-quantile; best-effort requests wait meanwhile (sheddable ones are "
        "shed). See docs/router.md, Tenants and flow control",
        env="KVGATE_ROUTER_PROTECT_PREFILL",
    ),
    S.option(
        "protect_quantile",
        0.8,
        "with --protect-prefill: the probability that a protected request finds a worker "
        "computing no prompt (sizes the room; in (0, 1))",
        env="KVGATE_ROUTER_PROTECT_QUANTILE",
    ),
    S.option("retry_after", 1, "Retry-After seconds on 429 / 503", env="KVGATE_ROUTER_RETRY_AFTER"),
    S.option(
        "pd_handshake",
        "auto",
        "disaggregated serving: how a prefill worker hands the prompt's KV to the decoder: "
        "nixl (vLLM kv_transfer_params: prefill first, then decode), bootstrap (SGLang "
        "bootstrap_host/port/room: both at once), auto (bootstrap for SGLang engines, else nixl)",
        choices=["auto", "nixl", "bootstrap"],
        env="KVGATE_ROUTER_PD_HANDSHAKE",
    ),
    S.option(
        "max_retries",
        2,
        "re-sends to another worker on connect failure / 503 / timeout before output",
        env="KVGATE_ROUTER_MAX_RETRIES",
    ),
    S.option(
        "max_migrations",
        2,
        "times a stream may move to another worker after its worker died mid-stream",
        env="KVGATE_ROUTER_MAX_MIGRATIONS",
    ),
    S.option(
        "connect_timeout", 2.0, "worker connect timeout (s)", env="KVGATE_ROUTER_CONNECT_TIMEOUT"
    ),
    S.option(
        "request_timeout",
        300.0,
        "non-streaming: max seconds for the worker's whole answer",
        env="KVGATE_ROUTER_REQUEST_TIMEOUT",
    ),
    S.option(
        "stream_idle_timeout",
        60.0,
        "streaming: max seconds between events (first one included) before the worker "
        "counts as failed (after the first token, --stall-factor may judge sooner)",
        env="KVGATE_ROUTER_STREAM_IDLE_TIMEOUT",
    ),
    S.option(
        "telemetry_stale_s",
        2.0,
        "telemetry older than this is ignored (neutral) by policies",
        env="KVGATE_ROUTER_TELEMETRY_STALE_S",
    ),
    S.option(
        "default_max_tokens",
        0,
        "max_tokens assumed for admission when a request does not set it; 0 = vLLM's "
        "defaults: 16 for completions, the rest of the workers' context for chat",
        env="KVGATE_ROUTER_DEFAULT_MAX_TOKENS",
    ),
    S.option(
        "passthrough_paths",
        "",
        "comma-separated POST paths routed to the workers as they are (e.g. "
        "/v1/responses,/v1/rerank), keyed by their messages / prompt / input when present; "
        "/v1/embeddings always is",
        env="KVGATE_ROUTER_PASSTHROUGH_PATHS",
    ),
    S.option(
        "scaling_window",
        30.0,
        "seconds the scaling signal (kvgate_fleet_engines_needed) averages arrivals and "
        "requests over",
        env="KVGATE_ROUTER_SCALING_WINDOW",
    ),
    S.option(
        "scaling_margin",
        0.4,
        "the scaling signal counts the engines that keep a mean request's predicted TTFT and "
        "TPOT within this fraction of the SLO targets, 0-1 (docs/deploy.md, scaling)",
        env="KVGATE_ROUTER_SCALING_MARGIN",
    ),
    S.option(
        "outcome_buffer",
        10000,
        "outcome messages buffered while NATS is slow or down (then dropped, counted)",
        env="KVGATE_ROUTER_OUTCOME_BUFFER",
    ),
    S.option(
        "processes",
        1,
        "router processes sharing the port (SO_REUSEPORT); each is a replica that shares "
        "in-flight counts with the others over NATS; process i serves its operator port "
        "(metrics, debug) at --operator-port + i",
        env="KVGATE_ROUTER_PROCESSES",
    ),
    S.option(
        "load_interval",
        1.0,
        "seconds between RouterLoad publications when nothing changes",
        env="KVGATE_ROUTER_LOAD_INTERVAL",
    ),
)


OPTIONS += BREAKER_OPTIONS
OPTIONS += OUTLIER_OPTIONS
OPTIONS += READINESS_OPTIONS
OPTIONS += STALL_OPTIONS
OPTIONS += TRACING_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def settings(args: argparse.Namespace | None = None, **overrides) -> S.Settings:
    """Resolved router settings (flags, env, defaults), with overrides (for tests, benches)."""
    return resolve_with_overrides("router", OPTIONS, args, overrides)


def resolve_with_overrides(
    service: str,
    options: tuple[S.Option, ...],
    args: argparse.Namespace | None,
    overrides: dict[str, object],
) -> S.Settings:
    """``options`` resolved from flags, env and defaults (with no ``args``: defaults only,
    the environment ignored), then ``overrides`` set; an unknown override is an error."""
    st = S.resolve(args, options, environ={} if args is None else None)
    for k, v in overrides.items():
        if not hasattr(st, k):
            raise AttributeError(f"unknown {service} setting {k!r}")
        setattr(st, k, v)
    return st


def check_option(
    what: str,
    parse: Callable[[Any], object],
    value: Any,
    errors: tuple[type[Exception], ...] = (ValueError,),
) -> None:
    """``parse(value)``; one of ``errors`` stops the process: "invalid <what>: <error>"."""
    try:
        parse(value)
    except errors as exc:
        raise SystemExit(f"invalid {what}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    from services.core.policy import PolicyError
    from services.core.url_pin import parse_allowlist
    from services.router.app import parse_policy_option, serve
    from services.router.breaker import breaker_config
    from services.router.conn_limits import ConnLimits
    from services.router.openai_extras import passthrough_paths
    from services.router.stall import StallBound

    st = S.resolve(args, OPTIONS)
    check_option("--policy", parse_policy_option, st.policy, (PolicyError, ValueError))
    check_option("--passthrough-paths", passthrough_paths, st.passthrough_paths)
    ConnLimits.from_settings(st)  # a bad connection limit stops the router before it starts
    check_option("circuit breaker option", breaker_config, st)
    check_option("stall detection option", StallBound.from_settings, st)
    check_option("--worker-url-allow", parse_allowlist, st.worker_url_allow)
    if not st.scaling_window > 0:
        raise SystemExit("invalid --scaling-window: must be > 0")
    if not 0 < st.scaling_margin <= 1:
        raise SystemExit("invalid --scaling-margin: must be in (0, 1]")
    if not st.drain_timeout_s >= 0:
        raise SystemExit("invalid --drain-timeout-s: must be >= 0")
    if st.worker_pin_keep_s < 0:
        raise SystemExit("invalid --worker-pin-keep-s: must be >= 0")
    if not (st.signed_max_age_s > 0 and st.signed_max_skew_s >= 0):
        raise SystemExit(
            "invalid --signed-max-age-s / --signed-max-skew-s: need age > 0, skew >= 0"
        )
    child = os.environ.get(_CHILD_ENV)
    st.reuse_port = st.processes > 1 or bool(child)
    if child:
        st.router_id = os.environ.get("KVGATE_ROUTER_ID", st.router_id)
        # each process has its own metrics: one operator port each (a shared port would hand
        # a scrape to any one of them, and its counters would jump between processes)
        if int(st.operator_port or 0):
            st.operator_port = int(st.operator_port) + int(os.environ.get(_INDEX_ENV, "0"))
    if st.processes > 1 and not child:
        return _run_replicas(st)
    return run_service("router", serve, st)


_CHILD_ENV = "KVGATE_ROUTER_REPLICA_OF"
_INDEX_ENV = "KVGATE_ROUTER_REPLICA_INDEX"


def _run_replicas(st: S.Settings) -> int:
    """Start ``processes - 1`` more router processes on the same port, serve in this one,
    and stop them all together: a SIGTERM here is passed on at once, so every replica drains
    at the same time (each within --drain-timeout-s)."""
    import asyncio
    import signal
    import subprocess
    import sys
    import uuid

    from services.router.app import serve

    base = st.router_id or f"router-{uuid.uuid4().hex[:8]}"
    st.router_id = f"{base}-0"
    children = []
    for i in range(1, st.processes):
        env = {
            **os.environ,
            _CHILD_ENV: base,
            _INDEX_ENV: str(i),
            "KVGATE_ROUTER_ID": f"{base}-{i}",
        }
        argv = [a for a in sys.argv[1:]]
        children.append(subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env))

    async def serve_and_pass_on(st_: S.Settings, stop: asyncio.Event) -> None:
        async def pass_on() -> None:
            await stop.wait()
            for c in children:
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)

        passing = asyncio.create_task(pass_on())
        try:
            await serve(st_, stop)
        finally:
            passing.cancel()

    try:
        return run_service("router", serve_and_pass_on, st)
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children:
            try:
                c.wait(st.drain_timeout_s + 5)  # its drain, then its close
            except subprocess.TimeoutExpired:
                c.kill()
