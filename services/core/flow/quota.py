"""Per-tenant quotas (requests, input tokens and output tokens per minute; concurrent
requests) over a replica set of routers, each enforcing them on the sum of its own usage and
what the other routers last reported.

Each router counts what it admitted in a sliding window of ``span_s`` (``bucket_s`` buckets)
and reports its per-tenant totals to the others (the load-share channel,
services/router/load_share.py: within ~5 ms of a change while another router is heard). A
request is admitted when, with it, the tenant's known usage stays within every limit:

- requests/min: known requests + 1 <= limit;
- input tokens/min: known input tokens + the prompt <= limit (the prompt is known up front);
- output tokens/min: known output tokens < limit (the output is known only at the end: the
  overshoot is at most what the requests in flight when the limit is reached generate);
- concurrent: known in-flight requests + 1 <= limit.

Between reports, each router takes at most 1/n of the headroom it last knew of (n: itself +
the routers heard within ``peer_ttl_s``), and always one request (so a headroom smaller than
one request per router is not stranded); hearing any other router starts a new share.

Over-admission across replicas: a router does not see what the others admitted since their
last report (the coalescing 5 ms + the bus). With the split, routers that all start from the
same headroom H admit at most H together before they hear each other, plus at most one
request each beyond their share; a staler view (one router heard, another not) adds a
fraction of what that one took. Without reports (NATS down, or partitioned) each router
enforces the quota on its own usage and what it last heard: up to n x the quota. Windows are
1 s buckets kept until their last instant is ``span_s`` old (never forgotten early).
bench/bench_quota.py measures it.

No I/O, no clock: ``now`` is an argument (monotonic seconds).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from services.common.tenancy import TenantQuota


@dataclass(slots=True)
class Usage:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    concurrent: int = 0

    def as_list(self) -> list[int]:
        return [self.requests, self.input_tokens, self.output_tokens, self.concurrent]

    @classmethod
    def from_list(cls, v: list[int]) -> Usage:
        return cls(*(max(0, int(x)) for x in v[:4]))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over its tenant's quota, and when to retry (the 429's Retry-After)."""

    limit: (
        str  # requests_per_min | input_tokens_per_min | output_tokens_per_min | concurrent_requests
    )
    retry_after_s: int
    message: str


@dataclass(slots=True)
class _Window:
    """Usage in the last ``span_s``: buckets [start, requests, input, output], oldest first."""

    buckets: deque[list[float]] = field(default_factory=deque)
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def advance(self, now: float, span_s: float, bucket_s: float) -> None:
        """Forget the buckets wholly older than ``span_s`` (a bucket is kept until its last
        instant is ``span_s`` old: the window never forgets early, it may remember up to one
        bucket longer)."""
        b = self.buckets
        while b and b[0][0] + bucket_s <= now - span_s:
            _, r, i, o = b.popleft()
            self.requests -= int(r)
            self.input_tokens -= int(i)
            self.output_tokens -= int(o)

    def add(self, now: float, bucket_s: float, r: int, i: int, o: int) -> None:
        b = self.buckets
        start = now - now % bucket_s
        if not b or b[-1][0] != start:
            b.append([start, 0, 0, 0])
        last = b[-1]
        last[1] += r
        last[2] += i
        last[3] += o
        self.requests += r
        self.input_tokens += i
        self.output_tokens += o

    def frees_by(
        self, col: int, fraction: float, now: float, span_s: float, bucket_s: float
    ) -> float:
        """Seconds until ``fraction`` of this window's column ``col`` has aged out."""
        total = sum(b[col] for b in self.buckets)
        if total <= 0:
            return span_s
        need, gone = fraction * total, 0.0
        for b in self.buckets:
            gone += b[col]
            if gone >= need:
                return max(0.0, b[0] + bucket_s + span_s - now)
        return span_s


