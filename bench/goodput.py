"""``python -m bench.goodput``: goodput at an SLO, per routing policy, on the simulator.

Goodput = the highest arrival-rate multiplier of a workload at which at least ``--attain``
(default 90 %) of *all* its requests complete with TTFT <= ``--ttft`` and TPOT <= ``--tpot``.
Requests refused, shed by the router's queue, errored or timed out count as misses (a policy
cannot buy latency by rejecting). Per policy and seed it is found by bisection over the
multiplier between ``--min-rate`` and ``--max-rate`` (``--max-rate`` first, then
``--min-rate``, then ``--steps`` geometric halvings of the bracket), each point one
``kvgate simulate`` run (:func:`bench.simcore.simulate`) of the workload with its rate scaled:
``rate`` x m for Poisson workloads (conversations: m x the sessions at m x the session rate, so
the load grows with m), ``time_scale`` / m for traces.

``--max-rate auto``: each search starts at x4 and, while it meets the target there, doubles its
upper end (at most ``--auto-max``) until it misses, then bisects that doubling.
``--scale-count``: the multiplier also scales the request count (``num_requests`` or
``groups``), the same arrival window with m x the requests, which a burst needs (once the whole
burst is in flight a higher rate adds no load)::

    python -m bench.goodput -w shared-system-prompt -p num_requests=1200 -p rate=2400 \
        -p warmup_s=0.1 --profile default --ttft 2 --scale-count --max-rate auto

Printed: per policy, per seed the goodput (offered requests/s of the workload at that
multiplier, and the multiplier), the median over seeds, its ratio to the best peer rule's
median, and beneath them what :mod:`bench.latency_bound` proves for that SLO (the share of
requests any policy could meet at any rate, and the multiplier above which the fleet cannot
even compute the prefill of that share in time). Written under ``bench/results/<name>/``:
``goodput.json`` (every evaluated point), ``attainment.csv`` and ``attainment.png``
(attainment vs rate per policy).

Defaults: the issue's conversation workload (``-w multi-turn`` with sessions=200 turns=8
system_len=2048 user_len=1024 output_len=300 think_s=5 rate=1.5, ``-e max_model_len=32768``;
each ``-p`` / ``-e`` overrides one)
on 8 prefill-bound engines (``--profile prefill-bound``), TTFT <= 6.25 s, TPOT <= 50 ms,
multipliers 0.5-4.0, 5 steps, seeds 0 and 1::

    python -m bench.goodput                                    # ~6-10 min on 2 busy cores
    python -m bench.goodput --quick                            # 1 seed, 80 sessions, 3 steps
    python -m bench.goodput -w generated-shared-prefix --rate 40 --profile default \\
        --ttft 2 --max-rate 4 --policies slo_aware,kv_aware,sglang_cache_aware

Disaggregated fleets: ``--pd P:D`` runs the P/D policies (``pd_slo``, ``pd_dynamo``,
``pd_llmd``, ``pd_sglang``, ``pd_round_robin``) on P prefill + D decode engines and the colocated
ones on P + D colocated engines; ``--pd-peers`` names the P/D peer rules the ``÷ best P/D peer``
column divides by. Each point also records the ITL p99 (the table shows it at each policy's
goodput, and a second one every policy's ITL p99 and attainment at the multipliers every
search evaluated: the same offered rate for all)::

    python -m bench.goodput --pd 2:6 \\
        --policies slo_aware,kv_aware,dynamo_kv,pd_slo,pd_dynamo,pd_llmd,pd_sglang
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_RESULTS, list_workloads, parse_policies
from bench.goodput_search import (
    Ceiling,
    Search,
    attainment,
    bisect_rate,
    count_key,
    offered_rate,
    rate_knob,
    slo_ceiling,
    workload_at,
)
from bench.latency_bound import _number
from bench.metrics import ERROR, REJECTED, TIMEOUT
from bench.simcore import (
    SimOptions,
    for_policy,
    make_engine_config,
    parse_split,
    request_keys,
    simulate,
)
from bench.workloads import WORKLOADS, parse_params
from services.core.engine_profiles import ENGINE_PROFILES

# the conversation workload (docs/benchmarks.md's `mt`): -w multi-turn's parameters
# unless a -p overrides one
CONVERSATION = {
    "sessions": 200,
    "turns": 8,
    "system_len": 2048,
    "user_len": 1024,
    "output_len": 300,
    "think_s": 5,
    "rate": 1.5,
}
CONVERSATION_ENGINE = {"max_model_len": 32768}
QUICK = {"sessions": 80}
PEERS = "sglang_cache_aware,dynamo_kv,llmd_default,llmd_kv_util"
POLICIES = f"slo_aware,kv_aware,{PEERS},round_robin"
PD_PEERS = "pd_dynamo,pd_llmd,pd_sglang,pd_round_robin"
AUTO_START = 4.0  # --max-rate auto: where each search's upper end starts doubling from

_SHARED: dict[str, Any] = {}  # what forked search processes read


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = ap.add_argument_group("workload")
    w.add_argument(
        "--workload",
        "-w",
        default="multi-turn",
        choices=sorted(WORKLOADS),
        help="workload generator (default: multi-turn, with the conversation parameters above)",
    )
    w.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter, repeatable; see --list-workloads",
    )
    w.add_argument("--trace", default="", help="trace file (mooncake / azure; = -p path=...)")
    w.add_argument(
        "--rate",
        type=float,
        default=None,
        help="the base Poisson rate (multiplier 1.0) of workloads with a 'rate' parameter",
    )
    w.add_argument("--list-workloads", action="store_true", help="list workloads, then exit")
    e = ap.add_argument_group("engines and policies")
    e.add_argument("--workers", "-n", type=int, default=8, help="engines (default 8)")
    e.add_argument(
        "--pd",
        default="",
        metavar="P:D",
        help="disaggregated fleet for the P/D policies: P prefill + D decode engines; the "
        "colocated policies get P + D colocated engines (--workers is then P + D)",
    )
    e.add_argument(
        "--pd-peers",
        default=PD_PEERS,
        help=f"which of the policies are the P/D peer rules (default: {PD_PEERS})",
    )
    e.add_argument(
        "--profile",
        choices=sorted(ENGINE_PROFILES),
        default="prefill-bound",
        help="engine profile (default prefill-bound: -e prefill_token_s=1.25e-4 "
        "-e num_gpu_blocks=192000; default: EngineConfig's own; h200-llama-3-8b: fitted to "
        "a forward pass measured on an H200, docs/worker-sim.md)",
    )
    e.add_argument(
        "--engine",
        "-e",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EngineConfig setting on top of the profile, repeatable",
    )
    e.add_argument(
        "--policies",
        default=POLICIES,
        help=f"comma-separated policies, NAME or NAME:{{json}} (default: {POLICIES})",
    )
    e.add_argument(
        "--peers",
        default=PEERS,
        help=f"which of the policies are the peer rules the ratio is to (default: {PEERS})",
    )
    e.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="router queue: seconds before a waiting request is shed (429, a miss; default 30)",
    )
    e.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="client timeout: later completions are timeouts (misses; default 600)",
    )
    s = ap.add_argument_group("SLO and search")
    s.add_argument("--ttft", type=float, default=6.25, help="TTFT SLO, seconds (default 6.25)")
    s.add_argument("--tpot", type=float, default=0.050, help="TPOT SLO, seconds (default 0.050)")
    s.add_argument(
        "--attain",
        type=float,
        default=90.0,
        help="percent of all requests that must meet both (default 90)",
    )
    s.add_argument("--min-rate", type=float, default=0.5, help="lowest multiplier (0.5)")
    s.add_argument(
        "--max-rate",
        default="4.0",
        help="highest multiplier (4.0), or 'auto': start at 4 and, while a search meets the "
        "target there, double its upper end (at most --auto-max) until it misses, then bisect "
        "that doubling; every policy's goodput is bracketed unless it meets --auto-max",
    )
    s.add_argument(
        "--auto-max",
        type=float,
        default=256.0,
        help="with --max-rate auto: the highest multiplier tried (default 256)",
    )
    s.add_argument(
        "--scale-count",
        action="store_true",
        help="scale the request count (num_requests, or groups) with the rate: the same "
        "arrival window with m x the requests (bursts need it: once a whole burst is in "
        "flight a higher rate adds no load)",
    )
    s.add_argument(
        "--steps", type=int, default=5, help="bisection steps after the two ends (default 5)"
    )
    s.add_argument("--seeds", default="0,1", help="comma-separated workload seeds (default 0,1)")
    s.add_argument(
        "--quick",
        action="store_true",
        help="small run: seed 0 only, 3 steps, and (multi-turn defaults) 80 sessions",
    )
    o = ap.add_argument_group("output")
    o.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="searches (policy x seed) in parallel processes (default: min(2, cores))",
    )
    o.add_argument("--name", default="", help="results name (default goodput-<workload>-<time>)")
    o.add_argument(
        "--out-dir", default=str(DEFAULT_RESULTS), help="parent of the results (bench/results)"
    )
    o.add_argument("--no-plots", action="store_true", help="skip attainment.png (CSV still)")
    o.add_argument("--no-progress", action="store_true", help="no per-point progress lines")
    return ap


def resolve(a: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration from the arguments; ValueError on bad input."""
    params: dict[str, Any] = parse_params(a.param)
    engine = dict(ENGINE_PROFILES[a.profile])
    if a.workload == "multi-turn":  # the conversations under the -p given
        params = {**CONVERSATION, **(QUICK if a.quick else {}), **params}
        engine.update(CONVERSATION_ENGINE)
    engine.update({k: _number(v) for k, v in parse_params(a.engine).items()})
    if a.trace:
        params["path"] = a.trace
    if a.rate is not None:
        params["rate"] = a.rate
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    steps = a.steps
    if a.quick:
        seeds, steps = seeds[:1], min(steps, 3)
    if not seeds:
        raise ValueError("--seeds: give at least one seed")
    if not 0 < a.attain <= 100:
        raise ValueError("--attain must be in (0, 100]")
    if a.ttft <= 0 or a.tpot <= 0:
        raise ValueError("--ttft and --tpot must be > 0")
    grow_to = None
    if str(a.max_rate).strip().lower() == "auto":
        max_rate, grow_to = AUTO_START, a.auto_max
        if not grow_to > max_rate:
            raise ValueError(f"--auto-max must be above {AUTO_START:g} (where auto starts)")
    else:
        try:
            max_rate = float(a.max_rate)
        except ValueError:
            raise ValueError(f"--max-rate: a number or 'auto', not {a.max_rate!r}") from None
    if not 0 < a.min_rate < max_rate:
        raise ValueError("need 0 < --min-rate < --max-rate")
    if not 0 <= steps <= 30:
        raise ValueError("--steps must be in 0..30")
    split = parse_split(a.pd) if a.pd else (0, 0)
    if a.pd:
        a.workers = split[0] + split[1]
    if not 1 <= a.workers <= 4096:
        raise ValueError("--workers must be between 1 and 4096")
    policies = parse_policies(a.policies)
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    rate_knob(a.workload, params)  # the workload has a rate to scale
    if a.scale_count:  # ... and a count to scale with it
        count_key(a.workload)
    make_engine_config(engine)
    return {
        "workload": a.workload,
        "params": params,
        "engine": engine,
        "profile": a.profile,
        "workers": a.workers,
        "pd": list(split),
        "policies": policies,
        "peers": peers,
        "pd_peers": [p.strip() for p in a.pd_peers.split(",") if p.strip()],
        "seeds": seeds,
        "steps": steps,
        "ttft_s": a.ttft,
        "tpot_s": a.tpot,
        "target": a.attain / 100.0,
        "min_rate": a.min_rate,
        "max_rate": max_rate,
        "grow_to": grow_to,
        "scale_count": a.scale_count,
        "queue_timeout_s": a.queue_timeout,
        "request_timeout_s": a.request_timeout,
        "progress": not a.no_progress,
    }


