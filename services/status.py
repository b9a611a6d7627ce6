"""``kvgate status``: is an embedded stack (``kvgate up``) running on this state dir, and where.

Reads ``<state_dir>/stack.json`` (see :mod:`services.common.stackfile`) and asks each service
for its health. Exit status: 0 running and every service healthy, 1 running but a service is
not answering, 3 not running (no stack file, or one left by a run that died).

Examples::

    kvgate status                      # the stack in ./.kvgate
    kvgate status --state-dir /srv/kv  # another state dir
    kvgate status --json               # the stack file plus each service's health, as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from services.common import settings as S
from services.common import stackfile

OPTIONS = (S.STATE_DIR,)
HEALTH_PATHS = {
    "router": "/health",
    "api": "/api/v1/health",
    "indexer": "/health",
    "telemetry": "/health",
    "sim": "/health",
    "epp": "",  # grpc://: the gRPC health service's readiness
}
# what an operator finds on a port whose purpose its name does not say
SERVES = {
    "router-operator": "  (/metrics, /debug/*)",
    "api": "  (admin API, operator page /ui/)",
    "epp": "  (endpoint picker: Envoy ext_proc)",
    "epp-operator": "  (/metrics, /debug/*)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    S.add_options(parser, OPTIONS)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _health(url: str) -> str:
    if url.startswith("grpc://"):
        return _grpc_health(url.removeprefix("grpc://"))
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:  # noqa: S310 - local URL
            return "ok" if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"down ({getattr(exc, 'reason', exc)})"


def _grpc_health(target: str) -> str:
    """A gRPC service's ``readiness`` (grpc.health.v1: the EPP's, as a gateway's probe asks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            got = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2.0
            )
    except grpc.RpcError as exc:
        return f"down ({exc.code().name})"
    if got.status == health_pb2.HealthCheckResponse.SERVING:
        return "ok"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    state = stackfile.read_state(st.state_dir)
    running = stackfile.is_running(st.state_dir)
    if state is None or not running:
        why = (
            "no stack file"
            if state is None
            else f"stack file left by a run that died (pid {state.pid}); the next "
            "'kvgate up' cleans it up"
        )
        if args.json:
            print(json.dumps({"running": False, "state_dir": st.state_dir, "reason": why}))
        else:
            print(f"kvgate is not running on {st.state_dir} ({why}); start it with 'kvgate up'")
        return 3
    health = {
        name: _health(url + HEALTH_PATHS.get(name, "/health")) for name, url in state.urls.items()
    }
    if args.json:
        out = {"running": True, **vars(state), "health": health}
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"kvgate is running (supervisor pid {state.pid}, state dir {state.state_dir})")
        for name, url in state.urls.items():
            print(f"  {name:<15} {url:<28} {health[name]}{SERVES.get(name, '')}")
        print(f"  {'nats':<15} {state.nats_url}")
        print(f"  {'database':<15} {state.database_url}")
        if state.admin_token_file:
            print(f"  {'admin token':<15} in {state.admin_token_file}")
    return 0 if all(h == "ok" for h in health.values()) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.Namespace(state_dir=None, json=False)))
