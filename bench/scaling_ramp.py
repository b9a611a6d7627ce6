"""``python -m bench.scaling_ramp``: does the scaling signal rise before SLO attainment falls?

A fixed fleet of ``--workers`` simulated engines (:func:`bench.simcore.simulate`, the router's
own policy code) takes an arrival rate that rises linearly from ``--start-rate`` to
``--end-rate`` requests/s over ``--duration`` virtual seconds (a non-homogeneous Poisson
process, requests drawn from ``--workload``). Every ``--sample`` seconds it computes what the
router exports as ``kvgate_fleet_engines_needed`` (:mod:`services.core.scaling`: the same
:class:`~services.core.scaling.DemandWindow` fed the arrivals and the answered requests' tokens
as the router feeds it, the router's queue at that moment, the engine model's step
coefficients and the SLO targets) and the SLO attainment of the requests that arrived in the
last ``--sample`` seconds (TTFT <= ``--ttft`` and TPOT <= ``--tpot``; refused or unfinished
requests are misses).

Printed per seed: when the signal first exceeds the fleet (``engines needed > --workers``),
when attainment first falls below ``--attain`` (and stays below for ``--sample`` x 3), and the
lead between them; written: ``scaling_ramp.json`` (every sample) and a plot (``--plot``,
default ``docs/img/scaling-ramp.png`` for the first seed)::

    python -m bench.scaling_ramp                       # ~1 min on 2 busy cores
    python -m bench.scaling_ramp --seeds 0,1,2 --workers 4 --end-rate 60
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_RESULTS
from bench.metrics import OK, tpot_s
from bench.simcore import SimOptions, make_engine_config, simulate
from bench.workloads import build_workload
from services.core.latency import StepCoefficients
from services.core.scaling import DemandWindow, engines_needed

ROOT = Path(__file__).resolve().parents[1]


def ramp_arrivals(rng: random.Random, r0: float, r1: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process whose rate rises linearly from ``r0`` to ``r1``
    per second over ``duration`` seconds (thinning of a process at ``max(r0, r1)``)."""
    top = max(r0, r1)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration:
            return out
        if rng.random() * top <= r0 + (r1 - r0) * t / duration:
            out.append(t)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.scaling_ramp",
        description=__doc__.split("\n\n")[0] if __doc__ else "",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workers", "-n", type=int, default=4, help="engines (default: 4)")
    ap.add_argument("--policy", default="slo_aware", help="routing policy (default: slo_aware)")
    ap.add_argument(
        "--workload",
        "-w",
        default="generated-shared-prefix",
        help="requests drawn from this workload (default: generated-shared-prefix)",
    )
    ap.add_argument("--start-rate", type=float, default=4.0, help="requests/s at 0 (default: 4)")
    ap.add_argument(
        "--end-rate", type=float, default=100.0, help="requests/s at the end (default: 100)"
    )
    ap.add_argument(
        "--duration", type=float, default=180.0, help="virtual seconds of ramp (default: 180)"
    )
    ap.add_argument("--sample", type=float, default=2.0, help="seconds per sample (default: 2)")
    ap.add_argument("--window", type=float, default=10.0, help="DemandWindow seconds (default: 10)")
    ap.add_argument("--ttft", type=float, default=2.0, help="TTFT target, s (default: 2)")
    ap.add_argument("--tpot", type=float, default=0.05, help="TPOT target, s (default: 0.05)")
    ap.add_argument(
        "--margin",
        type=float,
        default=0.4,
        help="the signal's margin: the mean request predicted within margin x each target "
        "(the router's --scaling-margin; default: 0.4)",
    )
    ap.add_argument("--attain", type=float, default=0.9, help="attainment threshold (default: 0.9)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    ap.add_argument(
        "--plot",
        default=str(ROOT / "docs" / "img" / "scaling-ramp.png"),
        help="PNG of the first seed ('' for none; default: docs/img/scaling-ramp.png)",
    )
    ap.add_argument("--out-dir", default=str(DEFAULT_RESULTS), help="results directory")
    return ap


