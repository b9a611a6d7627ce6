"""Ground truth from the workers themselves: their Prometheus ``/metrics`` (vLLM names).

The hit rate of a run is ``Δ vllm:prefix_cache_hits / Δ vllm:prefix_cache_queries`` summed
over the workers, from scrapes before and after the run — what the engines did, not what the
router believed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.metrics import CacheCounters

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"


def parse_counters(text: str, names: tuple[str, ...] = (QUERIES, HITS)) -> dict[str, float]:
    """Sum of each named counter's samples (``name`` or ``name_total``) in a metrics page."""
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(text):
        base = fam.name[:-6] if fam.name.endswith("_total") else fam.name
        if base not in out:
            continue
        for s in fam.samples:
            if s.name in (base, base + "_total"):
                out[base] += float(s.value)
    return out


# what kvgate's router did besides routing (hot-prefix replicas, held followers)
REPLICAS = "kvgate_router_replicas"
HOLDS = "kvgate_router_follower_holds"


# reuse attribution (services/router/outcomes.py): prompt tokens by kind, lost by reason
PROMPT = "kvgate_router_prompt_tokens"
PREFIX = "kvgate_router_prefix_tokens"
LOST = "kvgate_router_prefix_tokens_lost"


def parse_reuse(text: str) -> dict[str, float]:
    """The router's reuse counters in a metrics page: ``reuse:<kind>`` and
    ``reuse:lost:<reason>`` (summed over arms), and ``reuse:prompt``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == PREFIX + "_total":
                key = f"reuse:{s.labels.get('kind', '')}"
            elif s.name == LOST + "_total":
                key = f"reuse:lost:{s.labels.get('reason', '')}"
            elif s.name == PROMPT + "_total":
                key = "reuse:prompt"
            else:
                continue
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


async def scrape(
    session: aiohttp.ClientSession,
    url: str,
    names: tuple[str, ...] = (QUERIES, HITS),
    reuse: bool = False,
) -> dict[str, float] | None:
    try:
        async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
            if r.status != 200:
                return None
            text = await r.text()
            out = parse_counters(text, names)
            if reuse:
                out.update(parse_reuse(text))
            return out
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def scrape_router(url: str) -> dict[str, float] | None:
    """The router's replica, hold and reuse counters (None when it serves no such metrics
    page)."""
    async with aiohttp.ClientSession() as s:
        return await scrape(s, url, (REPLICAS, HOLDS), reuse=True)


def router_reuse(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any] | None:
    """A run's reuse attribution from the router's counters (:func:`scrape_router` before and
    after), in :func:`bench.metrics.reuse`'s shape; None without them (another router)."""
    if before is None or after is None:
        return None
    d = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("reuse:")}
    prompt = d.get("reuse:prompt", 0.0)
    if prompt <= 0 or "reuse:available" not in d:
        return None
    lost = {
        k.removeprefix("reuse:lost:"): v / prompt
        for k, v in d.items()
        if k.startswith("reuse:lost:") and v > 0
    }
    return {
        "prompt_tokens": int(prompt),
        "available": d.get("reuse:available", 0.0) / prompt,
        "captured": d.get("reuse:captured", 0.0) / prompt,
        "delivered": d.get("reuse:delivered", 0.0) / prompt,
        "unpredicted": d.get("reuse:unpredicted", 0.0) / prompt,
        "lost": dict(sorted(lost.items(), key=lambda kv: -kv[1])),
    }


def router_actions(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int] | None:
    """``{"replicas": n, "held": n}`` over a run, from :func:`scrape_router` before and after."""
    if before is None or after is None:
        return None
    return {
        "replicas": int(after[REPLICAS] - before[REPLICAS]),
        "held": int(after[HOLDS] - before[HOLDS]),
    }


async def scrape_all(urls: dict[str, str]) -> dict[str, dict[str, float] | None]:
    """``{worker_id: url}`` -> ``{worker_id: counters or None}``."""
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(*(scrape(s, u) for u in urls.values()))
    return dict(zip(urls, got, strict=True))


def delta(
    before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]
) -> CacheCounters:
    """Per-worker and total counter deltas (a worker missing from either scrape is skipped)."""
    cc = CacheCounters()
    for w, a in after.items():
        b = before.get(w)
        if a is None or b is None:
            continue
        q = a[QUERIES] - b[QUERIES]
        h = a[HITS] - b[HITS]
        cc.queries += q
        cc.hits += h
        cc.per_worker[w] = (q, h)
    return cc
