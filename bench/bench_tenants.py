"""Tenants on a saturated fleet, in the simulator: kvgate's flow control (services/core/flow:
priority bands, fair queueing by virtual token counters, shedding) beside first come first
served (the router's queue without tenants) and a per-tenant rate limit (each tenant held to
its weighted share of the fleet in prompt tokens per minute, FCFS beneath: what the AI
gateways' token rate limits do), on the same requests, virtual clock and engine model.

Two more modes carry the flow-control order into the engines' own schedulers (the router's
``--engine-priority``: each request's ``priority`` from its band and whether its tenant holds
more than its share, services/core/flow/engine_priority.py): the engines run the requests'
``priority`` policy with ``--max-inflight`` running slots, and the router sends each worker up
to ``--engine-queue`` more, which wait in the engine's queue. ``kvgate_vllm``: vLLM 0.33's
``--scheduling-policy priority`` (the queue in priority order; a waiting request never
preempts a running one). ``kvgate_sglang``: SGLang's ``--enable-priority-scheduling`` with
``--priority-scheduling-preemption-threshold 0`` (a waiting request preempts a running one of a
greater priority value when no slot is free).

Scenarios (each on several seeds):

- ``heavy``: a heavy batch tenant sends 10x its fair share (weights equal, share = 1 /
  tenants of the fleet's capacity) while light interactive tenants send well under theirs.
  Figure: the light tenants' TTFT p99 over their solo run (the same light requests with no
  heavy tenant). Target <= 1.2x. Beside it, where their TTFT goes: router wait p99 (arrival
  to dispatch) and in-engine p99 (dispatch to first token); and the light requests over 1.2x
  the solo p99 (a p99 within the target needs under 1 % of them), by cause
  (:func:`over_target`).
- ``fair``: three tenants with weights 1 : 2 : 1, each sending more than its share (so all
  stay backlogged) for 150 s. Figure: the least Jain's index of weighted service / weight
  over 30 s windows 5 s apart, from 30 s (the lines have filled) to the end of arrivals
  (target >= 0.95), and the largest deviation of a tenant's share of service from its
  weight's share in any of them (target <= 10 %). Service = prompt tokens + 2 x generated tokens (VTC's
  weights), counted when each token is computed.
- ``priority``: critical, standard and sheddable tenants; the sheddable load doubles.
  Figures: critical TTFT p99 at 2x sheddable over 1x (target <= 1.1x), with its router wait
  and in-engine p99s at each load, and critical requests refused while a sheddable one was
  dispatched (target 0).

Mode ``kvgate_room`` is kvgate with the router's ``--protect-prefill`` (the prefill room,
services/core/flow/prefill_room.py, at ``--protect-quantile``; ``kvgate_room@0.95`` at 0.95, so
one run can sweep the quantile). Its cost shows as the work done per second (prompt + 2 x
generated tokens of requests served within the span) by the heavy tenant
(``heavy_work_per_s``) and by the standard and sheddable tenants (``std_shed_work_*``).

    python -m bench.bench_tenants                       # all scenarios, seeds 1-3
    python -m bench.bench_tenants --scenarios fair --seeds 1,2,3,4,5 --json out.json
    python -m bench.bench_tenants --scenarios heavy,priority \
        --modes kvgate,kvgate_room@0.8,kvgate_room@0.9,kvgate_room@0.95
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from bench.metrics import OK, REJECTED, percentile
from bench.simcore import SimOptions, SimRun, simulate
from bench.workloads import BenchRequest, poisson_arrivals, random_text
from services.common.tenancy import Priority, Tenant, TenantQuota

OUTPUT_COST = 2.0  # VTC's weight of a generated token (services.core.flow.vtc)
MODES = ("fcfs", "rate_limit", "kvgate", "kvgate_room", "kvgate_vllm", "kvgate_sglang")
# the modes whose engines schedule by the router's ``priority`` (services.core.flow.engine_priority)
# -> the engines' preemption threshold (None: vLLM's priority policy, which never preempts for a
# waiting request; 0: SGLang's with --priority-scheduling-preemption-threshold 0)
ENGINE_MODES: dict[str, int | None] = {"kvgate_vllm": None, "kvgate_sglang": 0}


@dataclass(frozen=True)
class Shape:
    prompt: int
    output: int

    @property
    def cost(self) -> float:
        return self.prompt + OUTPUT_COST * self.output


BATCH = Shape(1024, 128)
CHAT = Shape(256, 32)


def fleet_opts(
    args: argparse.Namespace, engine: dict[str, Any] | None = None, **kw: Any
) -> SimOptions:
    return SimOptions(
        num_workers=args.workers,
        engine={"max_num_batched_tokens": args.batched_tokens, **(engine or {})},
        queue_timeout_s=args.queue_timeout,
        telemetry_interval_s=0.1,
        **kw,
    )


def policy(args: argparse.Namespace, mode: str = "") -> dict[str, Any]:
    """The router's policy: ``max_inflight`` per worker; in the engine-priority modes the
    router also sends ``--engine-queue`` more, which wait in the engine's priority queue."""
    cap = args.max_inflight + (args.engine_queue if mode in ENGINE_MODES else 0)
    return {"name": "least_request", "params": {"max_inflight": cap}}


