"""Per-request results and the summary of one run (one policy or one external router). Pure.

Both ``kvgate bench`` (wall clock, real HTTP) and ``kvgate simulate`` (virtual clock) produce a
list of :class:`RequestResult` with times in seconds from the start of the run, plus the
workers' own prefix-cache counters; :func:`summarize` turns them into the same figures, so the
two reports are directly comparable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OK, ERROR, TIMEOUT, REJECTED = "ok", "error", "timeout", "rejected"


@dataclass(slots=True)
class RequestResult:
    """What happened to one request. Times are seconds from the start of the run; ``ttft_s``
    and ``e2e_s`` are measured from ``send_s`` (when the client sent it, which for open-loop
    runs is its scheduled arrival). ``itl_s`` holds the gaps between consecutive streamed
    tokens (chunks)."""

    request_id: str
    status: str = OK
    worker: str | None = None
    send_s: float = 0.0
    dispatch_s: float | None = None  # when the router sent it to a worker (simulator only)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # reuse attribution of the decision that sent it (services/core/policy/attribution.py):
    # the most prompt tokens an eligible worker held cached, the chosen worker's, and why
    # the best holder was not taken; None where the client cannot know (a live bench)
    available_tokens: int | None = None
    captured_tokens: int | None = None
    lost_reason: str = ""
    error: str = ""
    prefill_worker: str | None = None  # disaggregated: the engine that computed the prompt

    @property
    def end_s(self) -> float:
        return self.send_s + (self.e2e_s or 0.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_s"] = [round(x, 6) for x in self.itl_s]
        return d


@dataclass
class CacheCounters:
    """Prefix-cache counters from the workers themselves (vllm:prefix_cache_queries / hits),
    as deltas over the run. The ground truth for hit rate."""

    queries: float = 0.0
    hits: float = 0.0
    per_worker: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": (sum(values) / len(values)) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


# ITL histogram kept in every summary (bounded: a fixed number of log-spaced bins, whatever the
# number of tokens): bin i counts gaps in [LO x 10^(i/PER_DECADE), LO x 10^((i+1)/PER_DECADE)),
# bin 0 also everything below LO, the last bin everything above HI
ITL_HIST_LO_S = 1e-4
ITL_HIST_HI_S = 1e3
ITL_HIST_PER_DECADE = 40


def itl_histogram(values: Iterable[float]) -> dict[str, Any]:
    """A log-spaced histogram of inter-token gaps (seconds), trailing empty bins dropped:
    ``{"lo_s", "per_decade", "counts"}``. Resolution 10^(1/40) (6%) per bin, at most 280 bins,
    so a run with millions of tokens stores the same few hundred numbers as one with ten."""
    nbins = round(math.log10(ITL_HIST_HI_S / ITL_HIST_LO_S) * ITL_HIST_PER_DECADE)
    counts = [0] * nbins
    lo = ITL_HIST_LO_S
    k = ITL_HIST_PER_DECADE
    for v in values:
        i = math.floor(math.log10(v / lo) * k) if v > lo else 0
        counts[i if i < nbins else nbins - 1] += 1
    while counts and not counts[-1]:
        counts.pop()
    return {"lo_s": lo, "per_decade": k, "counts": counts}


def histogram_cdf(hist: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The CDF of :func:`itl_histogram`'s output: (upper bin edges in seconds, fraction of
    samples at or below each), empty bins skipped."""
    counts = hist.get("counts") or []
    total = sum(counts)
    xs: list[float] = []
    ys: list[float] = []
    if not total:
        return xs, ys
    lo, k = hist["lo_s"], hist["per_decade"]
    acc = 0
    for i, c in enumerate(counts):
        if c:
            acc += c
            xs.append(lo * 10 ** ((i + 1) / k))
            ys.append(acc / total)
    return xs, ys


