"""``kvgate epp``: the Gateway API Inference Extension endpoint picker (Envoy ext_proc over
gRPC), deciding with the router's core (services/epp/__init__.py).

Options: the router's (policy, tokenizer, bus, admission, breaker, outlier, ...: the same
names, flags and environment variables, since it is the same decision core), less the ones of
its HTTP proxy port, plus the EPP's own listen address, body limit and operator port.
"""

from __future__ import annotations

import argparse

from services.common import settings as S
from services.router.cli import OPTIONS as ROUTER_OPTIONS
from services.router.cli import check_option, resolve_with_overrides

# the router's HTTP front door: the EPP has none (the gateway faces the clients)
_NOT_THE_EPPS = {
    "host",
    "port",
    "processes",
    "operator_port",
    "tls_cert",
    "tls_key",
    "api_keys",
    "api_keys_file",
    "max_body_bytes",
}

OPTIONS = tuple(o for o in ROUTER_OPTIONS if o.name not in _NOT_THE_EPPS) + (
    S.option(
        "host",
        "127.0.0.1",
        "address the ext_proc gRPC server listens on (0.0.0.0 in a pod, for the gateway)",
        env="KVGATE_EPP_HOST",
    ),
    S.option(
        "port",
        9002,
        "ext_proc gRPC port (the InferencePool's endpointPickerRef port; GIE's default 9002); "
        "the gRPC health services (liveness, readiness, "
        "envoy.service.ext_proc.v3.ExternalProcessor) answer on it too",
        env="KVGATE_EPP_PORT",
    ),
    S.option(
        "operator_port",
        0,
        "HTTP port of /metrics, /health, /ready and /debug/* (0: none)",
        env="KVGATE_EPP_OPERATOR_PORT",
    ),
    S.option(
        "fallback_endpoints",
        0,
        "endpoints named after the pick, in the decision's cost order, for a gateway that "
        "retries (x-gateway-destination-endpoint: pick,next,...); 0: the pick only",
        env="KVGATE_EPP_FALLBACK_ENDPOINTS",
    ),
    S.option(
        "conformance_test_epp",
        False,
        "the Gateway API Inference Extension conformance suite's test-EPP behaviours: the "
        "test-epp-endpoint-selection request header restricts the pick to the endpoints it "
        "names, and x-conformance-test-served-endpoint echoes the served endpoint on the "
        "response. For running that suite only: any client may then choose its endpoint",
        env="KVGATE_EPP_CONFORMANCE_TEST_EPP",
    ),
    S.option(
        "max_body_bytes",
        4 * 1024 * 1024,
        "largest request body the EPP buffers to read the prompt (bytes); larger: "
        "ImmediateResponse 413",
        env="KVGATE_EPP_MAX_BODY_BYTES",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def settings(args: argparse.Namespace | None = None, **overrides: object) -> S.Settings:
    """Resolved EPP settings (flags, env, defaults), with overrides (for tests, benches)."""
    return resolve_with_overrides("epp", OPTIONS, args, overrides)


def main(args: argparse.Namespace) -> int:
    from services.common.service import run_service
    from services.core.policy import PolicyError
    from services.core.url_pin import parse_allowlist
    from services.epp.server import serve
    from services.router.app import parse_policy_option

    st = S.resolve(args, OPTIONS)
    check_option("--policy", parse_policy_option, st.policy, (PolicyError, ValueError))
    check_option("--worker-url-allow", parse_allowlist, st.worker_url_allow)
    if not 0 < st.port < 65536:
        raise SystemExit("invalid --port: must be 1..65535")
    if st.fallback_endpoints < 0:
        raise SystemExit("invalid --fallback-endpoints: must be >= 0")
    if st.max_body_bytes <= 0:
        raise SystemExit("invalid --max-body-bytes: must be > 0")
    return run_service("epp", serve, st)
