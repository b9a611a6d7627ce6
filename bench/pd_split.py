"""``python -m bench.pd_split``: which P:D split of N engines a workload and an SLO pair want,
from the engine model alone, and (``--exhaustive``) checked against the goodput of every split.

The recommendation (the question Dynamo's planner answers with a profiler, here answered from
the step-time model the simulator and the router's latency model share) balances the two
pools' work per request:

- **prefill**: engine-seconds a prefiller spends on one request, its uncached prompt (as a
  cache that never evicts would leave it, in arrival order) at
  ``prefill_token_s x uncached + prefill_attn_s x uncached x context`` plus its token share of
  a step's overhead (``uncached / max_num_batched_tokens``), divided by ``--max-utilization``
  (a queue run hotter than that misses TTFTs);
- **decode**: engine-seconds a decoder spends on one request at the largest batch whose step
  still meets the TPOT target (``overhead + n x (decode_seq_s + decode_kv_token_s x mean
  context) <= tpot``, capped by ``max_num_seqs`` and the KV cache): ``output x step(n) / n``.

The fleet carries the most when both pools saturate together, ``P / N = prefill / (prefill +
decode)``; the recommended P is the integer next to it whose pools carry more. P = 0 (the
decoders prefill too: a colocated fleet, which ``pd_slo`` becomes with no prefill engine) is a
candidate when a decode step carrying one prefill chunk of the mean uncached prompt still meets
the TPOT target, and wins when the whole fleet time-shared carries more.

``--exhaustive`` runs :mod:`bench.goodput`'s bisection for ``--policy`` (default ``pd_slo``) on
every split P = 0 .. N-1 (``--splits`` to pick some) and prints each split's goodput, the best,
and the recommended split's goodput as a share of the best (the target: >= 90 %)::

    python -m bench.pd_split -n 8                                   # recommendation only: 1 s
    python -m bench.pd_split -n 8 --exhaustive --seeds 0,1          # + 8 splits x 2 seeds
    python -m bench.pd_split -w mooncake --trace ../shared/traces/synthetic_trace.jsonl \\
        -p max_requests=800 -e max_model_len=200000 -n 8 --exhaustive
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_RESULTS
from bench.goodput import (
    CONVERSATION,
    CONVERSATION_ENGINE,
    QUICK,
    run_searches,
)
from bench.latency_bound import _number
from bench.simcore import make_engine_config, request_keys
from bench.workloads import WORKLOADS, build_workload, parse_params
from services.core.engine import EngineConfig
from services.core.engine_profiles import ENGINE_PROFILES


@dataclass(frozen=True, slots=True)
class Demand:
    """Per request, on average: engine-seconds of prefill on a prefiller, of decode on a
    decoder at the TPOT target's batch, and what they came from."""

    prefill_s: float
    decode_s: float
    uncached_tokens: float
    output_tokens: float
    context_tokens: float
    decode_batch: int  # the largest batch whose step meets the TPOT target
    # a decode step that carries one prefill chunk of the mean uncached prompt (a colocated
    # engine's step): within the TPOT target, prefill and decode can share engines
    mixed_step_s: float = 0.0
    tpot_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    decode: int
    share: float  # the ideal prefill share of the fleet, prefill / (prefill + decode)


