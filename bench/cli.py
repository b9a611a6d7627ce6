"""``kvgate bench``: the benchmark lab, real processes and real HTTP.

For every policy to compare it starts fresh simulated workers (empty caches), the kv_indexer
and the kvgate router with that policy, all as child processes on an embedded NATS (one
subject namespace per run); then for each installed external router (sglang-router,
vllm-router, ``--policy cache_aware``) fresh workers again and that router in front of them.
Each run streams the same workload (same seed, same arrival times) through the router's
OpenAI API and measures TTFT / ITL / end-to-end, throughput, errors, the workers' own
prefix-cache hit rate and per-worker load. ``--router-url`` instead measures one running
router. Writes results JSON, a Markdown table and PNG plots under ``bench/results/<name>/``.

This machine has 2 cores: keep runs modest (all workers in one sim-worker process; a few
hundred requests; rates the Python router and clients can carry).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
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
from bench.loadgen import run_load
from bench.metrics import summarize
from bench.report import markdown, new_report, write_report
from bench.scrape import delta, router_actions, router_reuse, scrape_all, scrape_router
from bench.stack import EXTERNAL_ROUTERS, BenchStack, external_available, http_json
from bench.workloads import Workload, infinite_cache_hit_rate
from services.router.stall import OPTIONS as STALL_OPTIONS


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` names each option's default, unless its help already says it or it is empty."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, "", [], False)
            or default is argparse.SUPPRESS
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    add_workload_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("--workers", "-n", type=int, default=8, help="simulated workers")
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="sim-worker --speedup: engine time runs this many times faster than real time",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="workers' KV block size (passed to sim-worker; used for the infinite-cache bound)",
    )
    parser.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra sim-worker argument, repeatable (e.g. --sim-arg=--num-gpu-blocks=2048)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra kvgate router argument, repeatable",
    )
    parser.add_argument(
        "--telemetry-interval",
        type=float,
        default=0.1,
        help="run the telemetry agent at this interval so the router sees engine load "
        "(0: no agent)",
    )
    parser.add_argument(
        "--external",
        default="auto",
        help="external routers to compare: 'auto' (every installed one of "
        f"{', '.join(EXTERNAL_ROUTERS)}), 'none', or a comma-separated list",
    )
    parser.add_argument(
        "--router-url",
        default="",
        help="measure this running router instead of starting processes (no policy sweep)",
    )
    parser.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        help="with --router-url: worker base URLs to read /metrics from (ground-truth hit rate)",
    )
    parser.add_argument("--model", default="", help="model name (default: the router's first)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="per-request client timeout, seconds"
    )
    parser.add_argument(
        "--nats-url", default="", help="use this NATS instead of starting an embedded one"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=90.0, help="seconds to wait for the processes"
    )
    add_output_arguments(parser, "bench")


def stretched_router_args(router_arg: list[str], speedup: float) -> list[str]:
    """The router's arguments for simulated workers at ``speedup``: below 1 their engine steps
    take 1 / speedup times as long as the engine model the router predicts them by, so the
    stall detector's bounds (``--stall-factor`` x the predicted gap, ``--stall-min-s``) are
    stretched by as much, unless given in ``router_arg`` or the environment. Without this, a
    step that computes a long prompt beside the decoders (several seconds at ``--speedup 0.1``)
    reads as a hung worker: its streams are moved and the worker is shunned, until none is left
    to route to."""
    args = list(router_arg)
    if speedup >= 1.0:
        return args
    given = {a.split("=", 1)[0] for a in args}
    for opt in STALL_OPTIONS:
        if opt.cli_flag not in given and opt.env_var not in os.environ:
            args.append(f"{opt.cli_flag}={opt.default / speedup:g}")
    return args


def _externals(spec: str) -> list[str]:
    if spec == "none":
        return []
    if spec == "auto":
        return [k for k in EXTERNAL_ROUTERS if external_available(k)]
    out = []
    for k in (s.strip() for s in spec.split(",")):
        if not k:
            continue
        if k not in EXTERNAL_ROUTERS:
            raise ValueError(f"unknown external router {k!r}; choose from {EXTERNAL_ROUTERS}")
        if not external_available(k):
            raise ValueError(f"{k} is not installed (pip install {k})")
        out.append(k)
    return out


def _model(base: str, given: str) -> str:
    if given:
        return given
    models = http_json(base.rstrip("/") + "/v1/models", 3.0) or {}
    data = models.get("data") if isinstance(models, dict) else None
    if data:
        return str(data[0].get("id"))
    return "sim-llama-8b"


def target_workers(
    worker_urls: dict[str, str], requests: list[dict[str, Any]]
) -> tuple[int | None, str]:
    """How many workers a ``--router-url`` target has, and how that is known: the
    ``--worker-urls`` given, else the distinct workers that served a request (a lower bound:
    an idle worker is not seen), else unknown (None)."""
    if worker_urls:
        return len(worker_urls), "--worker-urls"
    served = {r["worker"] for r in requests if r.get("worker")}
    if served:
        return len(served), "workers that served a request"
    return None, "unknown (no --worker-urls, no worker header in the answers)"


def measure(
    base: str,
    workload: Workload,
    worker_urls: dict[str, str],
    args: argparse.Namespace,
    bar,
) -> dict[str, Any]:
    """One run against ``base``: scrape, stream the workload, scrape again, summarise."""
    model = _model(base, args.model)
    before = asyncio.run(scrape_all(worker_urls)) if worker_urls else {}
    router_before = asyncio.run(scrape_router(base))
    results, duration = asyncio.run(
        run_load(
            base,
            workload.requests,
            model,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            progress=bar.update if bar is not None else None,
        )
    )
    cache = None
    if worker_urls:
        after = asyncio.run(scrape_all(worker_urls))
        cache = delta(before, after)
    summary = summarize(results, list(worker_urls), cache, duration_s=duration)
    router_after = asyncio.run(scrape_router(base))
    actions = router_actions(router_before, router_after)
    if summary.get("reuse") is None:  # a live run: the router's own attribution counters
        summary["reuse"] = router_reuse(router_before, router_after)
    return {
        "summary": summary,
        "requests": [r.to_dict() for r in results],
        "router_actions": actions,
    }


def main(args: argparse.Namespace) -> int:
    if args.list_workloads:
        print(list_workloads())
        return 0
    try:
        workload = workload_from_args(args)
        policies = parse_policies(args.policies)
        externals = [] if args.router_url else _externals(args.external)
    except (ValueError, OSError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2
    if not workload.requests:
        print("kvgate bench: the workload has no requests", file=sys.stderr)
        return 2
    name, out_dir = results_dir(args, "bench", workload.name)
    wsum = workload.summary()
    wsum["infinite_cache_hit_rate"] = infinite_cache_hit_rate(workload.requests, args.block_size)
    sim_args = [f"--speedup={args.speedup}", f"--block-size={args.block_size}", *args.sim_arg]
    config = {
        "workers": args.workers,
        "speedup": args.speedup,
        "block_size": args.block_size,
        "sim_args": args.sim_arg,
        "router_args": args.router_arg,
        "concurrency": args.concurrency,
        "timeout_s": args.timeout,
        "telemetry_interval_s": args.telemetry_interval,
        "router_url": args.router_url,
    }
    report = new_report(name, "bench", config, wsum)
    runs_total = 1 if args.router_url else len(policies) + len(externals)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(workload.requests) * runs_total, unit="req", file=sys.stderr)
    t0 = time.perf_counter()
    stack: BenchStack | None = None
    try:
        if args.router_url:
            urls = {}
            for u in args.worker_urls:
                h = http_json(u.rstrip("/") + "/health") or {}
                urls[str(h.get("worker_id") or u)] = u
            res = measure(args.router_url, workload, urls, args, bar)
            report["runs"].append({"label": "target", "router": args.router_url, **res})
            # --workers sizes the stacks this command starts, not the router measured here
            report["config"]["workers"], report["config"]["workers_from"] = target_workers(
                urls, res["requests"]
            )
        else:
            stack = BenchStack(
                workdir=Path(out_dir),
                num_workers=args.workers,
                sim_args=sim_args,
                router_args=stretched_router_args(args.router_arg, args.speedup),
                nats_url=args.nats_url,
                ready_timeout=args.ready_timeout,
                telemetry_interval=args.telemetry_interval,
            )
            stack.start()
            plan: list[tuple[str, str, dict[str, Any]]] = [
                (label, "kvgate", spec) for label, spec in policies
            ] + [(k, k, {}) for k in externals]
            for label, router, spec in plan:
                if bar is not None:
                    bar.set_description(label)
                prefix, workers = stack.start_workers(label)
                try:
                    if router == "kvgate":
                        base = stack.start_kvgate(label, prefix, spec)
                    else:
                        base = stack.start_external(label, prefix, router, workers)
                    res = measure(base, workload, workers.by_id, args, bar)
                finally:
                    stack.stop_run()
                entry = {"label": label, "router": router, **res}
                if spec:
                    entry["policy"] = spec
                report["runs"].append(entry)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvgate bench: interrupted; writing what was measured", file=sys.stderr)
    finally:
        if stack is not None:
            stack.close()
        if bar is not None:
            bar.close()
    report["config"]["wall_s"] = round(time.perf_counter() - t0, 2)
    requests = {r["label"]: r.pop("requests", []) for r in report["runs"]}
    files = write_report(report, out_dir, plots=not args.no_plots)
    import json

    (out_dir / "requests.json").write_text(json.dumps(requests))
    print(markdown(report))
    print(f"results in {files[0].parent}")
    return 0
