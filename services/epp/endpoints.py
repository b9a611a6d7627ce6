"""Endpoint identity: a gateway names a pod as ``ip:port``; kvgate names a worker by its id
and knows the URL its heartbeats carry. The endpoint of a worker is its URL's ``host:port``
(the scheme's default port when the URL has none; an IPv6 host in brackets, as Envoy writes
it), so a pod's InferencePool ``targetPorts`` must be the port the worker's heartbeat URL
names (for vLLM / SGLang with the bridge as a sidecar: ``--worker-url http://$(POD_IP):8000``).

Invariant: pure functions of the cluster state passed in; nothing is cached across calls
except the URL -> endpoint parse, which depends on the URL string only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from urllib.parse import urlsplit

from services.core.cluster import ClusterState

_DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str | None:
    """``ip:port`` of a worker URL, or None when it names no host."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port out of range or not a number
        return None
    if not host:
        return None
    if port is None:
        port = _DEFAULT_PORTS.get(parts.scheme)
        if port is None:
            return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_endpoint(state: ClusterState, worker_id: str) -> str | None:
    s = state.states.get(worker_id)
    return None if s is None else endpoint_of(s.url)


def worker_at(state: ClusterState, endpoint: str) -> str | None:
    """The worker whose URL names ``endpoint`` (None if none does)."""
    for wid, s in state.states.items():
        if endpoint_of(s.url) == endpoint:
            return wid
    return None


def _host_port(entry: str) -> tuple[str, str | None]:
    """``ip:port`` / ``[ipv6]:port`` -> (host, port); a bare address -> (host, None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, port
    return entry, None  # an IPv4 address, or an IPv6 one without brackets: any port


def outside(state: ClusterState, subset: Iterable[str]) -> set[str]:
    """Workers whose endpoint ``subset`` does not name: the ones a subset hint (or the
    conformance suite's selection header) excludes. An entry with a port names that endpoint;
    a bare address names every port of that host (as GIE's lightweight EPP reads them).

    The hint restricts the destination; a prefill-only worker never is one (the decode pod's
    sidecar reaches it, not the gateway), so it is never excluded here: a P/D pick still
    pairs a hinted decoder with any prefill worker. GIE's own EPP filters every scheduling
    profile's candidates with the hint instead (services/epp/protocol.py, docs/deploy.md)."""
    exact, hosts = set(), set()
    for e in subset:
        host, port = _host_port(e)
        if port is None:
            hosts.add(host)
        else:
            exact.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    out = set()
    for wid, s in state.states.items():
        if s.role == "prefill":
            continue
        ep = endpoint_of(s.url)
        if ep is None or (ep not in exact and _host_port(ep)[0] not in hosts):
            out.add(wid)
    return out
