"""The ``kvgate`` command: one subcommand per service or tool.

Subcommand modules are imported only when chosen, so ``kvgate router`` does not pay for the
admin API's imports. Each module provides ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "services.up",
        "run the whole stack on this machine (embedded NATS and Postgres unless URLs are given)",
    ),
    "status": (
        "services.status",
        "is the stack of 'kvgate up' running, and where (its state file)",
    ),
    "router": ("services.router.cli", "OpenAI-compatible router: picks a worker per request"),
    "epp": (
        "services.epp.cli",
        "Gateway API Inference Extension endpoint picker (Envoy ext_proc gRPC), router's core",
    ),
    "indexer": (
        "services.kv_indexer.cli",
        "kv_indexer: KV events -> global prefix index, deltas and snapshots",
    ),
    "index": (
        "services.kv_indexer.index_cli",
        "operator tools for the global KV index (verify: index vs the workers' own dumps)",
    ),
    "telemetry": (
        "services.telemetry.cli",
        "telemetry agent: NVML + engine metrics -> bus, capacity detectors",
    ),
    "api": ("services.api.cli", "admin REST API: policies, canaries, workers, alerts (Postgres)"),
    "migrate": ("services.api.migrate", "apply database migrations (alembic upgrade / downgrade)"),
    "sim-worker": ("services.worker_sim.cli", "simulated vLLM-like inference worker(s)"),
    "bridge": (
        "services.kv_indexer.bridges.cli",
        "bridge a real engine's KV events onto the bus (vllm | sglang | trtllm)",
    ),
    "alerts": ("services.api.alerts_cli", "operator tools for alerts (tail)"),
    "tenants": (
        "services.api.tenants_cli",
        "manage tenants, their client keys and read their usage (through the admin API)",
    ),
    "bus": (
        "services.bus_cli",
        "provision kvgate's JetStream streams (admin credential) or check them against it",
    ),
    "nats-config": (
        "services.nats_config",
        "print the NATS server config with kvgate's per-role authorization",
    ),
    "signing-key": (
        "services.signing_key",
        "print a new api signing key (seed + public key) as .env lines for compose",
    ),
    "bench": ("bench.cli", "benchmark policies and routers with real processes and HTTP"),
    "simulate": (
        "bench.simulate",
        "simulate a cluster on a virtual clock with the router's policy code",
    ),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<11} {desc}" for name, (_, desc) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="kvgate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvgate: KV-cache-aware routing control plane for LLM inference fleets.",
        epilog=f"commands:\n{lines}\n\nRun 'kvgate COMMAND --help' for a command's options.",
        usage="kvgate [-h] [--version] COMMAND [options]",
    )


def build_parser(command: str) -> argparse.ArgumentParser:
    module_name, desc = COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvgate {command}", description=desc)
    module.add_arguments(parser)
    parser.set_defaults(_main=module.main)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvgate")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in {"-V", "--version"}:
        print(f"kvgate {version()}")
        return 0
    if not argv or argv[0] in {"-h", "--help"}:
        _top_parser().print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _top_parser().print_usage(sys.stderr)
        print(
            f"kvgate: unknown command {command!r}; choose from {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    parser = build_parser(command)
    args = parser.parse_args(rest)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
