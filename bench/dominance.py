"""``python -m bench.dominance``: does any peer rule beat a policy on every figure at once?

Reads a routing v2 sweep's results (``bench/routing_v2_sweep.sh``: one directory per
``<workload>-<engine>-n<workers>-s<seed>``), averages each policy's figures over the seeds of
each configuration (the figures of ``bench.slo_table``: TTFT mean and p99, ITL p99, e2e mean,
hit rate, SLO attainment with the sweep's targets) and prints, per configuration and peer, on
how many figures ``--ours`` is better and on how many worse. A peer *dominates* where ours is
worse on some figure and better on none; ours dominates where the reverse holds::

    python -m bench.dominance bench/results/rv2 --ours slo_aware
    python -m bench.dominance bench/results/rv2 --ours slo_aware --tolerance   # 2 % / 0.5 pt
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from bench.slo_table import FIGURES, PEERS, collect, run_labels, seed_means

# the sweep's SLO targets per engine configuration: (TTFT s, TPOT s)
SLO = {"default": (2.0, 0.05), "pb": (6.25, 0.05)}


# within these a figure counts as equal: latencies relative (2 %), percentages in points (0.5)
REL_TOL = 0.02
PT_TOL = 0.5


def compare(
    ours: dict[str, float], peer: dict[str, float], rel: float = 0.0, pt: float = 0.0
) -> tuple[int, int]:
    """Figures on which ``ours`` is better and worse than ``peer``: equal, or within ``rel`` x
    the peer's (latencies) / ``pt`` points (hit rate, SLO attainment), counts as neither."""
    better = worse = 0
    for k, (_label, lower, _fmt) in FIGURES.items():
        a, b = ours[k], peer[k]
        tol = rel * abs(b) if lower else pt
        if abs(a - b) <= tol:
            continue
        if (a < b) == lower:
            better += 1
        else:
            worse += 1
    return better, worse


def verdict(better: int, worse: int) -> str:
    """Ours against one peer, from :func:`compare`'s counts."""
    if not worse:
        return "ours dominates" if better else "equal"
    return "mixed" if better else "peer dominates"


def configurations(root: Path) -> dict[str, list[Path]]:
    """The sweep's run directories by configuration (``workload-engine-nN``), seeds sorted."""
    out: dict[str, list[Path]] = defaultdict(list)
    for d in sorted(root.iterdir()):
        name, sep, seed = d.name.rpartition("-s")
        if sep and seed.isdigit() and (d / "results.json").exists():
            out[name].append(d)
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.dominance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("root", type=Path, help="the sweep's output directory (its OUT)")
    ap.add_argument("--ours", default="slo_aware", help="the policy compared (default slo_aware)")
    ap.add_argument("--peers", default=PEERS, help=f"comma-separated (default {PEERS})")
    ap.add_argument(
        "--tolerance",
        action="store_true",
        help=f"figures within {REL_TOL:.0%} (latencies) or {PT_TOL} points (hit rate, SLO "
        "attainment) of the peer's count as equal (issue 37's test)",
    )
    a = ap.parse_args(argv)
    rel, pt = (REL_TOL, PT_TOL) if a.tolerance else (0.0, 0.0)
    try:
        ours_labels = run_labels(a.ours)
        peers = run_labels(a.peers)
    except ValueError as exc:
        ap.error(str(exc))
    if len(ours_labels) != 1:
        ap.error("--ours names one policy")
    (ours,) = ours_labels
    configs = configurations(a.root) if a.root.is_dir() else {}
    if not configs:
        print(f"dominance: no sweep runs under {a.root}", file=sys.stderr)
        return 2
    tally = {"ours dominates": 0, "mixed": 0, "peer dominates": 0, "equal": 0}
    print("| configuration | seeds | " + " | ".join(f"`{p}`" for p in peers) + " |")
    print("|---|---:|" + "---|" * len(peers))
    for name, dirs in configs.items():
        engine = name.split("-")[1] if name.count("-") >= 2 else "default"
        per = collect(dirs, *SLO.get(engine, SLO["default"]))
        mean = seed_means(per)
        if ours not in mean:
            print(f"dominance: no runs of {ours} in {name}", file=sys.stderr)
            return 2
        cells = []
        for p in peers:
            if p not in mean:
                cells.append("–")
                continue
            better, worse = compare(mean[ours], mean[p], rel, pt)
            kind = verdict(better, worse)
            tally[kind] += 1
            mark = " **dominated**" if kind == "peer dominates" else ""
            cells.append(f"+{better} / -{worse}{mark}")
        print(f"| {name} | {len(dirs)} | " + " | ".join(cells) + " |")
    print()
    print(
        f"`{ours}` against each peer rule, figures better / worse: "
        + ", ".join(f"{k} {v}" for k, v in tally.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
