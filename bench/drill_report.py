"""The fault drill's figures, from the clients' outcomes and the stack's counters: one row per
scenario, the per-second timeline behind it, and the markdown table. Pure: no I/O.

Time to recover: from the moment the drill ended the fault (``clear``; for a fault the stack
heals itself, the moment it struck) to the start of the first whole second, counted from
then, in which requests were sent and every one of them was ``ok``. 0 when the first second
already was; None when no such second came before the scenario ended.

Invariant: ``requests == ok + failed + refused + cut`` in every row.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.drill_load import CUT, FAILED, OK, REFUSED, Outcome


def recovery_s(outcomes: Sequence[Outcome], fault_end: float, until: float) -> float | None:
    """Seconds from ``fault_end`` to the first fully successful second (module docstring)."""
    buckets: dict[int, Counter[str]] = {}
    for o in outcomes:
        if fault_end <= o.sent < until:
            buckets.setdefault(int(o.sent - fault_end), Counter())[o.kind] += 1
    for second in sorted(buckets):
        kinds = buckets[second]
        if kinds and set(kinds) == {OK}:
            return float(second)
    return None


def timeline(outcomes: Sequence[Outcome], origin: float) -> list[dict[str, int]]:
    """Per second since ``origin`` (by send time): how many of each kind; seconds before
    ``origin`` are negative."""
    per: dict[int, Counter[str]] = {}
    for o in outcomes:
        per.setdefault(math.floor(o.sent - origin), Counter())[o.kind] += 1
    return [{"t": t, **{k: per[t][k] for k in (OK, FAILED, REFUSED, CUT)}} for t in sorted(per)]


@dataclass
class Row:
    scenario: str
    fault: str
    hold_s: float  # 0: none (a kill the stack heals by itself, or no fault)
    requests: int
    ok: int
    failed: int
    refused: int
    cut: int
    http_404: int
    recover_s: float | None  # None: not within the scenario; see the module docstring
    repairs: float  # verifier repairs over the scenario, summed over indexers
    verify_checks: float = 0.0  # the verifier's checks over the scenario (what repairs are of)
    alerts: dict[str, int] = field(default_factory=dict)  # firing managed alerts by kind
    router_rss_mib: float | None = None  # the router's peak resident memory
    streams: int = 0  # of the requests, streamed
    unfinished: int = 0  # still in flight when the scenario ended (not counted above)
    in_flight_at_fault: int = 0  # requests sent before the fault struck, answered after
    left_behind: list[str] = field(default_factory=list)  # not recovered when it ended
    failures: list[str] = field(default_factory=list)  # distinct reasons (kind: detail)
    faulty: bool = True  # False: the baseline, which has no fault to recover from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    scenario: str,
    fault: str,
    hold_s: float,
    outcomes: Sequence[Outcome],
    fault_end: float | None,
    until: float,
) -> Row:
    """A row from the clients' side (the stack's counters are filled in by the caller);
    ``fault_end``: when the drill ended the fault, None for the baseline (no fault)."""
    kinds = Counter(o.kind for o in outcomes)
    reasons = sorted({f"{o.kind}: {o.detail[:80]}" for o in outcomes if o.kind != OK})
    return Row(
        scenario=scenario,
        fault=fault,
        hold_s=hold_s,
        requests=len(outcomes),
        ok=kinds[OK],
        failed=kinds[FAILED],
        refused=kinds[REFUSED],
        cut=kinds[CUT],
        http_404=sum(o.status == 404 for o in outcomes),
        recover_s=None if fault_end is None else recovery_s(outcomes, fault_end, until),
        faulty=fault_end is not None,
        repairs=0.0,
        streams=sum(o.stream for o in outcomes),
        failures=reasons[:10],
    )


def in_flight_at(outcomes: Sequence[Outcome], moment: float) -> dict[str, int]:
    """Requests sent before ``moment`` and answered (or cut) after it, by the worker the
    router first chose ("?" when no answer named one)."""
    counts = Counter(o.worker or "?" for o in outcomes if o.sent <= moment <= o.done)
    return dict(sorted(counts.items()))


def alerts_by_kind(alerts: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Firing alerts per kind (a resolution is not an alert raised)."""
    return dict(sorted(Counter(a["kind"] for a in alerts if a["state"] == "firing").items()))


HEADER = (
    "| scenario | fault | requests | failed | refused (503 + Retry-After) | streams cut | 404 "
    "| time to recover | verifier repairs | alerts raised | router RSS max | left behind |"
)


def markdown(rows: Sequence[Row]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        if not r.faulty:
            recover = "-"
        elif r.recover_s is None:
            recover = "not in the run"
        else:
            recover = f"{r.recover_s:.0f} s"
        alerts = ", ".join(f"{k} {n}" for k, n in r.alerts.items()) or "0"
        rss = "-" if r.router_rss_mib is None else f"{r.router_rss_mib:.0f} MiB"
        hold = f" ({r.hold_s:.0f} s)" if r.hold_s and r.faulty else ""
        lines.append(
            f"| {r.scenario} | {r.fault}{hold} | {r.requests} ({r.streams} streamed) | {r.failed} "
            f"| {r.refused} | {r.cut} | {r.http_404} | {recover} "
            f"| {r.repairs:.0f} of {r.verify_checks:.0f} checks | {alerts} "
            f"| {rss} | {'; '.join(r.left_behind) or '-'} |"
        )
    return "\n".join(lines)
