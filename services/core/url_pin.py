"""Worker URL pinning: which heartbeat may say where a worker lives.

Anyone who can publish a worker's heartbeat could otherwise point the routers at any host and
receive its prompts. A router therefore pins each worker's URL at the first heartbeat it sees for
that worker id and refuses a later heartbeat that names another URL, unless

- the new URL's host is in the operator's allowlist (``--worker-url-allow``: CIDRs, host names,
  ``*.suffix`` wildcards; for Kubernetes pods that come back with a new IP), or
- an operator re-pinned the worker through the api (a signed ``WorkerControl`` "repin": to a
  given URL, or, without one, to whatever URL the next heartbeat names).

With an allowlist set, no URL outside it is accepted, the first one included (that is the only
defence of a router started while an attacker is already heartbeating for a worker), except a
URL an operator re-pinned the worker to explicitly (a ``repin`` that names it).

Invariants:
- the decision (:func:`decide`) is a pure function of the pin, the URL and the allowlist;
  :class:`UrlPins` only holds the pins and takes time as an argument (no I/O, no clock);
- a pin outlives its worker's departure by ``keep_departed_s`` (and at most
  ``max_departed`` departed pins are kept, the longest-departed dropped first), so an id cannot
  be claimed by waiting for its worker to leave; a live worker's pin is never dropped.
"""

from __future__ import annotations

import ipaddress
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

Refusal = Literal["url_changed", "url_not_allowed"]

# RFC 1123 labels, lower-case (host names are matched case-insensitively)
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")

DEFAULT_KEEP_DEPARTED_S = 86400.0
DEFAULT_MAX_DEPARTED = 10_000


def normalize_url(url: str) -> str:
    """The form a pin is compared in (the one :class:`ClusterState` stores: no trailing '/')."""
    return url.rstrip("/")


def url_host(url: str) -> str | None:
    """The host of ``url``, lower-case, without brackets or port; None when it has none."""
    try:
        host = urlsplit(url.strip()).hostname
    except ValueError:  # e.g. an unbalanced '[' in the netloc
        return None
    return host or None


@dataclass(frozen=True)
class UrlAllowlist:
    """Hosts a worker URL may name: IP networks (an IP literal host inside one), exact host
    names, and ``*.suffix`` wildcards (any host ending in ``.suffix``). Host names are compared
    as written in the URL, never resolved: a CIDR matches IP-literal URLs only."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # each with its leading '.'

    @property
    def enabled(self) -> bool:
        return bool(self.networks or self.names or self.suffixes)

    def allows(self, url: str) -> bool:
        host = url_host(url)
        if host is None:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host in self.names or any(host.endswith(s) for s in self.suffixes)
        return any(ip in net for net in self.networks)


def parse_allowlist(text: str) -> UrlAllowlist:
    """``--worker-url-allow``: comma-separated CIDRs (``10.244.0.0/16``, a bare IP is a /32),
    host names (``gpu-1.example.com``) and wildcards (``*.svc.cluster.local``). Raises
    ValueError naming the first bad entry."""
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    names: set[str] = set()
    suffixes: list[str] = []
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        name = entry[2:] if entry.startswith("*.") else entry
        if not _HOST.match(name) or "/" in entry:
            raise ValueError(
                f"{raw.strip()!r} is neither a CIDR, a host name nor a '*.suffix' wildcard"
            )
        if entry.startswith("*."):
            suffixes.append("." + name)
        else:
            names.add(name)
    return UrlAllowlist(tuple(networks), frozenset(names), tuple(suffixes))


@dataclass
class Pin:
    url: str  # normalized; "" while a re-pin waits for the next heartbeat's URL
    departed_at: float | None = None  # when its worker was forgotten (None: live)

    @property
    def open(self) -> bool:
        return not self.url


def decide(pin: Pin | None, url: str, allowlist: UrlAllowlist) -> Refusal | None:
    """Why a heartbeat naming ``url`` must be refused for a worker pinned at ``pin`` (None:
    accept it, and pin ``url``)."""
    if pin is not None and pin.url == normalize_url(url):
        # the pinned URL: allowed when it was pinned, or given by the operator (the common
        # case first: ~0.15 µs, where the allowlist's check of a URL costs ~9 µs)
        return None
    if allowlist.enabled:
        return None if allowlist.allows(url) else "url_not_allowed"
    if pin is None or pin.open:
        return None
    return "url_changed"


class UrlPins:
    """Each worker id's pinned URL, live and departed (see the module's invariants)."""

    def __init__(
        self,
        allowlist: UrlAllowlist | None = None,
        keep_departed_s: float = DEFAULT_KEEP_DEPARTED_S,
        max_departed: int = DEFAULT_MAX_DEPARTED,
    ) -> None:
        self.allowlist = allowlist or UrlAllowlist()
        self.keep_departed_s = keep_departed_s
        self.max_departed = max_departed
        self._pins: dict[str, Pin] = {}
        self._departed: OrderedDict[str, float] = OrderedDict()  # in departure order

    def __len__(self) -> int:
        return len(self._pins)

    def pinned(self, worker_id: str) -> str | None:
        """The URL ``worker_id`` is pinned at (None: not pinned, or a re-pin is open)."""
        pin = self._pins.get(worker_id)
        return pin.url if pin is not None and not pin.open else None

    def check(self, worker_id: str, url: str) -> Refusal | None:
        return decide(self._pins.get(worker_id), url, self.allowlist)

    def accept(self, worker_id: str, url: str) -> None:
        """A heartbeat naming ``url`` was accepted (:meth:`check` said so): pin it; the worker
        is live again."""
        pin = self._pins.get(worker_id)
        if pin is None:
            self._pins[worker_id] = Pin(normalize_url(url))
            return
        pin.url = normalize_url(url)
        if pin.departed_at is not None:
            pin.departed_at = None
            self._departed.pop(worker_id, None)

    def repin(self, worker_id: str, url: str, now: float) -> None:
        """The operator re-pinned ``worker_id``: to ``url``, or (empty) to the URL of the next
        heartbeat accepted for it. A worker not seen yet (or forgotten) is pinned ahead of its
        first heartbeat, counted with the departed ones (so kept ``keep_departed_s``)."""
        pin = self._pins.get(worker_id)
        if pin is None:
            if not url:
                return  # nothing pinned: its next heartbeat is pinned anyway
            pin = self._pins[worker_id] = Pin("")
            self.depart(worker_id, now)
        pin.url = normalize_url(url)

    def depart(self, worker_id: str, now: float) -> None:
        """``worker_id`` was forgotten: keep its pin ``keep_departed_s`` more."""
        pin = self._pins.get(worker_id)
        if pin is None or pin.departed_at is not None:
            return
        pin.departed_at = now
        self._departed[worker_id] = now
        while len(self._departed) > self.max_departed:
            oldest, _ = self._departed.popitem(last=False)
            self._pins.pop(oldest, None)

    def drop(self, worker_id: str) -> None:
        """Forget ``worker_id``'s pin at once (a holder whose pins live only as long as it
        knows the worker: the telemetry agent)."""
        self._pins.pop(worker_id, None)
        self._departed.pop(worker_id, None)

    def expire(self, now: float) -> int:
        """Drop the pins of workers departed more than ``keep_departed_s`` ago; how many."""
        n = 0
        while self._departed:
            wid, at = next(iter(self._departed.items()))
            if now - at <= self.keep_departed_s:
                break
            del self._departed[wid]
            self._pins.pop(wid, None)
            n += 1
        return n
