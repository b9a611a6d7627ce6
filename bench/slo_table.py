"""``python -m bench.slo_table``: the issue-19 figures of ``kvgate simulate`` results, per policy,
over seeds, and the candidate policy against the best peer baseline on each figure.

Reads the ``results.json`` of one or more simulate runs (one per seed, same policies) and
prints a Markdown table: TTFT mean / p99, ITL p99, e2e mean, prefix hit rate and SLO
attainment (TTFT and TPOT within targets, requests not completed count as misses), as the mean
over the runs, then the ratio of ``--ours`` to the best of ``--peers`` on each figure. When every
directory also holds a ``bound.json`` (``python -m bench.latency_bound``), two more rows: what
no policy can beat (TTFT mean and p99, e2e mean; the hit rate's infinite-cache bound), and that
bound against the best peer: a target is *unreachable* where the bound alone misses it::

    python -m bench.slo_table bench/results/mt-pb-s{0,1,2,3,4} --ours slo_aware \\
        --slo-ttft-ms 2000 --slo-tpot-ms 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.common import parse_policies
from bench.metrics import slo_attainment

PEERS = "sglang_cache_aware,dynamo_kv,llmd_default,llmd_kv_util"
# figure -> (label, lower is better, format)
FIGURES = {
    "ttft_mean": ("TTFT mean s", True, "{:.3f}"),
    "ttft_p99": ("TTFT p99 s", True, "{:.3f}"),
    "itl_p99": ("ITL p99 ms", True, "{:.1f}"),
    "e2e_mean": ("e2e mean s", True, "{:.2f}"),
    "hit": ("hit rate %", False, "{:.1f}"),
    "slo": ("SLO attained %", False, "{:.1f}"),
}
# targets of the issue: TTFT mean <= 0.8x, p99 <= 0.9x, ITL p99 <= 1.0x, e2e <= 0.95x the best
# peer; hit rate >= best - 0.5 points; SLO attainment >= every peer's
TARGETS = {
    "ttft_mean": 0.8,
    "ttft_p99": 0.9,
    "itl_p99": 1.0,
    "e2e_mean": 0.95,
    "hit": -0.5,
    "slo": 0.0,
}


def figures(summary: dict, ttft_s: float, tpot_s: float) -> dict[str, float]:
    return {
        "ttft_mean": summary["ttft_s"]["mean"] or 0.0,
        "ttft_p99": summary["ttft_s"]["p99"] or 0.0,
        "itl_p99": (summary["itl_s"]["p99"] or 0.0) * 1000.0,
        "e2e_mean": summary["e2e_s"]["mean"] or 0.0,
        "hit": 100.0 * (summary["hit_rate"] or 0.0),
        "slo": 100.0 * slo_attainment(summary, ttft_s, tpot_s),
    }


def collect(dirs: list[Path], ttft_s: float, tpot_s: float) -> dict[str, list[dict]]:
    per: dict[str, list[dict]] = {}
    for d in dirs:
        doc = json.loads((d / "results.json").read_text())
        for run in doc["runs"]:
            per.setdefault(run["label"], []).append(figures(run["summary"], ttft_s, tpot_s))
    return per


def seed_means(per: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each policy's figures averaged over its runs (one per seed)."""
    return {p: {k: statistics.fmean(r[k] for r in rs) for k in FIGURES} for p, rs in per.items()}


# the figures latency_bound bounds: figure -> its field in bound.json
BOUNDED = {"ttft_mean": "ttft_mean", "ttft_p99": "ttft_p99", "e2e_mean": "e2e_mean"}


def collect_bounds(dirs: list[Path]) -> list[dict[str, float]] | None:
    """Each run's bounds (figures in the table's units, hit rate included), or None unless
    every directory has a ``bound.json``."""
    if not all((d / "bound.json").exists() for d in dirs):
        return None
    out = []
    for d in dirs:
        b = json.loads((d / "bound.json").read_text())
        w = json.loads((d / "results.json").read_text())["workload"]
        row = {k: float(b[f]) for k, f in BOUNDED.items()}
        row["hit"] = 100.0 * w["infinite_cache_hit_rate"]
        out.append(row)
    return out