def demand(requests, keys, cfg: EngineConfig, tpot_s: float, max_util: float) -> Demand:
    """The workload's mean work per request on each pool (see the module docstring)."""
    bs = cfg.block_size
    seen: set[int] = set()
    pre = unc_sum = out_sum = ctx_sum = 0.0
    for r, k in zip(requests, keys, strict=True):
        usable = max(0, (r.prompt_tokens - 1) // bs)
        hit = 0
        for key in k[:usable]:
            if key not in seen:
                break
            hit += 1
        seen.update(k)
        unc = r.prompt_tokens - hit * bs
        # the step overhead is shared by the prompts batched in a step: its token share
        pre += (
            cfg.step_overhead_s * unc / cfg.max_num_batched_tokens
            + cfg.prefill_token_s * unc
            + cfg.prefill_attn_s * unc * (r.prompt_tokens - unc / 2.0)
        )
        unc_sum += unc
        out_sum += r.max_tokens
        ctx_sum += r.prompt_tokens + r.max_tokens / 2.0
    n = max(1, len(requests))
    out, ctx = out_sum / n, ctx_sum / n
    per_seq = cfg.decode_seq_s + cfg.decode_kv_token_s * ctx
    batch = int((tpot_s - cfg.step_overhead_s) / per_seq) if tpot_s > cfg.step_overhead_s else 1
    kv_cap = int(cfg.kv_capacity_tokens // max(1.0, ctx + out / 2.0))
    batch = max(1, min(batch, cfg.max_num_seqs, kv_cap))
    step = cfg.step_overhead_s + batch * per_seq
    chunk = min(unc_sum / n, cfg.max_num_batched_tokens)
    mixed = step + cfg.prefill_token_s * chunk + cfg.prefill_attn_s * chunk * (ctx - chunk / 2)
    return Demand(
        prefill_s=pre / n / max_util,
        decode_s=out * step / batch,
        uncached_tokens=unc_sum / n,
        output_tokens=out,
        context_tokens=ctx,
        decode_batch=batch,
        mixed_step_s=mixed,
        tpot_s=tpot_s,
    )


def carried(d: Demand, engines: int, prefill: int) -> float:
    """Requests/s a P:D split carries by the two pools' work (P = 0: every engine both
    prefills and decodes, time-shared)."""
    if prefill <= 0:
        return engines / (d.prefill_s + d.decode_s)
    return min(prefill / d.prefill_s, (engines - prefill) / d.decode_s)


def recommend(d: Demand, engines: int) -> Split:
    """The split whose pools carry the most (ties: fewer prefillers). No prefillers (P = 0:
    the decoders prefill too, like a colocated fleet) is a candidate only while a decode step
    carrying a prefill chunk still meets the TPOT target: past it, sharing engines costs the
    decoding requests their TPOT, which the pools' work alone does not show."""
    share = d.prefill_s / (d.prefill_s + d.decode_s)
    ideal = share * engines
    lo = max(1, min(engines - 1, math.floor(ideal)))
    cands = {lo, min(engines - 1, lo + 1)}
    if d.mixed_step_s <= d.tpot_s:
        cands.add(0)
    best = max(sorted(cands), key=lambda p: (carried(d, engines, p), -p))
    return Split(best, engines - best, share)


def write_plot(path: Path, rows: list[dict], rec: Split, d: Demand, a) -> None:
    """Goodput of every split (bars), the model's carried rate (line), the recommendation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["prefill"] for r in rows]
    ax.bar(
        xs,
        [r["goodput_req_s"] for r in rows],
        color=["tab:orange" if x == rec.prefill else "tab:blue" for x in xs],
        label=f"{a.policy} goodput (orange: recommended)",
    )
    ax.plot(xs, [carried(d, a.workers, x) for x in xs], "k--", marker="o", label="model")
    ax.set_xticks(xs, [f"{x}P{a.workers - x}D" for x in xs])
    ax.set_ylabel("requests/s")
    ax.set_title(f"P:D split of {a.workers} engines: {a.workload}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the command
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.pd_split",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workload", "-w", default="multi-turn", choices=sorted(WORKLOADS))
    ap.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trace", default="", help="trace file (= -p path=...)")
    ap.add_argument("--workers", "-n", type=int, default=8, help="engines to split (default 8)")
    ap.add_argument("--profile", choices=sorted(ENGINE_PROFILES), default="prefill-bound")
    ap.add_argument("--engine", "-e", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--ttft", type=float, default=6.25, help="TTFT SLO, seconds (6.25)")
    ap.add_argument("--tpot", type=float, default=0.050, help="TPOT SLO, seconds (0.050)")
    ap.add_argument(
        "--max-utilization",
        type=float,
        default=0.9,
        help="the busiest a prefiller may run and still meet TTFTs (default 0.9)",
    )
    ap.add_argument("--exhaustive", action="store_true", help="goodput of every split too")
    ap.add_argument("--splits", default="", help="with --exhaustive: only these P values (2,3,4)")
    ap.add_argument("--policy", default="pd_slo", help="P/D policy of the sweep (pd_slo)")
    ap.add_argument("--seeds", default="0", help="workload seeds of the sweep (default 0)")
    ap.add_argument("--min-rate", type=float, default=0.5)
    ap.add_argument("--max-rate", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=4, help="bisection steps (default 4)")
    ap.add_argument("--quick", action="store_true", help="80 conversations (multi-turn)")
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--name", default="")
    ap.add_argument("--out-dir", default=str(DEFAULT_RESULTS))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true", help="skip split_goodput.png")
    return ap


def _conf(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    params: dict[str, Any] = parse_params(a.param)
    engine = dict(ENGINE_PROFILES[a.profile])
    if a.workload == "multi-turn":
        params = {**CONVERSATION, **(QUICK if a.quick else {}), **params}
        engine.update(CONVERSATION_ENGINE)
    engine.update({k: _number(v) for k, v in parse_params(a.engine).items()})
    if a.trace:
        params["path"] = a.trace
    return params, engine


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.workers < 2:
            raise ValueError("--workers must be >= 2 (a prefiller and a decoder)")
        if not 0 < a.max_utilization <= 1:
            raise ValueError("--max-utilization must be in (0, 1]")
        params, engine = _conf(a)
        cfg = make_engine_config(engine)
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        wl = build_workload(a.workload, {**params, "seed": seeds[0]})
    except (ValueError, OSError) as exc:
        print(f"bench.pd_split: {exc}", file=sys.stderr)
        return 2
    keys = request_keys(wl.requests, cfg.block_size, cfg.hash_seed)
    d = demand(wl.requests, keys, cfg, a.tpot, a.max_utilization)
    rec = recommend(d, a.workers)
    print(
        f"per request: prefill {1000 * d.prefill_s:.1f} ms of a prefiller "
        f"({d.uncached_tokens:.0f} uncached tokens, at <= {100 * a.max_utilization:g} % busy), "
        f"decode {1000 * d.decode_s:.1f} ms of a decoder ({d.output_tokens:.0f} tokens at a "
        f"batch of {d.decode_batch}, context {d.context_tokens:.0f}); prefill share "
        f"{100 * rec.share:.1f} %\nrecommended split for {a.workers} engines: "
        f"{rec.prefill}P{rec.decode}D"
    )
    doc: dict[str, Any] = {
        "workload": a.workload,
        "params": params,
        "engine": engine,
        "workers": a.workers,
        "slo": {"ttft_s": a.ttft, "tpot_s": a.tpot},
        "demand": asdict(d),
        "recommended": asdict(rec),
    }
    if a.exhaustive:
        splits = (
            [int(x) for x in a.splits.split(",") if x.strip()]
            if a.splits
            else list(range(a.workers))
        )
        conf = {
            "workload": a.workload,
            "params": params,
            "engine": engine,
            "workers": a.workers,
            "seeds": seeds,
            "steps": a.steps,
            "ttft_s": a.ttft,
            "tpot_s": a.tpot,
            "target": 0.9,
            "min_rate": a.min_rate,
            "max_rate": a.max_rate,
            "queue_timeout_s": 30.0,
            "request_timeout_s": 600.0,
            "progress": not a.no_progress,
        }
        t0 = time.perf_counter()
        rows = []
        for p in splits:
            c = {**conf, "pd": [p, a.workers - p], "policies": [(f"{p}P", {"name": a.policy})]}
            res = run_searches(c, max(1, a.jobs))
            g = statistics.median(r["goodput_req_s"] or 0.0 for r in res)
            rows.append({"prefill": p, "decode": a.workers - p, "goodput_req_s": g})
        best = max(rows, key=lambda r: r["goodput_req_s"])
        got = next((r for r in rows if r["prefill"] == rec.prefill), None)
        share = (
            got["goodput_req_s"] / best["goodput_req_s"] if got and best["goodput_req_s"] else None
        )
        print(f"\n| split | model's carried req/s | {a.policy} goodput req/s (median) |")
        print("|---|---:|---:|")
        for r in rows:
            mark = " (recommended)" if r["prefill"] == rec.prefill else ""
            mark += " (best)" if r is best else ""
            print(
                f"| {r['prefill']}P{r['decode']}D{mark} | "
                f"{carried(d, a.workers, r['prefill']):.2f} | {r['goodput_req_s']:.3f} |"
            )
        if share is not None:
            verdict = "within" if share >= 0.9 else "NOT within"
            print(
                f"\nrecommended {rec.prefill}P{rec.decode}D: {100 * share:.1f} % of the best "
                f"split's goodput ({best['prefill']}P{best['decode']}D), {verdict} 10 %; "
                f"{time.perf_counter() - t0:.0f} s wall"
            )
        doc["sweep"] = {"rows": rows, "best": best, "recommended_share_of_best": share}
        if not a.no_plots:
            out_png = Path(a.out_dir) / (a.name or f"pd-split-{a.workload}-{a.workers}")
            write_plot(out_png / "split_goodput.png", rows, rec, d, a)
    name = a.name or f"pd-split-{a.workload}-{a.workers}"
    out = Path(a.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd_split.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"results in {out}/pd_split.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