def evaluate_point(
    conf: dict[str, Any], spec: dict[str, Any], seed: int, m: float
) -> dict[str, Any]:
    """One simulated run of the workload at multiplier ``m``: its attainment and misses."""
    wl = workload_at(
        conf["workload"], {**conf["params"], "seed": seed}, m, conf.get("scale_count", False)
    )
    pre, dec = conf.get("pd") or (0, 0)
    opts = SimOptions(
        num_workers=conf["workers"],
        engine=conf["engine"],
        queue_timeout_s=conf["queue_timeout_s"],
        request_timeout_s=conf["request_timeout_s"],
        prefill_workers=pre,
        decode_workers=dec,
    )
    run = simulate(wl.requests, spec, for_policy(opts, spec))
    res = run.results
    itl = sorted(g for r in res for g in r.itl_s)
    return {
        "multiplier": m,
        "req_s": offered_rate(wl.requests),
        "requests": len(res),
        "attainment": attainment(res, conf["ttft_s"], conf["tpot_s"]),
        "itl_p99_s": itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else None,
        "rejected": sum(r.status == REJECTED for r in res),
        "timeouts": sum(r.status == TIMEOUT for r in res),
        "errors": sum(r.status == ERROR for r in res),
    }


def search_one(conf: dict[str, Any], label: str, spec: dict[str, Any], seed: int) -> dict:
    """The bisection of one policy on one seed."""
    points: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def evaluate(m: float) -> float:
        p = evaluate_point(conf, spec, seed, m)
        points.append(p)
        return p["attainment"]

    def show(s: Search, m: float, a: float) -> None:
        if conf["progress"]:
            p = points[-1]
            print(
                f"goodput: {label} seed {seed} x{m:.4f} ({p['req_s']:.3f} req/s): "
                f"{100 * a:.1f} % met, {p['rejected']} refused/shed, {p['timeouts']} timed out "
                f"[{len(s.points)} points, {time.perf_counter() - t0:.0f} s]",
                file=sys.stderr,
                flush=True,
            )

    s = bisect_rate(
        evaluate,
        conf["target"],
        conf["min_rate"],
        conf["max_rate"],
        conf["steps"],
        show,
        grow_to=conf.get("grow_to"),
    )
    req_s = next((p["req_s"] for p in points if p["multiplier"] == s.goodput), None)
    return {
        "label": label,
        "seed": seed,
        "goodput_multiplier": s.goodput,
        "goodput_req_s": req_s,
        "outcome": s.outcome,
        "bracket": [s.lo, s.hi],
        "points": points,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _search_forked(label: str, spec: dict[str, Any], seed: int) -> dict:
    return search_one(_SHARED["conf"], label, spec, seed)


def run_searches(conf: dict[str, Any], jobs: int) -> list[dict]:
    """Every (policy, seed) search, in policy then seed order."""
    tasks = [(lbl, spec, seed) for lbl, spec in conf["policies"] for seed in conf["seeds"]]
    if jobs <= 1 or len(tasks) == 1:
        return [search_one(conf, *t) for t in tasks]
    _SHARED["conf"] = conf
    try:
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(tasks)), mp_context=get_context("fork")
        ) as pool:
            futs = [pool.submit(_search_forked, *t) for t in tasks]
            return [f.result() for f in futs]
    finally:
        _SHARED.clear()


