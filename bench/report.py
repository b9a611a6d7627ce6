"""Benchmark and simulation reports: results JSON, a Markdown table and PNG plots, written under
``bench/results/<name>/``. The same format for ``kvgate bench`` and ``kvgate simulate``.

A report is a dict::

    {"name", "kind": "bench"|"simulate", "created", "config": {...},
     "workload": Workload.summary() + {"infinite_cache_hit_rate"},
     "runs": [{"label", "router", "summary": metrics.summarize(...)}, ...],
     "comparisons": {...}}

Only I/O here is writing the files; everything else is pure formatting.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

BASELINES = ("round_robin", "prefix", "sglang-router", "vllm-router")


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def comparisons(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each run's TTFT and hit rate relative to the baselines present in the report (ratios < 1
    mean lower TTFT than the baseline), and its hit rate relative to the infinite-cache bound."""
    runs = {r["label"]: r["summary"] for r in report.get("runs", [])}
    bound = _get(report, "workload", "infinite_cache_hit_rate")
    out: dict[str, dict[str, Any]] = {}
    for label, s in runs.items():
        row: dict[str, Any] = {
            "hit_rate_vs_bound": _ratio(s.get("hit_rate"), bound),
        }
        for base in BASELINES:
            b = runs.get(base)
            if b is None or base == label:
                continue
            row[f"ttft_p50_vs_{base}"] = _ratio(_get(s, "ttft_s", "p50"), _get(b, "ttft_s", "p50"))
            row[f"ttft_p99_vs_{base}"] = _ratio(_get(s, "ttft_s", "p99"), _get(b, "ttft_s", "p99"))
            row[f"hit_rate_minus_{base}"] = (
                s["hit_rate"] - b["hit_rate"]
                if s.get("hit_rate") is not None and b.get("hit_rate") is not None
                else None
            )
        out[label] = row
    return out


def _fmt(x: Any, scale: float = 1.0, digits: int = 1, pct: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.{digits}f}%"
    return f"{x * scale:.{digits}f}"


def terminal_table(report: dict[str, Any]) -> str:
    """The few columns that matter, narrow enough for an 80-column terminal (the full table
    is in results.md, and ``--wide`` prints it)."""
    head: tuple[str, ...] = ("run", "ok", "fail", "TTFT p50", "TTFT p99", "ITL p50", "req/s", "hit")
    runs = report.get("runs", [])
    # a P/D comparison (kvgate simulate --pd): which fleet each ran on, and the ITL tail
    pd = any("pd" in run["summary"] for run in runs)
    if pd:
        head += ("ITL p99", "fleet")
    rows = []
    for run in runs:
        s = run["summary"]
        row: tuple[str, ...] = (
            run["label"][:22],
            str(s["completed"]),
            str(s["errors"] + s["timeouts"] + s["rejected"]),
            _fmt(_get(s, "ttft_s", "p50"), 1000) + " ms",
            _fmt(_get(s, "ttft_s", "p99"), 1000) + " ms",
            _fmt(_get(s, "itl_s", "p50"), 1000, 2) + " ms",
            _fmt(s["request_throughput"], 1, 1),
            _fmt(s.get("hit_rate"), pct=True),
        )
        if pd:
            fleet = s["pd"]["fleet"] if "pd" in s else f"{len(s.get('per_worker') or {})} colo"
            row += (_fmt(_get(s, "itl_s", "p99"), 1000, 1) + " ms", fleet)
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(head), *(line(r) for r in rows)]) + "\n" + reuse_text(report)


def reuse_line(reuse: dict[str, Any]) -> str:
    """``60.0% available, 45.0% captured, 40.0% delivered; lost: 15.0% load, ...`` (of prompt
    tokens)."""
    text = (
        f"{_fmt(reuse['available'], pct=True)} available, "
        f"{_fmt(reuse['captured'], pct=True)} captured, "
        f"{_fmt(reuse['delivered'], pct=True)} delivered"
    )
    lost = [f"{_fmt(v, pct=True)} {k}" for k, v in reuse["lost"].items() if v > 0]
    if lost:
        text += "; lost: " + ", ".join(lost)
    if reuse.get("unpredicted"):
        text += f"; {_fmt(reuse['unpredicted'], pct=True)} delivered beyond captured"
    return text


def reuse_text(report: dict[str, Any], width: int = 80) -> str:
    """Per run, where its prompt tokens' reuse went (simulated runs: the decisions'
    attribution), wrapped to ``width`` columns; empty when no run has it."""
    rows = [
        (run["label"], run["summary"]["reuse"])
        for run in report.get("runs", [])
        if run["summary"].get("reuse")
    ]
    if not rows:
        return ""
    pad = max(len(label) for label, _ in rows) + 4
    out = [
        "",
        "prompt tokens cached (available: on some eligible worker; captured: on the",
        "chosen one; delivered: by the engine's report):",
    ]
    for label, r in rows:
        out += textwrap.wrap(
            reuse_line(r),
            width,
            initial_indent=f"  {label}".ljust(pad),
            subsequent_indent=" " * pad,
        )
    return "\n".join(out) + "\n"