def stream(
    rng: random.Random, tenant: str, shape: Shape, rate: float, span_s: float, prio: str
) -> list[BenchRequest]:
    """Poisson arrivals of ``shape`` requests at ``rate`` per second for ``span_s``."""
    n = max(1, int(rate * span_s))
    times = [t for t in poisson_arrivals(rng, n * 2, rate) if t < span_s][:n]
    return [
        BenchRequest(
            f"{tenant}-{i}",
            random_text(rng, shape.prompt),
            shape.output,
            arrival_s=t,
            tenant=tenant,
            priority=prio,
        )
        for i, t in enumerate(times)
    ]


def merged(*streams: list[BenchRequest]) -> list[BenchRequest]:
    return sorted((r for s in streams for r in s), key=lambda r: (r.arrival_s, r.request_id))


def capacity(args: argparse.Namespace, shape: Shape) -> float:
    """The fleet's service rate (cost units / s) on ``shape`` requests: a closed loop that
    keeps every worker at its cap."""
    rng = random.Random(99)
    reqs = [
        BenchRequest(f"cal-{i}", random_text(rng, shape.prompt), shape.output) for i in range(600)
    ]
    conc = args.workers * args.max_inflight
    run = simulate(reqs, policy(args), fleet_opts(args, closed_loop_concurrency=conc))
    ok = [r for r in run.results if r.status == OK]
    return len(ok) * shape.cost / run.duration_s


def run_modes(
    args: argparse.Namespace,
    reqs: list[BenchRequest],
    tenants: dict[str, Tenant],
    share_cost_s: dict[str, float],
) -> dict[str, SimRun]:
    """The same requests under each mode; ``share_cost_s``: each tenant's fair share of the
    fleet (cost units / s), the rate limit of the ``rate_limit`` mode."""
    out = {}
    for mode in args.modes:
        if mode in ENGINE_MODES:
            engine = {
                "scheduling": "priority",
                "preempt_threshold": ENGINE_MODES[mode],
                "max_num_seqs": args.max_inflight,  # the running slots the other modes use
            }
            opts = fleet_opts(
                args,
                engine,
                flow="kvgate",
                tenants=tenants,
                engine_priority=True,
                engine_queue=args.engine_queue,
            )
        elif mode == "rate_limit":
            ts = {
                t: Tenant(
                    t,
                    ten.weight,
                    quota=TenantQuota(
                        input_tokens_per_min=int(share_cost_s[t] * 60 * _prompt_fraction(reqs, t))
                    ),
                )
                for t, ten in tenants.items()
            }
            opts = fleet_opts(args, flow="fcfs", tenants=ts)
        elif mode.startswith("kvgate_room"):
            opts = fleet_opts(
                args,
                flow="kvgate",
                tenants=tenants,
                protect_prefill=True,
                protect_quantile=room_quantile(args, mode),
            )
        else:
            opts = fleet_opts(args, flow=mode, tenants=tenants)
        out[mode] = simulate(reqs, policy(args, mode), opts)
    return out


