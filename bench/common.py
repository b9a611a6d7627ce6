"""Command-line pieces shared by ``kvgate bench`` and ``kvgate simulate``: workload and policy
options, the results directory."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.workloads import WORKLOADS, Workload, build_workload, parse_params, workload_params

# the built-in policies every comparison runs (in this order) unless --policies says otherwise
BUILTIN_POLICIES = (
    "round_robin",
    "random",
    "least_request",
    "power_of_two",
    "prefix",
    "kv_load",
    "gpu_aware",
    "kv_aware",  # the router's default policy: always in the comparison
    "slo_aware",
)

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        "-w",
        default="shared-system-prompt",
        choices=sorted(WORKLOADS),
        help="workload generator (default: shared-system-prompt)",
    )
    g.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter, repeatable (e.g. -p groups=8 -p prefix_len=1024); "
        "see --list-workloads",
    )
    g.add_argument(
        "--trace",
        default="",
        help="trace file for the mooncake / azure workloads (same as -p path=...)",
    )
    g.add_argument("--seed", type=int, default=None, help="workload seed (default: its own, 0)")
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open-loop Poisson arrival rate, requests/s (workloads with a 'rate' parameter)",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="closed loop: keep this many requests in flight, ignore arrival times (0: open loop)",
    )
    g.add_argument(
        "--list-workloads",
        action="store_true",
        help="print the workloads and their parameters, then exit",
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    from services.core.policy import policy_names

    # the help names both sets, so "default" is never read as "all of them"
    others = [n for n in policy_names() if n not in BUILTIN_POLICIES]
    parser.add_argument(
        "--policies",
        default=",".join(BUILTIN_POLICIES),
        help="comma-separated policies to compare; NAME or NAME:{json params} "
        "(e.g. 'kv_aware,kv_aware:{\"max_inflight\":8}'); default: these "
        f"{len(BUILTIN_POLICIES)} ({', '.join(BUILTIN_POLICIES)}); the other "
        f"{len(others)} run only when named ({', '.join(others)})",
    )


def add_output_arguments(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument(
        "--name", default="", help=f"results name (default: {kind}-<workload>-<time>)"
    )
    parser.add_argument(
        "--out-dir",
        default=str(DEFAULT_RESULTS),
        help="parent directory of the results (default: bench/results)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def list_workloads() -> str:
    lines = []
    for name, fn in WORKLOADS.items():
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        params = ", ".join(f"{k}={v!r}" for k, v in workload_params(name).items())
        lines.append(f"{name}: {doc}\n    {params}")
    return "\n".join(lines)


def workload_from_args(args: argparse.Namespace) -> Workload:
    params: dict[str, Any] = parse_params(args.param)
    defaults = workload_params(args.workload)
    if args.trace:
        params["path"] = args.trace
    if args.seed is not None:
        params["seed"] = str(args.seed)
    if args.rate is not None:
        if "rate" in defaults:
            params["rate"] = str(args.rate)
        elif "time_scale" not in params:
            raise ValueError(
                f"workload {args.workload!r} takes its arrivals from the trace; "
                "use -p time_scale=X instead of --rate"
            )
    return build_workload(args.workload, params)


def parse_policies(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``"a,b:{json}"`` -> [(label, spec)]. Labels are unique (params appended when needed)."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for item in _split_top(text):
        item = item.strip()
        if not item:
            continue
        if ":" in item:
            name, raw = item.split(":", 1)
            try:
                params = json.loads(raw)
            except ValueError as exc:
                raise ValueError(f"policy {item!r}: params are not JSON: {exc}") from None
            if not isinstance(params, dict):
                raise ValueError(f"policy {item!r}: params must be a JSON object")
        else:
            name, params = item, {}
        label = name.strip()
        if params:
            label += json.dumps(params, sort_keys=True, separators=(",", ":"))
        if label in seen:
            raise ValueError(f"policy {label!r} is listed twice")
        seen.add(label)
        out.append((label, {"name": name.strip(), "params": params}))
    if not out:
        raise ValueError("no policies given")
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside braces."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def results_dir(args: argparse.Namespace, kind: str, workload: str) -> tuple[str, Path]:
    name = args.name or f"{kind}-{workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    return name, Path(args.out_dir) / name


def write_result(out_dir: str | Path, name: str, result: dict[str, Any]) -> Path:
    """Write a benchmark's JSON result as ``<out_dir>/<name>_<unix seconds>.json`` (the
    folder made if missing), say where, and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{int(time.time())}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"results: {path}")
    return path