def top_rate(conf: dict[str, Any]) -> float:
    """The highest multiplier the searches went to: ``--max-rate``, or with ``auto`` the
    highest any search evaluated (``searched_max``, set once they ran)."""
    return max(conf["max_rate"], conf.get("searched_max") or 0.0)


def ceilings(conf: dict[str, Any]) -> list[dict[str, Any]]:
    """Per seed, the latency bound's ceiling (:func:`bench.goodput_search.slo_ceiling`) over
    the searched multipliers."""
    cfg = make_engine_config(conf["engine"])
    out = []
    for seed in conf["seeds"]:
        params = {**conf["params"], "seed": seed}
        c: Ceiling = slo_ceiling(
            conf["workload"],
            params,
            lambda rs: request_keys(rs, cfg.block_size, cfg.hash_seed),
            cfg,
            conf["workers"],
            conf["target"],
            conf["ttft_s"],
            conf["tpot_s"],
            conf["min_rate"],
            top_rate(conf),
            scale_count=conf.get("scale_count", False),
        )
        req_s = None
        if c.multiplier > 0:
            wl = workload_at(conf["workload"], params, c.multiplier, conf.get("scale_count", False))
            req_s = offered_rate(wl.requests)
        out.append(
            {
                "seed": seed,
                "possible_share": c.possible_share,
                "multiplier": c.multiplier,
                "binds": c.binds,
                "req_s": req_s,
                "prefill_work_s": c.prefill_work_s,
            }
        )
    return out