def room_quantile(args: argparse.Namespace, mode: str) -> float:
    """``kvgate_room@Q``'s quantile Q; plain ``kvgate_room``: ``--protect-quantile``."""
    _, at, q = mode.partition("@")
    return float(q) if at else args.protect_quantile


def _prompt_fraction(reqs: list[BenchRequest], tenant: str) -> float:
    """The share of a tenant's cost that is prompt tokens (a prompt-token limit of that
    fraction of its share holds the tenant to its share)."""
    mine = [r for r in reqs if r.tenant == tenant]
    p = sum(r.prompt_tokens for r in mine)
    return p / (p + OUTPUT_COST * sum(r.max_tokens for r in mine)) if mine else 1.0


def ttft_p99(run: SimRun, pred) -> float | None:
    v = [r.ttft_s for r in run.results if r.status == OK and r.ttft_s is not None and pred(r)]
    return percentile(v, 99)


def work_per_s(run: SimRun, pred, span_s: float) -> float:
    """Work done (cost units: prompt + OUTPUT_COST x generated tokens) per second for the
    requests ``pred`` picks that were served and ended within the arrivals' span."""
    done = [
        r
        for r in run.results
        if r.status == OK and r.e2e_s is not None and r.send_s + r.e2e_s <= span_s and pred(r)
    ]
    return sum(r.prompt_tokens + OUTPUT_COST * r.completion_tokens for r in done) / span_s


def split_p99(run: SimRun, pred) -> tuple[float | None, float | None]:
    """Where the TTFT of the requests ``pred`` picks goes, as p99s: (router wait: from arrival to
    dispatch, in the engine: from dispatch to the first token)."""
    waits, engine = [], []
    for r in run.results:
        if r.status != OK or r.ttft_s is None or not pred(r):
            continue
        w = run.dispatched_at[r.request_id] - r.send_s
        waits.append(w)
        engine.append(r.ttft_s - w)
    return percentile(waits, 99), percentile(engine, 99)


# why a light request's TTFT went over the target, from the router's view when it was sent
CAUSES = (
    "room_held",  # its router wait put it over, and the prefill room held it
    "slot_wait",  # its router wait put it over, the room never held it: no free slot
    "heavy_prompt_all_computing",  # sent where a heavy prompt was computed; so was every worker
    "heavy_prompt_free_worker_full",  # ... while some worker computed none (it had no free slot)
    "light_prompt",  # sent where only shorter prompts were computed (as in the solo run)
    "prompt_free",  # sent to a worker computing no prompt (its steps carry decodes)
)


def over_target(run: SimRun, pred, limit_s: float) -> dict[str, float]:
    """The share of the requests ``pred`` picks (served ones) whose TTFT is over ``limit_s``,
    in all and by cause (:data:`CAUSES`): when the in-engine part alone is within the limit,
    the router wait put it over; else what its worker was computing when it was sent."""
    out = dict.fromkeys(("all", *CAUSES), 0.0)
    served = [r for r in run.results if r.status == OK and r.ttft_s is not None and pred(r)]
    for r in served:
        if r.ttft_s <= limit_s:
            continue
        holds, pending, computing = run.sent_into[r.request_id]
        if r.ttft_s - (run.dispatched_at[r.request_id] - r.send_s) <= limit_s:
            cause = "room_held" if holds else "slot_wait"
        elif pending >= BATCH.prompt:
            every = computing == len(run.workers)
            cause = "heavy_prompt_all_computing" if every else "heavy_prompt_free_worker_full"
        else:
            cause = "light_prompt" if pending else "prompt_free"
        out[cause] += 1
        out["all"] += 1
    return {k: v / len(served) for k, v in out.items()} if served else out