class QuotaBook:
    def __init__(self, span_s: float = 60.0, bucket_s: float = 1.0, peer_ttl_s: float = 10.0):
        self.span_s = span_s
        self.bucket_s = bucket_s
        self.peer_ttl_s = peer_ttl_s
        self._own: dict[str, _Window] = {}
        self._inflight: dict[str, int] = {}
        self._peers: dict[str, tuple[float, dict[str, Usage]]] = {}  # peer -> (heard, usage)
        # per tenant: [requests, input tokens] this router admitted since it last heard another
        self._unsynced: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ this router's usage
    def admitted(self, tenant: str, input_tokens: int, now: float) -> None:
        """A request of ``tenant`` was admitted (counted before it is sent)."""
        w = self._own.get(tenant)
        if w is None:
            w = self._own[tenant] = _Window()
        w.add(now, self.bucket_s, 1, input_tokens, 0)
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        if self._peers:
            u = self._unsynced.get(tenant)
            if u is None:
                self._unsynced[tenant] = [1, input_tokens]
            else:
                u[0] += 1
                u[1] += input_tokens

    def ended(self, tenant: str, output_tokens: int, now: float) -> None:
        """An admitted request of ``tenant`` ended having generated ``output_tokens``."""
        n = self._inflight.get(tenant, 0) - 1
        if n > 0:
            self._inflight[tenant] = n
        else:
            self._inflight.pop(tenant, None)
        w = self._own.get(tenant)
        if w is None:
            w = self._own[tenant] = _Window()
        w.add(now, self.bucket_s, 0, 0, output_tokens)

    def report(self, now: float) -> dict[str, list[int]]:
        """This router's usage per tenant (for the other routers); tenants with none left out."""
        out = {}
        for t in list(self._own):
            w = self._own[t]
            w.advance(now, self.span_s, self.bucket_s)
            c = self._inflight.get(t, 0)
            if not w.buckets and not c:
                del self._own[t]
                continue
            out[t] = [w.requests, w.input_tokens, w.output_tokens, c]
        for t, c in self._inflight.items():
            if t not in out:
                out[t] = [0, 0, 0, c]
        return out

    # ------------------------------------------------------------------ the others' usage
    def on_peer(self, peer: str, report: dict[str, list[int]], now: float) -> None:
        self._peers[peer] = (now, {t: Usage.from_list(v) for t, v in report.items()})
        self._unsynced.clear()

    def usage(self, tenant: str, now: float) -> Usage:
        """The tenant's usage as this router knows it: its own + the others' last reports."""
        u = Usage(concurrent=self._inflight.get(tenant, 0))
        w = self._own.get(tenant)
        if w is not None:
            w.advance(now, self.span_s, self.bucket_s)
            u.requests, u.input_tokens, u.output_tokens = (
                w.requests,
                w.input_tokens,
                w.output_tokens,
            )
        for peer, (heard, per) in list(self._peers.items()):
            if now - heard > self.peer_ttl_s:
                del self._peers[peer]
                continue
            p = per.get(tenant)
            if p is not None:
                u.requests += p.requests
                u.input_tokens += p.input_tokens
                u.output_tokens += p.output_tokens
                u.concurrent += p.concurrent
        return u

    # ------------------------------------------------------------------ the check
    def check(
        self, tenant: str, quota: TenantQuota, input_tokens: int, now: float
    ) -> Refusal | None:
        """None when a request of ``input_tokens`` prompt tokens fits ``tenant``'s quota now,
        else the first limit it breaks."""
        if (
            quota.requests_per_min is None
            and quota.input_tokens_per_min is None
            and quota.output_tokens_per_min is None
            and quota.concurrent_requests is None
        ):
            return None
        u = self.usage(tenant, now)
        q = quota.concurrent_requests
        if q is not None and u.concurrent + 1 > q:
            return Refusal(
                "concurrent_requests",
                1,
                f"tenant {tenant!r} has {u.concurrent} of {q} concurrent requests in flight",
            )
        routers = 1 + len(self._peers)  # usage() dropped the silent ones
        unsynced = self._unsynced.get(tenant) or (0, 0)
        for limit, col, used, want, mine in (
            ("requests_per_min", 1, u.requests, 1, unsynced[0]),
            ("input_tokens_per_min", 2, u.input_tokens, input_tokens, unsynced[1]),
            ("output_tokens_per_min", 3, u.output_tokens, 1, 0),
        ):
            q = getattr(quota, limit)
            if q is None:
                continue
            if used + want <= q:
                # the others may be admitting too: until it hears one of them again, this
                # router takes at most its 1/routers of the headroom it knew then (and always
                # one request: a headroom smaller than one per router is not stranded)
                if routers == 1 or not mine or mine + want <= (q - (used - mine)) / routers:
                    continue
                what = limit.replace("_per_min", "").replace("_", " ")
                return Refusal(
                    limit,
                    1,
                    f"tenant {tenant!r} is near its quota of {q} {what} per minute, shared by "
                    f"{routers} routers: this one takes at most 1/{routers} of the "
                    f"{q - (used - mine)} left until it hears the others again",
                )
            excess = used + want - q
            w = self._own.get(tenant)
            after = (
                w.frees_by(col, min(1.0, excess / used), now, self.span_s, self.bucket_s)
                if w is not None and used > 0 and want <= q
                else self.span_s
            )
            what = limit.replace("_per_min", "").replace("_", " ")
            return Refusal(
                limit,
                max(1, math.ceil(after)),
                f"tenant {tenant!r} is over its quota of {q} {what} per minute "
                f"({used} used in the last {self.span_s:g} s)",
            )
        return None