def bound_rows(
    bounds: list[dict[str, float]], mean: dict[str, dict[str, float]], present: list[str]
) -> list[str]:
    """The bound's row (mean over the runs) and the bound against the best peer's figure."""
    keys = list(FIGURES)
    b = {k: statistics.fmean(r[k] for r in bounds) for k in bounds[0]}
    cells = [FIGURES[k][2].format(b[k]) if k in b else "–" for k in keys]
    rows = [f"| bound (any policy) | {len(bounds)} | " + " | ".join(cells) + " |"]
    vs = []
    for k in keys:
        if k not in BOUNDED or not present:
            vs.append("–")
            continue
        best = min(mean[p][k] for p in present)
        ratio = b[k] / best if best else float("inf")
        vs.append(f"{ratio:.2f}x {'reachable' if ratio <= TARGETS[k] else '**unreachable**'}")
    rows.append("| bound vs best peer | | " + " | ".join(vs) + " |")
    return rows


def table(
    per: dict[str, list[dict]],
    ours: list[str],
    peers: list[str],
    bounds: list[dict[str, float]] | None = None,
) -> str:
    keys = list(FIGURES)
    head = "| policy | runs | " + " | ".join(FIGURES[k][0] for k in keys) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(keys)]
    mean = seed_means(per)
    for p, rs in per.items():
        cells = " | ".join(FIGURES[k][2].format(mean[p][k]) for k in keys)
        lines.append(f"| `{p}` | {len(rs)} | {cells} |")
    present = [p for p in peers if p in mean]
    for one in ours:
        if one in mean and present:
            lines.append(_versus(mean, one, present, keys))
    if bounds:
        lines.extend(bound_rows(bounds, mean, present))
    return "\n".join(lines)


def _versus(
    mean: dict[str, dict[str, float]], ours: str, present: list[str], keys: list[str]
) -> str:
    """The row comparing ``ours`` with the best of ``present`` on each figure separately."""
    cells = []
    for k in keys:
        _, lower, _ = FIGURES[k]
        vals = [mean[p][k] for p in present]
        best = min(vals) if lower else max(vals)
        o = mean[ours][k]
        if k in ("hit", "slo"):
            diff = o - best
            ok = diff >= TARGETS[k]
            cells.append(f"{diff:+.1f} pt {'met' if ok else '**missed**'}")
        else:
            ratio = o / best if best else float("inf")
            ok = ratio <= TARGETS[k]
            cells.append(f"{ratio:.2f}x {'met' if ok else '**missed**'}")
    return f"| `{ours}` vs best peer | | " + " | ".join(cells) + " |"


def run_labels(text: str) -> list[str]:
    """The run labels of comma-separated policies, written as ``kvgate simulate --policies``
    takes them (``name:{json params}``) or as the runs are labelled (``name{json params}``)."""
    return [label for label, _spec in parse_policies(text)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.slo_table", description=__doc__.split("\n")[0]
    )
    ap.add_argument("dirs", nargs="+", type=Path, help="simulate result directories (one per seed)")
    ap.add_argument(
        "--ours",
        default="slo_aware,kv_aware",
        help="the policies compared, comma-separated, as --policies names them (NAME or "
        "NAME:{json params}; default slo_aware,kv_aware)",
    )
    ap.add_argument("--peers", default=PEERS, help=f"comma-separated baselines (default {PEERS})")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT target (default 2000)")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT target (default 50)")
    a = ap.parse_args(argv)
    try:
        ours, peers = run_labels(a.ours), run_labels(a.peers)
    except ValueError as exc:
        ap.error(str(exc))
    per = collect(a.dirs, a.slo_ttft_ms / 1000.0, a.slo_tpot_ms / 1000.0)
    missing = [x for x in ours + peers if x not in per]
    if missing:
        print(f"slo_table: no runs labelled {', '.join(missing)}", file=sys.stderr)
    print(table(per, ours, peers, collect_bounds(a.dirs)))


if __name__ == "__main__":
    main()