def markdown(report: dict[str, Any]) -> str:
    """The results as a Markdown document: one table row per run, then the ratios."""
    w = report.get("workload", {})
    lines = [
        f"# {report.get('name', 'benchmark')} ({report.get('kind', 'bench')})",
        "",
        f"Workload `{w.get('name')}`: {w.get('requests')} requests, "
        f"mean prompt {w.get('mean_prompt_tokens', 0):.0f} tokens, "
        f"infinite-cache hit-rate bound {_fmt(w.get('infinite_cache_hit_rate'), pct=True)}; "
        f"params `{json.dumps(w.get('params', {}), sort_keys=True)}`.",
        "",
        f"Config: `{json.dumps(report.get('config', {}), sort_keys=True)}`",
        "",
        "| run | ok | err | t/o | rej | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | e2e p50 s | req/s | out tok/s | hit rate | hit (usage) | workers used "
        "| share min–max (×fair) | max in-flight |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report.get("runs", []):
        s = run["summary"]
        peak = max((v["max_inflight"] for v in s.get("per_worker", {}).values()), default=None)
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{run['label']}`",
                    str(s["completed"]),
                    str(s["errors"]),
                    str(s["timeouts"]),
                    str(s["rejected"]),
                    _fmt(_get(s, "ttft_s", "p50"), 1000),
                    _fmt(_get(s, "ttft_s", "p95"), 1000),
                    _fmt(_get(s, "ttft_s", "p99"), 1000),
                    _fmt(_get(s, "itl_s", "p50"), 1000, 2),
                    _fmt(_get(s, "itl_s", "p99"), 1000, 2),
                    _fmt(_get(s, "e2e_s", "p50"), 1, 2),
                    _fmt(s["request_throughput"], 1, 2),
                    _fmt(s["output_token_throughput"], 1, 0),
                    _fmt(s.get("hit_rate"), pct=True),
                    _fmt(s.get("hit_rate_reported"), pct=True),
                    str(s.get("workers_used")),
                    f"{_fmt(s.get('fair_ratio_min'), 1, 2)}–{_fmt(s.get('fair_ratio_max'), 1, 2)}",
                    str(peak if peak is not None else "–"),
                ]
            )
            + " |"
        )
    reuse = [
        (run["label"], r) for run in report.get("runs", []) if (r := run["summary"].get("reuse"))
    ]
    if reuse:
        lines += [
            "",
            "Reuse of prompt tokens (available: cached on some eligible worker; captured: on the "
            "chosen one; delivered: by the engine's report; lost: why, "
            "services/core/policy/attribution.py):",
            "",
            *(f"- `{label}`: {reuse_line(r)}" for label, r in reuse),
        ]
    acts = [
        f"`{run['label']}` {a['replicas']} replicas, {a['held']} held"
        for run in report.get("runs", [])
        if (a := run.get("router_actions")) and (a["replicas"] or a["held"])
    ]
    if acts:
        lines += [
            "",
            "Router actions (one-token replicas of hot prefixes; requests held until their "
            "prefix's first request had its first token): " + "; ".join(acts) + ".",
        ]
    comp = report.get("comparisons") or comparisons(report)
    keys = sorted({k for row in comp.values() for k in row})
    if keys:
        lines += ["", "Ratios (TTFT: this run ÷ baseline; hit rate: this run − baseline):", ""]
        lines.append("| run | " + " | ".join(keys) + " |")
        lines.append("|---|" + "---:|" * len(keys))
        for label, row in comp.items():
            cells = []
            for k in keys:
                v = row.get(k)
                cells.append("–" if v is None else (f"{v:+.3f}" if "minus" in k else f"{v:.3f}"))
            lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# Fixed colours: the same policy has the same colour in every plot, and none is grey (grey
# reads as "disabled"); kvgate's own policy gets the strongest one.
POLICY_COLORS = {
    "kv_aware": "#d62728",  # red
    "round_robin": "#1f77b4",
    "random": "#17becf",
    "least_request": "#2ca02c",
    "power_of_two": "#bcbd22",
    "prefix": "#ff7f0e",
    "kv_load": "#9467bd",
    "gpu_aware": "#8c564b",
    "sglang-router": "#e377c2",
    "vllm-router": "#393b79",
    # black: kvgate's default (latency-model) policy, told apart from kv_aware's red at a glance
    "slo_aware": "#000000",
    "sglang_cache_aware": "#f7b6d2",
    "dynamo_kv": "#6b6ecf",
    "llmd_default": "#74c476",
    "llmd_kv_util": "#005a32",
}
_SPARE_COLORS = ("#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")


def run_colors(labels: list[str]) -> dict[str, str]:
    """A colour per run label: its policy's (label up to ':' or '['), else a spare one."""
    out: dict[str, str] = {}
    spare = 0
    for label in labels:
        base = label.split(":", 1)[0].split("[", 1)[0].strip()
        color = POLICY_COLORS.get(base)
        if color is None or color in out.values():
            color = _SPARE_COLORS[spare % len(_SPARE_COLORS)]
            spare += 1
        out[label] = color
    return out


# line styles cycled over the runs, widest first: two runs with identical curves (common in
# the simulator) stay both visible, the later one drawn thinner and dashed over the earlier
_LINESTYLES = ("-", "--", "-.", ":")


def run_styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """Per run label: a line style and width, so that no curve can hide another one."""
    n = max(1, len(labels))
    return {
        label: {"ls": _LINESTYLES[i % len(_LINESTYLES)], "lw": 2.8 - 1.6 * i / n}
        for i, label in enumerate(labels)
    }


def _log_ticks(lo: float, hi: float) -> list[float]:
    """At least 3 round tick values in [lo, hi] on a log axis: 1-2-5 per decade, else 1..9
    per decade, else 4 values evenly spaced in log, rounded to the fewest significant digits
    that keep them apart (a narrow range, e.g. ITLs all within 10-13 ms, had one tick)."""
    import math

    if not (lo > 0 and hi > lo):
        return []
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    for subs in ((1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0**k for k in decades for m in subs]
        inside = sorted({float(f"{t:.6g}") for t in ticks if lo <= t <= hi})
        if len(inside) >= 3:
            return inside
    step = (math.log10(hi) - math.log10(lo)) / 5
    raw = [10 ** (math.log10(lo) + step * i) for i in range(1, 5)]
    for digits in (2, 3, 4):  # the fewest digits that keep the ticks apart
        ticks = sorted({float(f"{t:.{digits}g}") for t in raw})
        if len(ticks) >= 3:
            return ticks
    return raw


def _ms(x: float, _pos: Any = None) -> str:
    """Tick label in milliseconds without scientific notation (0.5, 2, 50, 1000, 20k)."""
    if x >= 10_000:
        return f"{x / 1000:g}k"
    return f"{x:g}"


def _cdf_axis(
    ax: Any, what: str, series: list[tuple[str, list[float], list[float]]], colors
) -> None:
    """One CDF panel on a log millisecond axis: ``series`` = (label, xs in ms, fractions)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    styles = run_styles([label for label, _, _ in series])
    lo = hi = None
    for label, xs, ys in series:
        if xs:
            ax.step(xs, ys, where="post", label=label, color=colors[label], **styles[label])
            positive = [x for x in xs if x > 0]
            if positive:
                lo = min(positive) if lo is None else min(lo, min(positive))
                hi = max(positive) if hi is None else max(hi, max(positive))
    ax.set_xlabel(f"{what} (ms, log scale)")
    ax.set_ylabel("fraction")
    ax.set_xscale("log")
    if lo is not None and hi is not None:
        left, right = max(lo * 0.8, 1e-3), max(hi * 1.25, lo * 1.5)
        ax.set_xlim(left, right)
        # round ticks in plain milliseconds, at least 3 of them whatever the range
        ax.xaxis.set_major_locator(FixedLocator(_log_ticks(left, right)))
        ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(_ms))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="major", alpha=0.3)


def _legend_outside(fig: Any, ax: Any) -> None:
    """One legend for the figure, right of the plots: never over a curve or a label."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _ttft_series(run: dict[str, Any]) -> tuple[str, list[float], list[float]]:
    xs = [x * 1000 for x in (run["summary"].get("ttft_sorted") or [])]
    return run["label"], xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _itl_series(run: dict[str, Any]) -> tuple[str, list[float], list[float]]:
    from bench.metrics import histogram_cdf

    xs, ys = histogram_cdf(run["summary"].get("itl_hist") or {})
    return run["label"], [x * 1000 for x in xs], ys


def ttft_cdf_figure(report: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    colors = run_colors([r["label"] for r in runs])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _cdf_axis(ax, "TTFT", [_ttft_series(r) for r in runs], colors)
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — {report.get('name')}")
    fig.tight_layout()
    _legend_outside(fig, ax)
    return fig


def latency_cdf_figure(report: dict[str, Any]) -> Any:
    """TTFT (per request) and ITL (per streamed token gap, from the bounded ``itl_hist``) CDFs
    per policy, side by side; the ITL panel's y axis starts at 0.9 (the tail is the point)."""
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    colors = run_colors([r["label"] for r in runs])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    _cdf_axis(a1, "TTFT", [_ttft_series(r) for r in runs], colors)
    a1.set_ylabel("fraction of requests")
    a1.set_title("TTFT CDF")
    _cdf_axis(a2, "ITL", [_itl_series(r) for r in runs], colors)
    a2.set_ylabel("fraction of token gaps")
    a2.set_ylim(0.9, 1.0)
    a2.set_title("ITL CDF (tail: 0.9-1)")
    fig.suptitle(str(report.get("name")), fontsize=10)
    fig.tight_layout()
    _legend_outside(fig, a1)
    return fig


def worker_load_figure(report: dict[str, Any]) -> Any:
    """Per-worker in-flight over time, one panel per run, on one shared y scale (comparing
    runs is the point: per-panel scales made a balanced run look as uneven as a skewed one)."""
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    n = len(runs)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False, sharex=True, sharey=True
    )
    for i, run in enumerate(runs):
        ax = axes[i // cols][i % cols]
        ser = run["summary"].get("inflight_series", {})
        width = ser.get("bin_s", 0.0)
        workers = ser.get("workers", {})
        wstyles = run_styles(sorted(workers))  # balanced workers draw identical lines
        for w, ys in sorted(workers.items()):
            st = wstyles[w]
            ax.plot(
                [(j + 0.5) * width for j in range(len(ys))],
                ys,
                ls=st["ls"],
                lw=0.6 * st["lw"],
                label=w,
            )
        ax.set_title(run["label"], fontsize=9)
        ax.set_xlabel("time (s)", fontsize=8)
        ax.set_ylabel("in-flight", fontsize=8)
        ax.tick_params(labelsize=7)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"per-worker in-flight requests — {report.get('name')}", fontsize=10)
    fig.tight_layout()
    # the workers are the same in every panel: one legend beside them, not one over each
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles and len(handles) <= 16:
        fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=6)
    return fig


def hit_rate_ylim(values: list[float]) -> tuple[float, float]:
    """The hit-rate axis (percent): from 0 unless every value sits high and close together,
    then from a round value below them, so that a 95.4 vs 96.8 % gap is visible (the axis
    label says where it starts); room above for the bars' labels."""
    if not values:
        return 0.0, 105.0
    lo, hi = min(values), max(values)
    spread = hi - lo
    bottom = 0.0
    if lo >= 20 and spread < 0.5 * lo:
        bottom = max(0.0, 5 * ((lo - max(2.0, spread)) // 5))
    top = hi + max(1.0, 0.12 * (hi - bottom))
    return bottom, top


def hit_rate_figure(report: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    n = len(runs)
    labels = [r["label"] for r in runs]
    colors = run_colors(labels)
    fig, ax = plt.subplots(figsize=(max(5, 1.0 * n + 2), 4))
    vals = [100 * (r["summary"].get("hit_rate") or 0.0) for r in runs]
    bars = ax.bar(labels, vals, color=[colors[lbl] for lbl in labels])
    ax.bar_label(bars, labels=[f"{v:.1f}%" for v in vals], fontsize=8, padding=2)
    bound = _get(report, "workload", "infinite_cache_hit_rate")
    shown = vals + ([100 * bound] if bound is not None else [])
    bottom, top = hit_rate_ylim(shown)
    if bound is not None:
        # named on the line itself (a legend box covered a bar's label)
        ax.axhline(100 * bound, color="black", ls="--", lw=1)
        ax.annotate(
            f"infinite-cache bound {100 * bound:.1f}%",
            (1.0, 100 * bound),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 3),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize=8,
        )
    ylabel = "prefix-cache hit rate (%)"
    ax.set_ylabel(ylabel if bottom == 0 else f"{ylabel}, axis from {bottom:g}%")
    ax.set_ylim(bottom, top)
    ax.set_title(f"hit rate (workers' own counters) — {report.get('name')}")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


def _plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not report.get("runs"):
        return []
    files: list[str] = []
    for name, make in (
        ("ttft_cdf.png", ttft_cdf_figure),
        ("latency_cdf.png", latency_cdf_figure),
        ("worker_load.png", worker_load_figure),
        ("hit_rate.png", hit_rate_figure),
    ):
        fig = make(report)
        # "tight": the legends beside the plots are part of the picture
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(name)
    return files


def new_report(name: str, kind: str, config: dict[str, Any], workload: dict[str, Any]) -> dict:
    return {
        "name": name,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "workload": workload,
        "runs": [],
    }


def write_report(report: dict[str, Any], out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write results.json, results.md and (unless ``plots`` is False) the PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["comparisons"] = comparisons(report)
    (out / "results.json").write_text(json.dumps(report, indent=1, sort_keys=False))
    (out / "results.md").write_text(markdown(report))
    files = [out / "results.json", out / "results.md"]
    if plots:
        files += [out / f for f in _plots(report, out)]
    return files
