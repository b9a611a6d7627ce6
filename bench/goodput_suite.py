"""``python -m bench.goodput_suite``: goodput (``bench.goodput``) of the default policy against
the faithful peer rules on every workload of the suite, both engine profiles, 8 and 32 workers,
then one summary table: per configuration the default's median goodput over the seeds, the
best peer's, their ratio and the target (>= 1.25x on workloads with prefix reuse, >= 1.0x on
the Azure trace, which has none).

Each configuration is one ``bench.goodput`` run under ``<out>/<workload>-<profile>-n<workers>``
(skipped when its ``goodput.json`` is there: an interrupted suite resumes; ``--summary`` only
reads them). Workload sizes are small enough for two shared cores (see :data:`WORKLOADS`);
32 workers get 4x the requests at 4x the rate (traces: 4x the requests from the same start,
replayed 4x faster); the bursts (shared prompt, shared prefixes) are searched with the count
scaled with the rate (``--scale-count``). The SLO pair per
profile: TTFT <= 2 s (default engine) or 6.25 s (prefill-bound), TPOT <= 50 ms, >= 90 % of all
requests::

    python -m bench.goodput_suite                                   # everything (long)
    python -m bench.goodput_suite --workloads mt,ta --workers 8 --profiles prefill-bound
    python -m bench.goodput_suite --workloads ssp,gsp --workers 8 --steps 5 --max-rate auto
    python -m bench.goodput_suite --summary                         # the table of what ran
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import goodput
from bench.common import DEFAULT_RESULTS

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
# short name -> (bench.goodput workload, -p parameters at 8 workers per engine profile (the
# base load, multiplier 1, placed so that the knee falls inside 0.5-4 x, or "_rates": the
# multipliers searched), whether the workload
# reuses prefixes). Sizes: ~300-1,200 requests at x1 on 8 workers (two shared cores). The shared prompt and the
# shared prefixes are bursts at these sizes (every request in flight at once): a higher rate
# alone would only shrink the burst's window (every policy meets the SLO with the whole burst
# at once), so their multiplier scales the count with the rate (BURSTS: bench.goodput
# --scale-count), the same window with m x the requests: their goodput is the rate at which
# the fleet still absorbs the burst within the SLO.
WORKLOADS: dict[str, tuple[str, dict[str, dict[str, Any]], bool]] = {
    "ssp": (
        "shared-system-prompt",
        {p: {"num_requests": 1200, "rate": 2400, "warmup_s": 0.1} for p in ("default", "pb")},
        True,
    ),
    "gsp": (
        "generated-shared-prefix",
        {p: {"groups": 64, "prompts_per_group": 16, "rate": 640} for p in ("default", "pb")},
        True,
    ),
    "mt": (
        "multi-turn",
        # the conversations (bench.goodput's defaults: 200 sessions of 8 turns, a start
        # window of 133 s, longer than a conversation's life, so the load reaches its level)
        {"default": {"rate": 4.5}, "pb": {"_rates": (1.5, 3.0)}},
        True,
    ),
    "ta": (
        "tool-agent",
        {"default": {"sessions": 240, "rate": 8.0}, "pb": {"sessions": 120, "rate": 3.0}},
        True,
    ),
    "mc": (
        "mooncake",
        {p: {"max_requests": 300, "start_s": 100, "time_scale": 1.0} for p in ("default", "pb")},
        True,
    ),
    "az": (
        "azure",
        {
            "default": {"max_requests": 300, "start_s": 600, "time_scale": 0.5},
            "pb": {"max_requests": 300, "start_s": 600, "time_scale": 1.0},
        },
        False,
    ),
}
BURSTS = ("ssp", "gsp")  # searched with --scale-count
TRACE_FILES = {"mc": "synthetic_trace.jsonl", "az": "AzureLLMInferenceTrace_code.csv"}
SLO_TTFT = {"default": 2.0, "prefill-bound": 6.25, "h200-llama-3-8b": 2.0}
# Mooncake's long prompts: the 90th percentile (~33 k tokens) alone takes ~2.8 s to prefill on
# the default engine and ~5.7 s on the prefill-bound one, so its TTFT SLO is looser
SLO_TTFT_MC = {"default": 5.0, "prefill-bound": 15.0, "h200-llama-3-8b": 5.0}
# a trace's seed is a window of it (its arrivals and lengths are the trace's own: a seed alone
# would change only the prompt text): window s starts at start_s + WINDOW_S[trace] x s (the
# Azure trace has gaps: its windows are further apart so that they hold different requests)
WINDOW_S = {"mc": 100, "az": 600}
DEFAULT = "kv_aware"  # the router's default policy


def scaled(short: str, profile: str, workers: int) -> dict[str, Any]:
    """The workload's parameters at ``workers``: k = workers / 8 x the requests (sessions,
    groups) at k x the rate (traces: k x the requests from the same start, replayed k x
    faster)."""
    _name, params, _reuse = WORKLOADS[short]
    k = workers / 8
    out = dict(params["pb" if profile == "prefill-bound" else "default"])
    if short == "mt":
        out.setdefault("sessions", goodput.CONVERSATION["sessions"])
        out.setdefault("rate", goodput.CONVERSATION["rate"])
    for key in ("num_requests", "max_requests", "sessions", "groups"):
        if key in out:
            out[key] = int(out[key] * k)
    if "rate" in out:
        out["rate"] = out["rate"] * k
    if "time_scale" in out:
        out["time_scale"] = out["time_scale"] / k
    return out


def config_args(
    short: str, profile: str, workers: int, a: argparse.Namespace, seeds: str, window: int = 0
) -> list[str]:
    name, _params, _reuse = WORKLOADS[short]
    argv = ["-w", name, "-n", str(workers), "--profile", profile]
    params = scaled(short, profile, workers)
    lo, hi = params.pop("_rates", (a.min_rate, a.max_rate))
    if "start_s" in params:
        params["start_s"] += WINDOW_S[short] * window
    for k, v in params.items():
        argv += ["-p", f"{k}={v}"]
    if short in TRACE_FILES:
        argv += ["--trace", str(Path(a.traces) / TRACE_FILES[short])]
    if short == "mc":
        argv += ["-e", "max_model_len=200000"]
    if short == "ta":  # the histories grow past the engine's default 8 k context
        argv += ["-e", "max_model_len=32768"]
    ttft = (SLO_TTFT_MC if short == "mc" else SLO_TTFT)[profile]
    argv += ["--ttft", str(ttft), "--tpot", "0.05"]
    argv += ["--min-rate", str(lo), "--max-rate", str(hi)]
    if short in BURSTS:
        argv += ["--scale-count"]
    if str(hi) == "auto":
        argv += ["--auto-max", str(getattr(a, "auto_max", 256.0))]
    argv += ["--steps", str(a.steps), "--seeds", seeds, "--policies", a.policies]
    argv += ["--peers", a.peers, "-j", str(a.jobs), "--no-plots", "--no-progress"]
    return argv


def summary(out: Path, default: str) -> str:
    """The table of every configuration run under ``out``."""
    lines = [
        "| configuration | SLO (TTFT / TPOT) | default req/s (x) | best peer | best peer req/s (x)"
        " | ÷ best peer | target | met |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    groups: dict[str, list[dict]] = {}
    for path in sorted(out.glob("*/goodput.json")):
        # a trace's windows (<config>-w<s>) are its seeds: one configuration
        name = path.parent.name
        base = name.rsplit("-w", 1)[0] if "-w" in name.split("-n")[-1] else name
        groups.setdefault(base, []).append(json.loads(path.read_text()))
    for name, runs in groups.items():
        conf = runs[0]["config"]
        med = _medians(runs)
        short = name.split("-")[0]
        reuse = WORKLOADS.get(short, ("", {}, True))[2]
        peers = [p for p in conf["peers"] if p in med]
        if default not in med or not peers:
            continue
        best = max(peers, key=lambda p: med[p]["req_s"] or 0.0)
        ours, theirs = med[default]["req_s"] or 0.0, med[best]["req_s"] or 0.0
        ratio = ours / theirs if theirs else float("inf")
        target = 1.25 if reuse else 1.0
        lines.append(
            f"| {name} | {conf['ttft_s']:g} s / {conf['tpot_s'] * 1000:g} ms "
            f"| {ours:.2f} (x{med[default]['multiplier']:.2f}) | `{best}` "
            f"| {theirs:.2f} (x{med[best]['multiplier']:.2f}) | {ratio:.2f}x | >= {target:g}x "
            f"| {'yes' if ratio >= target else 'MISSED'} |"
        )
    return "\n".join(lines)


def _medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per policy, the median over every seed's search of the runs (one run, or a trace's
    windows): goodput as offered req/s and as multiplier (below the range: 0)."""
    per: dict[str, list[tuple[float, float]]] = {}
    for d in runs:
        for s in d["searches"]:
            g = s["goodput_req_s"] if s["goodput_multiplier"] else 0.0
            per.setdefault(s["label"], []).append((g or 0.0, s["goodput_multiplier"] or 0.0))
    return {
        k: {
            "req_s": statistics.median(g for g, _ in v),
            "multiplier": statistics.median(m for _, m in v),
        }
        for k, v in per.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.goodput_suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="short names, comma-separated")
    ap.add_argument("--profiles", default="default,prefill-bound", help="engine profiles")
    ap.add_argument("--workers", default="8,32", help="fleet sizes, comma-separated")
    ap.add_argument("--policies", default=f"kv_aware,slo_aware,{goodput.PEERS}")
    ap.add_argument("--peers", default=goodput.PEERS)
    ap.add_argument("--default", default=DEFAULT, help="the policy the summary divides")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--min-rate", type=float, default=0.5)
    ap.add_argument(
        "--max-rate", default="4.0", help="highest multiplier, or 'auto' (see bench.goodput)"
    )
    ap.add_argument("--auto-max", type=float, default=256.0, help="with --max-rate auto")
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--traces", default=str(TRACES), help="folder of the trace files")
    ap.add_argument("--out", default=str(DEFAULT_RESULTS / "goodput-suite"))
    ap.add_argument("--summary", action="store_true", help="only print the table of what ran")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if not a.summary:
        for n in [int(x) for x in a.workers.split(",") if x]:
            for profile in [p for p in a.profiles.split(",") if p]:
                for short in [w for w in a.workloads.split(",") if w]:
                    if short not in WORKLOADS:
                        print(f"unknown workload {short!r}", file=sys.stderr)
                        return 2
                    runs = [(f"{short}-{profile}-n{n}", a.seeds, 0)]
                    if short in TRACE_FILES:  # one run per window, seed 0
                        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
                        runs = [(f"{short}-{profile}-n{n}-w{s}", "0", s) for s in seeds]
                    for name, seeds_arg, window in runs:
                        if (out / name / "goodput.json").exists():
                            continue
                        print(f"== {name}", flush=True)
                        args = config_args(short, profile, n, a, seeds_arg, window)
                        rc = goodput.main([*args, "--name", name, "--out-dir", str(out)])
                        if rc:
                            return rc
    print(summary(out, a.default))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