# ------------------------------------------------------------------------------ scenarios
def heavy(args: argparse.Namespace, seed: int, cap: float) -> dict[str, Any]:
    n_light = 3
    names = [f"light{i}" for i in range(n_light)]
    share = cap / (n_light + 1)  # equal weights
    rng = random.Random(seed)
    lights = [
        stream(rng, t, CHAT, args.light_load * share / CHAT.cost, args.span, "standard")
        for t in names
    ]
    hv = stream(rng, "heavy", BATCH, 10 * share / BATCH.cost, args.span, "standard")
    tenants = {t: Tenant(t) for t in [*names, "heavy"]}
    shares = dict.fromkeys(tenants, share)
    solo = simulate(merged(*lights), policy(args), fleet_opts(args, tenants=tenants))
    light_ids = {r.request_id for s in lights for r in s}
    is_light = lambda r: r.request_id in light_ids  # noqa: E731
    base = ttft_p99(solo, is_light)
    runs = run_modes(args, merged(*lights, hv), tenants, shares)
    out: dict[str, Any] = {"solo_light_ttft_p99_s": base}
    for mode, run in runs.items():
        p = ttft_p99(run, is_light)
        lr = [r for r in run.results if r.request_id in light_ids]
        waits = [
            run.dispatched_at[r.request_id] - r.send_s
            for r in lr
            if r.request_id in run.dispatched_at
        ]
        out[mode] = {
            "light_ttft_p99_s": p,
            "vs_solo": p / base if p and base else None,
            "light_queue_wait_p99_s": percentile(waits, 99),
            "light_engine_p99_s": split_p99(run, is_light)[1],
            "light_over_target": over_target(run, is_light, 1.2 * base) if base else None,
            "light_refused": sum(r.status == REJECTED for r in lr),
            "heavy_work_per_s": work_per_s(
                run, lambda r: r.request_id.startswith("heavy"), args.span
            ),
            "light_requests": len(lr),
        }
    return out


def service_per_second(
    run: SimRun, reqs: list[BenchRequest], span_s: float
) -> list[dict[str, float]]:
    """Weighted service per tenant per second: each prompt token counted at the first token
    (prefill done), each generated token (x OUTPUT_COST) when it was streamed."""
    tenant_of = {r.request_id: r.tenant for r in reqs}
    secs: list[dict[str, float]] = [{} for _ in range(int(span_s))]

    def add(t: float, tenant: str, v: float) -> None:
        k = int(t)
        if 0 <= k < len(secs):
            secs[k][tenant] = secs[k].get(tenant, 0.0) + v

    for r in run.results:
        if r.status != OK or r.ttft_s is None:
            continue
        ten = tenant_of[r.request_id]
        t = r.send_s + r.ttft_s
        add(t, ten, r.prompt_tokens + OUTPUT_COST)
        for gap in r.itl_s:
            t += gap
            add(t, ten, OUTPUT_COST)
    return secs


def jain(xs: list[float]) -> float:
    s, s2 = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * s2) if s2 else 1.0