def run_seed(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One ramp: the samples (t, engines needed, attainment, rate, queued) and the events."""
    rng = random.Random(seed)
    times = ramp_arrivals(rng, a.start_rate, a.end_rate, a.duration)
    base = build_workload(a.workload, {"seed": seed})
    pool = base.requests
    if len(pool) < len(times):  # draw again with more prompts
        scale = math.ceil(len(times) / len(pool))
        base = build_workload(a.workload, {"seed": seed, "prompts_per_group": 16 * scale})
        pool = base.requests
    picks = rng.sample(range(len(pool)), len(times))
    reqs = [
        replace(pool[j], request_id=f"ramp-{i}", arrival_s=t)
        for i, (j, t) in enumerate(zip(picks, times, strict=True))
    ]
    opts = SimOptions(num_workers=a.workers)
    t0 = time.perf_counter()
    run = simulate(reqs, {"name": a.policy, "params": {}}, opts)
    wall = time.perf_counter() - t0
    coef = StepCoefficients.from_engine(make_engine_config({}))
    res = sorted(run.results, key=lambda r: r.send_s)
    # events the router sees, in time order: arrivals, and answers (with their tokens)
    events: list[tuple[float, int, Any]] = [(r.send_s, 0, r) for r in res]
    events += [(r.dispatch_s, 2, r) for r in res if r.dispatch_s is not None and r.worker]
    events += [(r.end_s, 1, r) for r in res if r.status == OK]
    events.sort(key=lambda e: (e[0], e[1]))
    # the router's queue: arrived, not yet dispatched (or never)
    waits = [(r.send_s, r.dispatch_s if r.dispatch_s is not None else r.end_s) for r in res]
    window = DemandWindow(a.window)
    samples: list[dict[str, Any]] = []
    sends = [r.send_s for r in res]
    k = 0
    t = a.sample
    while t <= a.duration + 1e-9:
        while k < len(events) and events[k][0] <= t:
            when, kind, r = events[k]
            if kind == 0:
                window.arrived(when)
            elif kind == 2:
                window.sent(when, r.worker)
            else:
                window.answered(when, r.prompt_tokens, r.prompt_tokens - r.cached_tokens,
                                r.completion_tokens)  # fmt: skip
            k += 1
        queued = sum(1 for s, e in waits if s <= t < e)
        demand = window.demand(t, queued, a.workers)
        need = engines_needed(demand, coef, a.ttft, a.tpot, a.margin)
        lo, hi = bisect.bisect_left(sends, t - a.sample), bisect.bisect_left(sends, t)
        arrived = res[lo:hi]
        met = sum(
            1
            for r in arrived
            if r.status == OK
            and r.ttft_s is not None
            and r.ttft_s <= a.ttft
            and tpot_s(r) <= a.tpot
        )
        samples.append(
            {
                "t": round(t, 3),
                "engines_needed": need.engines,
                "attainment": met / len(arrived) if arrived else None,
                "rate": window.demand(t).rate,
                "offered_rate": a.start_rate + (a.end_rate - a.start_rate) * t / a.duration,
                "queued": queued,
                "imbalance": demand.imbalance,
                "reachable": need.reachable,
            }
        )
        t += a.sample
    signal_t = next((s["t"] for s in samples if s["engines_needed"] > a.workers), None)
    fall_t = None
    for i, s in enumerate(samples):
        later = [x["attainment"] for x in samples[i : i + 3] if x["attainment"] is not None]
        if later and all(v < a.attain for v in later):
            fall_t = s["t"]
            break

    def offered(t: float | None) -> float | None:
        return None if t is None else a.start_rate + (a.end_rate - a.start_rate) * t / a.duration

    return {
        "seed": seed,
        "requests": len(reqs),
        "sim_wall_s": round(wall, 2),
        "signal_exceeds_fleet_s": signal_t,
        "attainment_falls_s": fall_t,
        "lead_s": (fall_t - signal_t) if fall_t is not None and signal_t is not None else None,
        "signal_rate": offered(signal_t),  # offered requests/s at those moments
        "fall_rate": offered(fall_t),
        "samples": samples,
    }


def plot(path: Path, a: argparse.Namespace, r: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t"] for s in r["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(ts, [s["engines_needed"] for s in r["samples"]], color="#d62728",
             label="kvgate_fleet_engines_needed")  # fmt: skip
    top.axhline(a.workers, color="#1f77b4", linestyle="--", label=f"fleet: {a.workers} engines")
    top.set_ylabel("engines")
    top.set_ylim(0, 3 * a.workers)  # past the collapse the queue term soars
    rate = top.twinx()
    rate.plot(ts, [s["offered_rate"] for s in r["samples"]], color="#7f7f7f", linewidth=0.8)
    rate.set_ylabel("offered requests/s", color="#7f7f7f")
    att = [(s["t"], 100 * s["attainment"]) for s in r["samples"] if s["attainment"] is not None]
    bottom.plot([x for x, _ in att], [y for _, y in att], color="#2ca02c",
                label=f"SLO attainment (TTFT <= {a.ttft:g} s, TPOT <= {1000 * a.tpot:g} ms)")  # fmt: skip
    bottom.axhline(100 * a.attain, color="#7f7f7f", linestyle=":", label=f"{100 * a.attain:g} %")
    bottom.set_ylabel("attainment, % of requests arrived")
    bottom.set_xlabel("virtual seconds into the ramp")
    bottom.legend(loc="lower left", frameon=False)
    for ax in (top, bottom):
        if r["signal_exceeds_fleet_s"] is not None:
            ax.axvline(r["signal_exceeds_fleet_s"], color="#d62728", linewidth=0.8, alpha=0.6,
                       label="signal > fleet" if ax is top else None)  # fmt: skip
        if r["attainment_falls_s"] is not None:
            ax.axvline(r["attainment_falls_s"], color="#2ca02c", linewidth=0.8, alpha=0.6,
                       label=f"attainment < {100 * a.attain:g} %" if ax is top else None)  # fmt: skip
        ax.grid(alpha=0.3)
    top.legend(loc="upper left", frameon=False)
    lead = r["lead_s"]
    fig.suptitle(
        f"{a.policy} on {a.workers} engines, {a.start_rate:g} -> {a.end_rate:g} req/s over "
        f"{a.duration:g} s (seed {r['seed']})"
        + (f": signal {lead:.0f} s before attainment fell" if lead is not None else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        if a.workers < 1 or a.duration <= 0 or a.sample <= 0 or min(a.start_rate, a.end_rate) < 0:
            raise ValueError("--workers, --duration, --sample must be > 0, rates >= 0")
        if not seeds:
            raise ValueError("--seeds names no seed")
    except ValueError as exc:
        print(f"scaling_ramp: {exc}", file=sys.stderr)
        return 2
    runs = [run_seed(a, s) for s in seeds]
    print(f"{a.policy} on {a.workers} engines, {a.start_rate:g} -> {a.end_rate:g} requests/s "
          f"over {a.duration:g} s; SLO TTFT <= {a.ttft:g} s, TPOT <= {1000 * a.tpot:g} ms, "
          f"attainment threshold {100 * a.attain:g} %")  # fmt: skip
    print("seed  requests  signal > fleet at    attainment falls at  lead")
    for r in runs:

        def fmt(x: float | None, rate: float | None = None) -> str:
            if x is None:
                return "never"
            return f"{x:.0f} s" + (f" ({rate:.0f} req/s)" if rate is not None else "")

        print(f"{r['seed']:>4}  {r['requests']:>8}  "
              f"{fmt(r['signal_exceeds_fleet_s'], r['signal_rate']):>19}  "
              f"{fmt(r['attainment_falls_s'], r['fall_rate']):>19}  {fmt(r['lead_s']):>5}")  # fmt: skip
    out = Path(a.out_dir) / "scaling-ramp"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling_ramp.json").write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    if a.plot:
        plot(Path(a.plot), a, runs[0])
        print(f"plot: {a.plot}")
    print(f"results: {out / 'scaling_ramp.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