# ------------------------------------------------------------------ the table
def _cell(r: dict, conf: dict[str, Any]) -> str:
    if r["outcome"] == "below-min":
        return f"< x{conf['min_rate']:g}"
    pre = ">= " if r["outcome"] == "at-max" else ""
    return f"{pre}{r['goodput_req_s']:.3f} (x{r['goodput_multiplier']:.3f})"


def policy_medians(searches: list[dict]) -> dict[str, tuple[float, float]]:
    """Per policy: median over seeds of (req/s, multiplier); a seed below --min-rate is 0."""
    per: dict[str, list[dict]] = {}
    for r in searches:
        per.setdefault(r["label"], []).append(r)
    return {
        lbl: (
            statistics.median(r["goodput_req_s"] or 0.0 for r in rs),
            statistics.median(r["goodput_multiplier"] or 0.0 for r in rs),
        )
        for lbl, rs in per.items()
    }


def table(conf: dict[str, Any], searches: list[dict], ceils: list[dict]) -> str:
    seeds = conf["seeds"]
    med = policy_medians(searches)
    names = {lbl: spec["name"] for lbl, spec in conf["policies"]}
    peers = [lbl for lbl in med if lbl in conf["peers"] or names[lbl] in conf["peers"]]
    best = max((med[p][0] for p in peers), default=0.0)
    best_peer = max(peers, key=lambda p: med[p][0]) if peers else None
    head = (
        "| policy | "
        + " | ".join(f"seed {s}: req/s (x)" for s in seeds)
        + " | median req/s (x) | ÷ best peer |"
    )
    lines = [head, "|---|" + "---:|" * (len(seeds) + 2)]
    for lbl, _spec in conf["policies"]:
        rs = {r["seed"]: r for r in searches if r["label"] == lbl}
        cells = [_cell(rs[s], conf) for s in seeds]
        g, m = med[lbl]
        ratio = f"{g / best:.2f}x" if best > 0 else "–"
        tag = " (peer)" if lbl in peers else ""
        lines.append(
            f"| `{lbl}`{tag} | " + " | ".join(cells) + f" | {g:.3f} (x{m:.3f}) | {ratio} |"
        )
    cc = []
    for c in ceils:
        if c["multiplier"] == 0:
            cc.append(f"< x{conf['min_rate']:g}")
        else:
            pre = "" if c["binds"] else ">= "
            cc.append(f"{pre}{c['req_s']:.3f} (x{c['multiplier']:.3f})")
    lines.append("| ceiling (latency bound, any policy) | " + " | ".join(cc) + " | | |")
    share = min(c["possible_share"] for c in ceils)
    grown = ""
    if conf.get("grow_to"):
        grown = (
            f" (auto: an upper end met doubles, up to x{conf['grow_to']:g}; highest "
            f"evaluated x{top_rate(conf):g})"
        )
    notes = [
        "",
        f"SLO: TTFT <= {conf['ttft_s']:g} s and TPOT <= {1000 * conf['tpot_s']:g} ms for >= "
        f"{100 * conf['target']:g} % of all requests (refused / shed / timed out = missed); "
        f"multipliers {conf['min_rate']:g}-{conf['max_rate']:g}{grown}, {conf['steps']} "
        f"steps; best peer: {best_peer or '–'}.",
        f"Latency bound: at x{top_rate(conf):g} at most {100 * share:.1f} % of the requests "
        "can meet the SLO (each one's prefill and decode alone on an idle engine); ceiling = "
        "the highest multiplier at which the fleet can still compute the prefill of the "
        "cheapest target share between the first arrival and the last + the TTFT SLO ('>=': "
        "the bound does not bind up to --max-rate; prefill capacity only, so a loose bound).",
    ]
    return "\n".join(lines + notes)


