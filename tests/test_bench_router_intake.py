"""``python -m bench.router_intake``: the fleet's telemetry and heartbeats, published from
another process, reach the router's cluster state through a real NATS and are counted."""

from __future__ import annotations

import asyncio

from bench.router_intake import LOAD_HZ, measure


def test_intake_counts_what_the_fleet_publishes(nats_url: str) -> None:
    r = asyncio.run(measure(nats_url, 5, 1.5))
    # 5 workers x LOAD_HZ loads a second, plus their heartbeats: the rate is the fleet's,
    # within what one loaded machine's timers allow
    assert 0.5 * 5 * LOAD_HZ <= r["msgs_per_s"] <= 1.5 * 5 * (LOAD_HZ + 1)
    assert r["core_pct"] > 0 and r["us_per_msg"] > 0 and r["apply_us"] > 0