def fair(args: argparse.Namespace, seed: int, cap: float) -> dict[str, Any]:
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    send = {"a": 1.0, "b": 0.6, "c": 0.35}  # x the fleet's capacity: each above its share
    total_w = sum(weights.values())
    rng = random.Random(seed)
    span = max(args.span, 150.0)  # a warm-up window, then windows sliding by 5 s
    reqs = merged(
        *(stream(rng, t, BATCH, send[t] * cap / BATCH.cost, span, "standard") for t in weights)
    )
    tenants = {t: Tenant(t, w) for t, w in weights.items()}
    shares = {t: cap * w / total_w for t, w in weights.items()}
    runs = run_modes(args, reqs, tenants, shares)
    out: dict[str, Any] = {}
    for mode, run in runs.items():
        js, devs = [], []
        secs = service_per_second(run, reqs, span)
        w = int(args.window)
        # from the end of the first window (queues have filled: every tenant is backlogged)
        # to the end of arrivals, every window of args.window seconds, 5 s apart
        for start in range(w, int(span) - w + 1, 5):
            win: dict[str, float] = {}
            for sec in secs[start : start + w]:
                for t, v in sec.items():
                    win[t] = win.get(t, 0.0) + v
            tot = sum(win.values())
            if not tot:
                continue
            js.append(jain([win.get(t, 0.0) / wt for t, wt in weights.items()]))
            devs.append(
                max(abs(win.get(t, 0.0) / tot / (wt / total_w) - 1) for t, wt in weights.items())
            )
        out[mode] = {
            "jain_min": min(js) if js else None,
            "max_share_deviation": max(devs) if devs else None,
            "windows": len(js),
        }
    return out