def _itl_at_goodput(r: dict) -> float | None:
    """ITL p99 of the point at this search's goodput (None below --min-rate)."""
    for p in r["points"]:
        if p["multiplier"] == r["goodput_multiplier"]:
            return p.get("itl_p99_s")
    return None


def pd_table(conf: dict[str, Any], searches: list[dict]) -> str:
    """Colocated and P/D fleets of the same engine count: each policy's median goodput, its
    ITL p99 there, and the ratios to the best colocated policy and the best P/D peer rule."""
    from services.core.policy.base import REGISTRY  # noqa: PLC0415

    pre, dec = conf["pd"]
    med = policy_medians(searches)
    names = {lbl: spec["name"] for lbl, spec in conf["policies"]}
    colo = [lbl for lbl in med if not REGISTRY[names[lbl]].disaggregated]
    pdp = [lbl for lbl in med if lbl in conf["pd_peers"] or names[lbl] in conf["pd_peers"]]
    best_colo = max(colo, key=lambda x: med[x][0], default=None)
    best_pdp = max(pdp, key=lambda x: med[x][0], default=None)
    itl = {}
    for lbl in med:
        vals = [v for r in searches if r["label"] == lbl if (v := _itl_at_goodput(r)) is not None]
        itl[lbl] = statistics.median(vals) if vals else None
    lines = [
        "| policy | fleet | median goodput req/s | ITL p99 at its goodput | ÷ best colocated "
        "| ITL p99 ÷ best colocated's | ÷ best P/D peer |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for lbl, _spec in conf["policies"]:
        g = med[lbl][0]
        fleet = f"{conf['workers']} colocated" if lbl in colo else f"{pre}P{dec}D"

        def ratio(base: str | None, g: float = g) -> str:
            return f"{g / med[base][0]:.2f}x" if base and med[base][0] > 0 else "–"

        i = itl[lbl]
        ib = itl.get(best_colo) if best_colo else None
        irat = f"{i / ib:.2f}x" if i is not None and ib else "–"
        its = f"{1000 * i:.0f} ms" if i is not None else "–"
        lines.append(
            f"| `{lbl}` | {fleet} | {g:.3f} | {its} | {ratio(best_colo)} | {irat} "
            f"| {ratio(best_pdp)} |"
        )
    lines.append("")
    lines.append(
        f"best colocated: {best_colo or '–'}; best P/D peer: {best_pdp or '–'} "
        f"(same {conf['workers']} engines; ITL p99 is each policy's at its own goodput)."
    )
    # the same offered rate for everyone: the multipliers every search evaluated
    common: set[float] | None = None
    for r in searches:
        ms = {round(p["multiplier"], 6) for p in r["points"]}
        common = ms if common is None else common & ms
    if common:
        lines += [
            "",
            "ITL p99 / SLO attainment (median over seeds) at the multipliers every search ran:",
            "",
            "| multiplier | " + " | ".join(f"`{lbl}`" for lbl, _ in conf["policies"]) + " |",
            "|---:|" + "---:|" * len(conf["policies"]),
        ]
        for m in sorted(common):
            cells = []
            for lbl, _spec in conf["policies"]:
                pts = [
                    p
                    for r in searches
                    if r["label"] == lbl
                    for p in r["points"]
                    if round(p["multiplier"], 6) == m
                ]
                itls = [p["itl_p99_s"] for p in pts if p.get("itl_p99_s") is not None]
                att = statistics.median(p["attainment"] for p in pts)
                it = f"{1000 * statistics.median(itls):.0f} ms" if itls else "–"
                cells.append(f"{it} / {100 * att:.0f} %")
            lines.append(f"| x{m:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ files
def write_csv(path: Path, searches: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "seed", "multiplier", "req_s", "attainment", "rejected", "timeouts"])
        for r in searches:
            for p in sorted(r["points"], key=lambda p: p["multiplier"]):
                w.writerow(
                    [
                        r["label"],
                        r["seed"],
                        f"{p['multiplier']:.6f}",
                        f"{p['req_s']:.6f}",
                        f"{p['attainment']:.6f}",
                        p["rejected"],
                        p["timeouts"],
                    ]
                )


def write_plot(path: Path, conf: dict[str, Any], searches: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (lbl, _spec) in enumerate(conf["policies"]):
        colour = colours[i % len(colours)]
        first = True
        for r in searches:
            if r["label"] != lbl:
                continue
            pts = sorted((p["req_s"], 100 * p["attainment"]) for p in r["points"])
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                marker="o",
                color=colour,
                alpha=0.8,
                label=lbl if first else None,
            )
            first = False
    ax.axhline(100 * conf["target"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel(
        f"% requests with TTFT <= {conf['ttft_s']:g} s, TPOT <= {1000 * conf['tpot_s']:g} ms"
    )
    ax.set_title(f"SLO attainment vs rate: {conf['workload']}, {conf['workers']} workers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(x: Any) -> Any:
    """JSON without Infinity: an unbounded value is written as the string "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.list_workloads:
        print(list_workloads())
        return 0
    try:
        conf = resolve(a)
    except (ValueError, OSError) as exc:
        print(f"bench.goodput: {exc}", file=sys.stderr)
        return 2
    name = a.name or f"goodput-{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(a.out_dir) / name
    t0 = time.perf_counter()
    searches = run_searches(conf, max(1, a.jobs))
    if conf.get("grow_to"):
        conf["searched_max"] = max(p["multiplier"] for r in searches for p in r["points"])
    out.mkdir(parents=True, exist_ok=True)  # the searches are kept even if what follows fails
    (out / "searches.json").write_text(json.dumps(_finite(searches), indent=1) + "\n")
    ceils = ceilings(conf)
    wall = time.perf_counter() - t0
    text = table(conf, searches, ceils)
    if any(conf["pd"]):
        text += "\n\n" + pd_table(conf, searches)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "kind": "goodput",
        "name": name,
        "config": {k: v for k, v in conf.items() if k != "progress"},
        "searches": searches,
        "ceiling": ceils,
        "medians": {
            k: {"req_s": g, "multiplier": m} for k, (g, m) in policy_medians(searches).items()
        },
        "wall_s": round(wall, 2),
    }
    (out / "goodput.json").write_text(json.dumps(_finite(doc), indent=1, default=str) + "\n")
    (out / "goodput.md").write_text(text + "\n")
    write_csv(out / "attainment.csv", searches)
    plotted = ""
    if not a.no_plots:
        write_plot(out / "attainment.png", conf, searches)
        plotted = ", attainment.png"
    print(text)
    print(
        f"\n{len(searches)} searches in {wall:.1f} s wall; results in {out} "
        f"(goodput.json, goodput.md, attainment.csv{plotted})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
