"""What one client connection may cost the router's HTTP server: head size, header count and
URL length, how long it may take to send a head or a body, how long it may sit idle, and
how many connections are open at once (services.router.http_server enforces them).

Defaults, and why:

- ``max_header_bytes`` 64 KiB for the whole head (request line + headers): Envoy's default is
  60 KiB, nginx's 4 x 8 KiB buffers, Node's 16 KiB; no API client sends more than a few KiB
  (a large JWT is ~8 KiB), and it bounds what one connection can make the parser buffer;
- ``max_headers`` 100: Envoy's ``max_headers_count`` and Apache's ``LimitRequestFields``;
- ``max_url_bytes`` 8 KiB: Apache's ``LimitRequestLine`` and nginx's buffer size;
- ``header_timeout_s`` 10 s: the head of a request must arrive within it, counted from the
  connection's accept (first request) or from the first byte of the request (later ones);
  nginx's ``client_header_timeout`` counts the same way (60 s; a head is a few hundred bytes);
- ``body_timeout_s`` 30 s: the longest gap between two reads of a body (nginx's
  ``client_body_timeout`` semantics; a whole-body deadline would refuse slow honest uploads
  of large bodies); slow-body clients are bounded in number by ``max_connections``;
- ``keepalive_timeout_s`` 75 s: nginx's; above the 60 s idle timeout of common load balancers
  (AWS ALB), so the balancer, not the router, closes an idle pooled connection first;
- ``max_connections`` 0 = half the process's open-file limit (the other half is for upstream
  connections, NATS and files), at most 10 000.

Invariant: every refusal here is counted in ``kvgate_router_http_rejected_total{reason}`` and
logged at most once per reason per :data:`LOG_EVERY_S` (a flood of refusals is not a flood of
log lines); a refused connection never buffers more than its limit plus one socket read.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from services.common import settings as S
from services.common.logging import RateLimiter, get_logger

log = get_logger("router.http")

KIB = 1024
MAX_AUTO_CONNECTIONS = 10_000
LOG_EVERY_S = 10.0

OPTIONS = (
    S.option(
        "max_header_bytes",
        64 * KIB,
        "largest request head (request line + headers, bytes) accepted; larger: 431 and close",
        env="KVGATE_ROUTER_MAX_HEADER_BYTES",
    ),
    S.option(
        "max_headers",
        100,
        "most header fields in one request; more: 431 and close",
        env="KVGATE_ROUTER_MAX_HEADERS",
    ),
    S.option(
        "max_url_bytes",
        8 * KIB,
        "longest request target (path + query, bytes); longer: 414 and close",
        env="KVGATE_ROUTER_MAX_URL_BYTES",
    ),
    S.option(
        "header_timeout_s",
        10.0,
        "seconds a request's head may take to arrive (from accept, or from its first byte on "
        "a kept-alive connection); then 408 and close (a connection that sent nothing: closed)",
        env="KVGATE_ROUTER_HEADER_TIMEOUT_S",
    ),
    S.option(
        "body_timeout_s",
        30.0,
        "longest silence (seconds) while a request body is being received; then 408 and close",
        env="KVGATE_ROUTER_BODY_TIMEOUT_S",
    ),
    S.option(
        "keepalive_timeout_s",
        75.0,
        "seconds an idle kept-alive connection waits for its next request before it is closed",
        env="KVGATE_ROUTER_KEEPALIVE_TIMEOUT_S",
    ),
    S.option(
        "max_connections",
        0,
        "most client connections open at once per port; more: 503 with Retry-After and close "
        "(0: half the open-file limit, at most 10000)",
        env="KVGATE_ROUTER_MAX_CONNECTIONS",
    ),
)

REJECTED = Counter(
    "kvgate_router_http_rejected_total",
    "Client connections or requests the router's HTTP server refused or closed before a "
    "handler: header_too_large, too_many_headers, url_too_long, header_timeout, "
    "body_timeout, connection_limit, malformed, bad_path",
    ["reason"],
)


def auto_max_connections() -> int:
    """Half the soft open-file limit, at most :data:`MAX_AUTO_CONNECTIONS`."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_AUTO_CONNECTIONS
    return max(1, min(MAX_AUTO_CONNECTIONS, soft // 2))


@dataclass(frozen=True)
class ConnLimits:
    """The limits of one listening port (see the module docstring for the defaults)."""

    max_header_bytes: int = 64 * KIB
    max_headers: int = 100
    max_url_bytes: int = 8 * KIB
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 0  # 0: auto_max_connections()
    retry_after_s: int = 1  # Retry-After of the 503 beyond max_connections

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_url_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if self.max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0: automatic)")
        if self.max_connections == 0:
            object.__setattr__(self, "max_connections", auto_max_connections())

    @property
    def sweep_s(self) -> float:
        """How often the server looks for connections past a timeout: a quarter of the
        shortest timeout (capped at 1 s first: at most every 0.25 s), so a timeout fires at
        most 25% late."""
        return min(1.0, self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s) / 4

    @classmethod
    def from_settings(cls, st: Any) -> ConnLimits:
        """The limits from the router's settings; a bad value stops the router with the
        option's name."""
        values = {opt.name: getattr(st, opt.name, opt.default) for opt in OPTIONS}
        values["retry_after_s"] = int(getattr(st, "retry_after", 1))
        try:
            return cls(**values)
        except ValueError as exc:
            flag = "--" + str(exc).split(" ", 1)[0].replace("_", "-")
            raise SystemExit(f"router: invalid {flag}: {exc}") from None


class Rejections:
    """Counts each refusal and logs it, at most once per reason every :data:`LOG_EVERY_S`
    (with how many were not logged since)."""

    def __init__(self) -> None:
        self._log = RateLimiter(LOG_EVERY_S)

    def __call__(self, reason: str, peer: Any, **detail: Any) -> None:
        REJECTED.labels(reason).inc()
        if not self._log.allow(reason):
            return
        since = self._log.take_suppressed(reason)
        client = peer[0] if isinstance(peer, tuple) and peer else None
        log.warning(
            "http request refused", reason=reason, client=client, not_logged_since=since, **detail
        )


reject = Rejections()