def inflight_stats(
    intervals: Iterable[tuple[float, float]], t0: float, t1: float
) -> tuple[int, float]:
    """(max, time-averaged) number of overlapping intervals within [t0, t1]."""
    events: list[tuple[float, int]] = []
    for a, b in intervals:
        events.append((a, 1))
        events.append((max(a, b), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
    cur = peak = 0
    area = 0.0
    last = t0
    for t, d in events:
        tc = min(max(t, t0), t1)
        area += cur * (tc - last)
        last = tc
        cur += d
        peak = max(peak, cur)
    area += cur * max(0.0, t1 - last)
    span = t1 - t0
    return peak, (area / span if span > 0 else 0.0)


def inflight_series(
    intervals: Iterable[tuple[float, float]], t1: float, bins: int = 100
) -> list[float]:
    """Time-averaged in-flight count in each of ``bins`` equal bins over [0, t1]."""
    if t1 <= 0 or bins <= 0:
        return []
    width = t1 / bins
    area = [0.0] * bins
    for a, b in intervals:
        a, b = max(0.0, a), min(t1, b)
        if b <= a:
            continue
        i = min(int(a / width), bins - 1)
        while a < b and i < bins:
            edge = (i + 1) * width
            seg = min(b, edge) - a
            area[i] += seg
            a += seg
            i += 1
    return [x / width for x in area]


def summarize(
    results: Sequence[RequestResult],
    workers: Sequence[str],
    cache: CacheCounters | None = None,
    duration_s: float | None = None,
    bins: int = 100,
) -> dict[str, Any]:
    """The figures of one run: latency percentiles, throughput, errors, hit rate (ground truth
    from ``cache`` when given; the client-side figure from usage.cached_tokens as well), and
    per-worker request share and in-flight counts (from the worker each response named)."""
    ok = [r for r in results if r.status == OK]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    if duration_s is None:
        duration_s = max((r.end_s for r in results), default=0.0)
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    counts = {s: 0 for s in (OK, ERROR, TIMEOUT, REJECTED)}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1

    names = list(workers) or sorted({r.worker for r in ok if r.worker})
    by_worker: dict[str, list[RequestResult]] = {w: [] for w in names}
    unknown = 0
    for r in ok:
        if r.worker in by_worker:
            by_worker[r.worker].append(r)
        elif r.worker is not None:
            by_worker.setdefault(r.worker, []).append(r)
        else:
            unknown += 1
    attributed = sum(len(v) for v in by_worker.values())
    fair = attributed / len(by_worker) if by_worker else 0.0
    per_worker: dict[str, Any] = {}
    series: dict[str, list[float]] = {}
    for w, rs in sorted(by_worker.items()):
        iv = [(r.send_s, r.end_s) for r in rs]
        peak, mean = inflight_stats(iv, 0.0, dur)
        per_worker[w] = {
            "requests": len(rs),
            "share": len(rs) / attributed if attributed else 0.0,
            "fair_ratio": len(rs) / fair if fair else 0.0,
            "max_inflight": peak,
            "mean_inflight": mean,
        }
        if cache is not None and w in cache.per_worker:
            q, h = cache.per_worker[w]
            per_worker[w]["hit_rate"] = h / q if q > 0 else None
        series[w] = inflight_series(iv, dur, bins)
    ratios = [v["fair_ratio"] for v in per_worker.values()]
    return {
        "requests": len(results),
        "completed": counts[OK],
        "errors": counts[ERROR],
        "timeouts": counts[TIMEOUT],
        "rejected": counts[REJECTED],
        "duration_s": duration_s,
        "ttft_s": _dist(ttft),
        "itl_s": _dist(itl),
        "e2e_s": _dist(e2e),
        "request_throughput": counts[OK] / dur,
        "output_token_throughput": out_tokens / dur,
        "total_token_throughput": (out_tokens + in_tokens) / dur,
        "prompt_tokens": in_tokens,
        "completion_tokens": out_tokens,
        "hit_rate": cache.hit_rate if cache is not None else None,
        "hit_rate_reported": cached / in_tokens if in_tokens else None,
        "reuse": reuse(ok),
        "workers_used": sum(1 for v in per_worker.values() if v["requests"] > 0),
        "fair_ratio_min": min(ratios) if ratios else None,
        "fair_ratio_max": max(ratios) if ratios else None,
        "unattributed": unknown,
        "per_worker": per_worker,
        "inflight_series": {"bin_s": dur / bins if bins else 0.0, "workers": series},
        "ttft_sorted": sorted(ttft),
        "itl_hist": itl_histogram(itl),
        # per completed request (TTFT s, TPOT s): SLO attainment at any targets, see
        # :func:`slo_attainment` (requests not completed count as misses)
        "slo_samples": [[round(t, 5), round(tp, 6)] for t, tp in slo_samples(ok)],
    }


def reuse(ok: Sequence[RequestResult]) -> dict[str, Any] | None:
    """Reuse attribution over completed requests, as fractions of their prompt tokens:
    ``available`` (some eligible worker held them cached), ``captured`` (the chosen worker
    held them), ``delivered`` (the engine reported them cached), ``lost`` by reason (the
    decision's reason for available - captured, ``engine`` for captured - delivered) and
    ``unpredicted`` (delivered beyond captured: blocks the index had not heard of yet); so
    available = delivered + sum(lost) - unpredicted. None without attribution (live runs)."""
    rs = [r for r in ok if r.available_tokens is not None and r.captured_tokens is not None]
    prompt = sum(r.prompt_tokens for r in rs)
    if not rs or not prompt:
        return None
    avail = capt = deliv = unpred = 0
    lost: dict[str, int] = {}
    for r in rs:
        a, c, d = r.available_tokens or 0, r.captured_tokens or 0, r.cached_tokens
        avail, capt, deliv = avail + a, capt + c, deliv + d
        if a > c:
            why = r.lost_reason or "filtered"
            lost[why] = lost.get(why, 0) + a - c
        if d < c:
            lost["engine"] = lost.get("engine", 0) + c - d
        else:
            unpred += d - c
    return {
        "prompt_tokens": prompt,
        "available": avail / prompt,
        "captured": capt / prompt,
        "delivered": deliv / prompt,
        "unpredicted": unpred / prompt,
        "lost": {k: v / prompt for k, v in sorted(lost.items(), key=lambda kv: -kv[1])},
    }


def tpot_s(r: RequestResult) -> float:
    """Time per output token after the first: (e2e - TTFT) / (completion tokens - 1); 0 for a
    request with at most one token."""
    if r.ttft_s is None or r.e2e_s is None or r.completion_tokens <= 1:
        return 0.0
    return max(0.0, r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


def slo_samples(ok: Sequence[RequestResult]) -> list[tuple[float, float]]:
    return [(r.ttft_s, tpot_s(r)) for r in ok if r.ttft_s is not None]


def slo_attainment(summary: dict[str, Any], ttft_target_s: float, tpot_target_s: float) -> float:
    """Fraction of *all* requests of a run (``summarize`` output) that completed with TTFT and
    TPOT within the targets."""
    n = summary.get("requests") or 0
    if not n:
        return 0.0
    met = sum(
        1 for t, tp in summary.get("slo_samples", ()) if t <= ttft_target_s and tp <= tpot_target_s
    )
    return met / n
