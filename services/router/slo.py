"""Per-request latency targets (SLOs) at the router: the ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
request headers, and SLO attainment metrics per policy.

- :func:`parse` reads the headers (positive numbers of milliseconds, at most one hour); a bad
  value is the client's error (400 with the header named), never silently ignored.
- The targets travel to the policy in ``RequestInfo.slo_ttft_s`` / ``slo_tpot_s``; a policy
  that routes on them (``slo_aware``) falls back to its own ``slo_ttft_ms`` / ``slo_tpot_ms``
  defaults when a header is absent, and may shed (the router answers 429).
- :func:`record` counts every finished request in ``kvgate_router_slo_requests_total{policy,
  result}`` with ``result`` one of ``met``, ``missed_ttft``, ``missed_tpot``, ``failed`` (not
  completed) or ``shed``, against the request's targets, else the policy's defaults, else
  :data:`DEFAULT_TTFT_MS` / :data:`DEFAULT_TPOT_MS`. TPOT is (e2e - TTFT) / (tokens - 1).
  Requests without a first-token time (non-streaming) are judged on e2e as TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.loop_metrics import LoopCounter

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
DEFAULT_TTFT_MS = 2000.0
DEFAULT_TPOT_MS = 50.0
MAX_MS = 3_600_000.0

SLO_REQUESTS = LoopCounter(
    "kvgate_router_slo_requests_total",
    "Finished requests by policy and SLO result (met, missed_ttft, missed_tpot, failed, shed)",
    ["policy", "result"],
)


class BadSloHeader(ValueError):
    """A malformed SLO header; the message names it (for a 400), ``header`` is its name."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_s: float | None = None
    tpot_s: float | None = None


NO_TARGETS = SloTargets()


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise BadSloHeader(
            name, f"header {name} must be a number of milliseconds, got {raw!r}"
        ) from None
    if not math.isfinite(v) or v <= 0 or v > MAX_MS:
        raise BadSloHeader(name, f"header {name} must be > 0 and <= {MAX_MS:.0f} ms, got {raw!r}")
    return v / 1000.0


def parse(headers: Mapping[str, str]) -> SloTargets:
    """The request's targets from its headers (absent ones None)."""
    t, p = _ms(headers, TTFT_HEADER), _ms(headers, TPOT_HEADER)
    return NO_TARGETS if t is None and p is None else SloTargets(t, p)


def effective(targets: SloTargets, policy_params: Mapping[str, Any]) -> tuple[float, float]:
    """(TTFT s, TPOT s) a request is judged against."""
    ttft = targets.ttft_s
    if ttft is None:
        ttft = policy_params.get("slo_ttft_ms", DEFAULT_TTFT_MS) / 1000.0
    tpot = targets.tpot_s
    if tpot is None:
        tpot = policy_params.get("slo_tpot_ms", DEFAULT_TPOT_MS) / 1000.0
    return ttft, tpot


def result(
    targets: SloTargets,
    policy_params: Mapping[str, Any],
    status: str,
    ttft_s: float | None,
    e2e_s: float,
    completion_tokens: int,
    shed: bool = False,
) -> str:
    """The SLO result of one finished request (see the module docstring)."""
    if shed:
        return "shed"
    if status != "ok":
        return "failed"
    ttft_t, tpot_t = effective(targets, policy_params)
    first = ttft_s if ttft_s is not None else e2e_s
    if first > ttft_t:
        return "missed_ttft"
    if completion_tokens > 1 and (e2e_s - first) / (completion_tokens - 1) > tpot_t:
        return "missed_tpot"
    return "met"


_counted: dict[tuple[str, str], Any] = {}


def record(policy: str, res: str) -> None:
    c = _counted.get((policy, res))
    if c is None:  # the label lookup once per (policy, result), not per request
        c = _counted[(policy, res)] = SLO_REQUESTS.labels(policy, res)
    c.inc()
