"""Agreement of two reports (typically ``kvgate bench`` and ``kvgate simulate`` on the same
scenario): per-run hit-rate differences and whether the two rank the runs the same way.

    python -m bench.compare bench/results/<bench-run> bench/results/<sim-run>

Ranking agreement is judged pairwise: for every pair of runs present in both reports whose
difference is clear in *both* (TTFT: more than ``--ttft-tol`` relative; hit rate: more than
``--hit-tol`` absolute), the order must be the same. Pairs that are close in either report are
ties and not counted. Pure functions plus a tiny CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any


def _load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    return json.loads(p.read_text())


def _metric(summary: dict[str, Any], name: str) -> float | None:
    if name == "hit_rate":
        return summary.get("hit_rate")
    dist, q = name.rsplit("_", 1)  # e.g. ttft_p50 -> ttft_s / p50
    return (summary.get(f"{dist}_s") or {}).get(q)


def pairwise_agreement(
    a: dict[str, float], b: dict[str, float], tol: float, relative: bool
) -> tuple[int, int, list[tuple[str, str]]]:
    """(agreeing pairs, disagreeing pairs, the disagreeing pairs)."""

    def clear(x: float, y: float) -> bool:
        if relative:
            return abs(x - y) > tol * max(abs(x), abs(y), 1e-12)
        return abs(x - y) > tol

    agree = disagree = 0
    bad: list[tuple[str, str]] = []
    for p, q in combinations(sorted(set(a) & set(b)), 2):
        if not (clear(a[p], a[q]) and clear(b[p], b[q])):
            continue
        if (a[p] < a[q]) == (b[p] < b[q]):
            agree += 1
        else:
            disagree += 1
            bad.append((p, q))
    return agree, disagree, bad


def compare(
    ra: dict[str, Any], rb: dict[str, Any], ttft_tol: float = 0.1, hit_tol: float = 0.01
) -> dict[str, Any]:
    runs_a = {r["label"]: r["summary"] for r in ra.get("runs", [])}
    runs_b = {r["label"]: r["summary"] for r in rb.get("runs", [])}
    common = [lbl for lbl in runs_a if lbl in runs_b]
    rows = []
    for lbl in common:
        sa, sb = runs_a[lbl], runs_b[lbl]
        ha, hb = sa.get("hit_rate"), sb.get("hit_rate")
        rows.append(
            {
                "label": lbl,
                "hit_rate_a": ha,
                "hit_rate_b": hb,
                "hit_rate_diff": (ha - hb) if ha is not None and hb is not None else None,
                "ttft_p50_a": _metric(sa, "ttft_p50"),
                "ttft_p50_b": _metric(sb, "ttft_p50"),
                "ttft_p99_a": _metric(sa, "ttft_p99"),
                "ttft_p99_b": _metric(sb, "ttft_p99"),
            }
        )
    rankings = {}
    for name, tol, rel in (
        ("hit_rate", hit_tol, False),
        ("ttft_p50", ttft_tol, True),
        ("ttft_p99", ttft_tol, True),
    ):
        va = {lbl: _metric(runs_a[lbl], name) for lbl in common}
        vb = {lbl: _metric(runs_b[lbl], name) for lbl in common}
        va = {k: v for k, v in va.items() if v is not None}
        vb = {k: v for k, v in vb.items() if v is not None}
        ok, bad, pairs = pairwise_agreement(va, vb, tol, rel)
        rankings[name] = {"agree": ok, "disagree": bad, "disagreeing_pairs": pairs}
    diffs = [abs(r["hit_rate_diff"]) for r in rows if r["hit_rate_diff"] is not None]
    return {
        "a": ra.get("name"),
        "b": rb.get("name"),
        "runs": rows,
        "max_hit_rate_diff": max(diffs) if diffs else None,
        "rankings": rankings,
    }


def markdown(c: dict[str, Any]) -> str:
    def f(x: Any, pct: bool = False) -> str:
        if x is None:
            return "–"
        return f"{100 * x:.1f}%" if pct else f"{1000 * x:.0f}"

    lines = [
        f"Agreement: `{c['a']}` (a) vs `{c['b']}` (b)",
        "",
        "| run | hit a | hit b | a − b | TTFT p50 a ms | TTFT p50 b ms | TTFT p99 a ms "
        "| TTFT p99 b ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in c["runs"]:
        diff = r["hit_rate_diff"]
        lines.append(
            f"| `{r['label']}` | {f(r['hit_rate_a'], True)} | {f(r['hit_rate_b'], True)} | "
            f"{'–' if diff is None else f'{100 * diff:+.1f}'} | {f(r['ttft_p50_a'])} | "
            f"{f(r['ttft_p50_b'])} | {f(r['ttft_p99_a'])} | {f(r['ttft_p99_b'])} |"
        )
    lines.append("")
    mh = c["max_hit_rate_diff"]
    lines.append(f"Largest hit-rate difference: {'–' if mh is None else f'{100 * mh:.1f}'} points.")
    for name, r in c["rankings"].items():
        lines.append(
            f"Ranking by {name}: {r['agree']} clear pairs agree, {r['disagree']} disagree"
            + (
                f" ({', '.join('/'.join(p) for p in r['disagreeing_pairs'])})"
                if r["disagree"]
                else ""
            )
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    ap.add_argument("a", help="results directory or results.json (e.g. a kvgate bench run)")
    ap.add_argument("b", help="results directory or results.json (e.g. a kvgate simulate run)")
    ap.add_argument("--ttft-tol", type=float, default=0.1, help="relative TTFT tie band")
    ap.add_argument("--hit-tol", type=float, default=0.01, help="absolute hit-rate tie band")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    c = compare(_load(args.a), _load(args.b), args.ttft_tol, args.hit_tol)
    print(json.dumps(c, indent=1) if args.json else markdown(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
