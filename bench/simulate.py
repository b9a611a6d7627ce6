"""``kvgate simulate``: the cluster simulator on a virtual clock.

Drives N simulated engine cores (the sim worker's pure engine model) with the router's own
policy code and a PrefixIndex fed by the engines' KV events (see :mod:`bench.simcore`), for
every chosen policy, on the same workloads as ``kvgate bench``, and writes the same report
(results JSON, Markdown table, PNG plots) under ``bench/results/<name>/``.

Policies run in parallel worker processes (``--jobs``); the workload and its block keys are
built once, before forking.

``--pd P:D``: a disaggregated fleet of P prefill and D decode engines for the P/D policies
(``pd_slo``, ``pd_dynamo``, ...), while the colocated policies in the same run get P + D
colocated engines: colocated and P/D fleets of the same engine count, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from bench.common import (
    add_output_arguments,
    add_policy_arguments,
    add_workload_arguments,
    list_workloads,
    parse_policies,
    results_dir,
    workload_from_args,
)
from bench.metrics import summarize
from bench.report import markdown, new_report, terminal_table, write_report
from bench.simcore import (
    SimOptions,
    for_policy,
    make_engine_config,
    parse_split,
    request_keys,
    simulate,
)
from bench.workloads import infinite_cache_hit_rate, parse_params
from services.core.engine_profiles import ENGINE_PROFILES

# what forked run processes read (set before the pool starts)
_SHARED: dict[str, Any] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument(
        "--workers", "-n", type=int, default=8, help="simulated engines, 1..4096 (default: 8)"
    )
    parser.add_argument(
        "--pd",
        default="",
        metavar="P:D",
        help="disaggregated fleet for the P/D policies: P prefill + D decode engines (the "
        "colocated policies then get P + D colocated engines; --workers is ignored)",
    )
    parser.add_argument(
        "--link",
        default="rdma",
        choices=["nvlink", "rdma"],
        help="KV transfer link between prefill and decode engines (default rdma)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="print the full results table (every column; results.md always has it)",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(ENGINE_PROFILES),
        default="default",
        help="engine profile, under the -e settings (default: EngineConfig's own; "
        "h200-llama-3-8b: fitted to a forward pass measured on an H200, docs/worker-sim.md)",
    )
    parser.add_argument(
        "--engine",
        "-e",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EngineConfig setting, repeatable (e.g. -e num_gpu_blocks=8192 -e block_size=16)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="like sim-worker --speedup: engine steps take duration / speedup (compare with "
        "kvgate bench runs that use the same --speedup)",
    )
    parser.add_argument(
        "--telemetry-interval",
        type=float,
        default=0.1,
        help="virtual seconds between samples of engine load seen by the policy (default 0.1)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="router queue: seconds a request may wait for capacity before 429 (default 30)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="client timeout: completions later than this count as timeouts (default 600)",
    )
    parser.add_argument(
        "--max-virtual-s",
        type=float,
        default=0.0,
        help="stop the virtual clock here (0: run until every request finished)",
    )
    parser.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="policies simulated in parallel processes (default: min(2, cores))",
    )
    add_output_arguments(parser, "simulate")


def _run_one(label: str, spec: dict[str, Any], progress=None) -> dict[str, Any]:
    wl, opts, keys = _SHARED["workload"], _SHARED["opts"], _SHARED["keys"]
    opts = for_policy(opts, spec)
    t0 = time.perf_counter()
    run = simulate(wl.requests, spec, opts, keys=keys, progress=progress)
    wall = time.perf_counter() - t0
    summary = summarize(run.results, run.workers, run.cache, duration_s=run.duration_s)
    if opts.prefill_workers or opts.decode_workers:
        summary["pd"] = {
            "fleet": f"{opts.prefill_workers}P{opts.decode_workers}D",
            "transfers": run.transfers,
            "local_prefills": run.local_prefills,
            "mean_transfer_ms": 1000 * run.transfer_s / run.transfers if run.transfers else 0.0,
        }
    return {
        "label": label,
        "router": "kvgate",
        "policy": spec,
        "summary": summary,
        "router_actions": {"replicas": run.replicas, "held": run.held},
        "sim": {
            "wall_s": wall,
            "virtual_s": run.duration_s,
            "steps": run.steps,
            "decisions": run.decisions,
            "speed": run.duration_s / wall if wall > 0 else None,
        },
    }


def _run_one_forked(label: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _run_one(label, spec)


def run_simulation(
    workload,
    policies: list[tuple[str, dict[str, Any]]],
    opts: SimOptions,
    jobs: int = 1,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], float]:
    """Simulate every policy; returns (runs in the given order, infinite-cache bound)."""
    cfg = make_engine_config(opts.engine)
    keys = request_keys(workload.requests, cfg.block_size, getattr(cfg, "hash_seed", 0))
    bound = infinite_cache_hit_rate(workload.requests, cfg.block_size, keys=keys)
    _SHARED.update(workload=workload, opts=opts, keys=keys)
    runs: dict[str, dict[str, Any]] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(workload.requests) * len(policies),
            unit="req",
            desc="simulate",
            file=sys.stderr,
        )
    try:
        if jobs > 1 and len(policies) > 1:
            with ProcessPoolExecutor(
                max_workers=min(jobs, len(policies)), mp_context=get_context("fork")
            ) as pool:
                futs = {pool.submit(_run_one_forked, lbl, spec): lbl for lbl, spec in policies}
                for fut in futs:
                    res = fut.result()
                    runs[res["label"]] = res
                    if bar is not None:
                        bar.update(len(workload.requests))
                        bar.set_postfix_str(res["label"])
        else:
            for lbl, spec in policies:
                runs[lbl] = _run_one(lbl, spec, bar.update if bar is not None else None)
                if bar is not None:
                    bar.set_postfix_str(lbl)
    finally:
        if bar is not None:
            bar.close()
        _SHARED.clear()
    return [runs[lbl] for lbl, _ in policies], bound


def main(args: argparse.Namespace) -> int:
    if args.list_workloads:
        print(list_workloads())
        return 0
    try:
        workload = workload_from_args(args)
        policies = parse_policies(args.policies)
        engine = {
            **ENGINE_PROFILES[args.profile],
            **{k: _num(v) for k, v in parse_params(args.engine).items()},
        }
        if not 1 <= args.workers <= 4096:
            raise ValueError("--workers must be between 1 and 4096")
        pre, dec = parse_split(args.pd) if args.pd else (0, 0)
        if args.pd:
            args.workers = pre + dec
        opts = SimOptions(
            prefill_workers=pre,
            decode_workers=dec,
            link=args.link,
            num_workers=args.workers,
            engine=engine,
            telemetry_interval_s=args.telemetry_interval,
            queue_timeout_s=args.queue_timeout,
            request_timeout_s=args.request_timeout,
            closed_loop_concurrency=args.concurrency,
            max_virtual_s=args.max_virtual_s,
            speedup=args.speedup,
        )
        if args.speedup <= 0:
            raise ValueError("--speedup must be > 0")
        make_engine_config(engine)  # validate before forking
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    if not workload.requests:
        print("kvgate simulate: the workload has no requests", file=sys.stderr)
        return 2
    name, out_dir = results_dir(args, "simulate", workload.name)
    t0 = time.perf_counter()
    runs, bound = run_simulation(
        workload, policies, opts, jobs=max(1, args.jobs), progress=not args.no_progress
    )
    wall = time.perf_counter() - t0
    config = {
        "workers": args.workers,
        "pd": args.pd or None,
        "engine": engine,
        "concurrency": args.concurrency,
        "speedup": args.speedup,
        "telemetry_interval_s": args.telemetry_interval,
        "queue_timeout_s": args.queue_timeout,
        "jobs": args.jobs,
        "wall_s": round(wall, 3),
    }
    wsum = workload.summary()
    wsum["infinite_cache_hit_rate"] = bound
    report = new_report(name, "simulate", config, wsum)
    report["runs"] = runs
    files = write_report(report, out_dir, plots=not args.no_plots)
    print(markdown(report) if args.wide else terminal_table(report))
    print(
        f"simulated {len(runs)} policies x {len(workload.requests)} requests on {args.workers} "
        f"workers in {wall:.1f} s wall; results in {files[0].parent}"
    )
    return 0


def _num(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    try:
        return json.loads(v)
    except ValueError:
        return v
