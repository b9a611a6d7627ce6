"""Per-arm statistics of one canary window (pure; no I/O).

Invariants:
- An :class:`ArmStats` is a commutative monoid: ``a.merge(b) == b.merge(a)`` and merging
  the stats of two halves of a window gives the stats of the whole window. That is what lets
  several API replicas add their share of outcomes to the same Postgres row.
- TTFT is kept as a histogram over fixed log-spaced buckets (``GROWTH`` = 10 % wide), so a
  quantile is exact to within one bucket: ``bucket_upper(b) / GROWTH < q <= bucket_upper(b)``.
- The latency sample of an outcome is its TTFT when the router measured one (streaming),
  else its end-to-end time (a non-streamed answer's first byte arrives with its last).
- ``cancelled`` outcomes (the client went away) count nowhere; ``rejected`` counts as an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

BASE_S = 0.001  # upper bound of bucket 0
GROWTH = 1.1
N_BUCKETS = 150  # up to ~1.6e3 s


def ttft_bucket(seconds: float) -> int:
    if seconds <= BASE_S:
        return 0
    b = math.ceil(math.log(seconds / BASE_S) / math.log(GROWTH) - 1e-9)
    return min(max(b, 0), N_BUCKETS - 1)


def bucket_upper(bucket: int) -> float:
    return BASE_S * GROWTH**bucket


@dataclass
class ArmStats:
    requests: int = 0
    errors: int = 0
    timeouts: int = 0
    prompt_tokens: int = 0  # of outcomes whose cached_tokens is known
    cached_tokens: int = 0
    ttft: dict[int, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ building
    def add(
        self,
        status: str,
        ttft_s: float | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int | None = None,
    ) -> None:
        """Count one router outcome."""
        if status == "cancelled":
            return
        self.requests += 1
        if status == "timeout":
            self.timeouts += 1
        elif status in ("error", "rejected"):
            self.errors += 1
        elif status == "ok" and ttft_s is not None:
            b = ttft_bucket(ttft_s)
            self.ttft[b] = self.ttft.get(b, 0) + 1
        if cached_tokens is not None and status == "ok":
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += min(cached_tokens, prompt_tokens)

    def merge(self, other: ArmStats) -> ArmStats:
        ttft = dict(self.ttft)
        for b, n in other.ttft.items():
            ttft[b] = ttft.get(b, 0) + n
        return ArmStats(
            requests=self.requests + other.requests,
            errors=self.errors + other.errors,
            timeouts=self.timeouts + other.timeouts,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            ttft=ttft,
        )

    # ------------------------------------------------------------------ reading
    @property
    def ttft_samples(self) -> int:
        return sum(self.ttft.values())

    def ttft_quantile(self, q: float) -> float | None:
        """Upper edge of the bucket holding the q-quantile (None without samples)."""
        n = self.ttft_samples
        if n == 0:
            return None
        rank = max(1, math.ceil(q * n))
        seen = 0
        for b in sorted(self.ttft):
            seen += self.ttft[b]
            if seen >= rank:
                return bucket_upper(b)
        return bucket_upper(max(self.ttft))  # pragma: no cover - rank <= n

    @property
    def ttft_p95(self) -> float | None:
        return self.ttft_quantile(0.95)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def timeout_rate(self) -> float | None:
        return self.timeouts / self.requests if self.requests else None

    @property
    def cache_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def summary(self) -> dict[str, Any]:
        """The numbers a decision records (JSON-ready)."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "requests": self.requests,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "ttft_samples": self.ttft_samples,
            "ttft_p50_s": r(self.ttft_quantile(0.5)),
            "ttft_p95_s": r(self.ttft_p95),
            "error_rate": r(self.error_rate),
            "timeout_rate": r(self.timeout_rate),
            "cache_hit_rate": r(self.cache_hit_rate),
        }