def priority(args: argparse.Namespace, seed: int, cap: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    per_load: dict[float, dict[str, SimRun]] = {}
    crit_ids: set[str] = set()
    shed_ids: set[str] = set()
    for mult in (1.0, 2.0):
        rng = random.Random(seed)  # the same critical and standard requests at both loads
        crit = stream(rng, "crit", CHAT, 0.2 * cap / CHAT.cost, args.span, "critical")
        std = stream(rng, "std", BATCH, 0.5 * cap / BATCH.cost, args.span, "standard")
        rng2 = random.Random(seed * 7919 + int(mult))
        shd = stream(
            rng2,
            "shed",
            BATCH,
            mult * args.sheddable_load * cap / BATCH.cost,
            args.span,
            "sheddable",
        )
        crit_ids |= {r.request_id for r in crit}
        shed_ids |= {r.request_id for r in shd}
        tenants = {
            t: Tenant(t, default_priority=Priority(p))
            for t, p in (("crit", "critical"), ("std", "standard"), ("shed", "sheddable"))
        }
        shares = dict.fromkeys(tenants, cap / 3)
        per_load[mult] = run_modes(args, merged(crit, std, shd), tenants, shares)
    for mode in args.modes:
        p1 = ttft_p99(per_load[1.0][mode], lambda r: r.request_id in crit_ids)
        p2 = ttft_p99(per_load[2.0][mode], lambda r: r.request_id in crit_ids)
        bad = 0
        refused_crit = 0
        for mult in (1.0, 2.0):
            run = per_load[mult][mode]
            sent = sorted(t for rid, t in run.dispatched_at.items() if rid in shed_ids)
            for r in run.results:
                if r.request_id in crit_ids and r.status == REJECTED:
                    refused_crit += 1
                    # a sheddable request dispatched while this critical one was waiting
                    if any(r.send_s <= t <= r.end_s for t in sent):
                        bad += 1
        is_crit = lambda r: r.request_id in crit_ids  # noqa: E731
        w1, e1 = split_p99(per_load[1.0][mode], is_crit)
        w2, e2 = split_p99(per_load[2.0][mode], is_crit)
        best_effort = lambda r: r.request_id.startswith(("std-", "shed-"))  # noqa: E731
        out[mode] = {
            "std_shed_work_per_s_1x": work_per_s(per_load[1.0][mode], best_effort, args.span),
            "std_shed_work_per_s_2x": work_per_s(per_load[2.0][mode], best_effort, args.span),
            "critical_ttft_p99_1x_s": p1,
            "critical_ttft_p99_2x_s": p2,
            "ratio_2x_over_1x": p2 / p1 if p1 and p2 else None,
            "critical_wait_p99_1x_s": w1,
            "critical_wait_p99_2x_s": w2,
            "critical_engine_p99_1x_s": e1,
            "critical_engine_p99_2x_s": e2,
            "critical_refused": refused_crit,
            "critical_refused_while_sheddable_sent": bad,
        }
    return out


SCENARIOS = {"heavy": heavy, "fair": fair, "priority": priority}


# ------------------------------------------------------------------------------ report
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    for name, per_seed in results.items():
        modes = [m for m, v in per_seed[0].items() if isinstance(v, dict)]
        first = per_seed[0][modes[0]]
        keys = [k for k in first if k not in ("windows", "light_requests", "light_over_target")]
        print(f"\n== {name} ({len(per_seed)} seeds; per seed, then the mean)")
        print(f"{'mode':<16} " + " ".join(f"{k:>36}" for k in keys))
        for mode in modes:
            cells = []
            for k in keys:
                vals = [s[mode][k] for s in per_seed]
                nums = [v for v in vals if isinstance(v, int | float)]
                mean = statistics.fmean(nums) if nums else None
                cells.append(f"{' '.join(_fmt(v) for v in vals)} | {_fmt(mean)}")
            print(f"{mode:<16} " + " ".join(f"{c:>36}" for c in cells))
        if name == "heavy":
            print(
                "solo light TTFT p99 s: "
                + " ".join(_fmt(s["solo_light_ttft_p99_s"]) for s in per_seed)
            )
            print("light requests over 1.2x the solo p99, % (mean over the seeds), by cause")
            print(f"{'mode':<16} " + " ".join(f"{k:>29}" for k in ("all", *CAUSES)))
            for mode in modes:
                shares = [s[mode]["light_over_target"] for s in per_seed]
                if None in shares:
                    continue
                cells = [
                    f"{100 * statistics.fmean(x[k] for x in shares):.2f}" for k in ("all", *CAUSES)
                ]
                print(f"{mode:<16} " + " ".join(f"{c:>29}" for c in cells))


def valid_mode(mode: str) -> bool:
    base, at, q = mode.partition("@")
    if not at:
        return mode in MODES
    try:
        return base == "kvgate_room" and 0.0 < float(q) < 1.0
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_tenants",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--scenarios", default="heavy,fair,priority")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"of {', '.join(MODES)}; kvgate_room@Q: the room at --protect-quantile Q",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-inflight", type=int, default=16, help="per-worker cap (the policy's)")
    ap.add_argument(
        "--batched-tokens",
        type=int,
        default=8192,
        help="the engines' max_num_batched_tokens (a step's prefill budget: bounds how long "
        "a light request's first token waits behind a heavy prompt in the same engine)",
    )
    ap.add_argument(
        "--engine-queue",
        type=int,
        default=16,
        help="engine-priority modes: requests per worker the router sends beyond the engine's "
        "--max-inflight running slots (they wait in the engine's priority queue)",
    )
    ap.add_argument("--span", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--window", type=float, default=30.0, help="fairness window (s)")
    ap.add_argument("--queue-timeout", type=float, default=30.0)
    ap.add_argument("--light-load", type=float, default=0.3, help="x a light tenant's share")
    ap.add_argument("--sheddable-load", type=float, default=0.3, help="x capacity at 1x")
    ap.add_argument(
        "--protect-quantile",
        type=float,
        default=0.8,
        help="kvgate_room: the router's --protect-quantile (services/core/flow/prefill_room.py)",
    )
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(not valid_mode(m) for m in args.modes):
        ap.error(
            f"--modes: a comma-separated list of {', '.join(MODES)}, or kvgate_room@Q "
            "with 0 < Q < 1"
        )
    caps = {"chat": capacity(args, CHAT), "batch": capacity(args, BATCH)}
    print(
        f"fleet: {args.workers} workers x {args.max_inflight} in flight; capacity "
        f"{caps['batch']:.0f} cost units/s on batch requests, {caps['chat']:.0f} on chat "
        f"(cost = prompt + {OUTPUT_COST:g} x output tokens)",
        file=sys.stderr,
    )
    cap = caps["batch"]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in [s for s in args.scenarios.split(",") if s]:
        results[name] = [SCENARIOS[name](args, seed, cap) for seed in seeds]
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "capacity": caps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
