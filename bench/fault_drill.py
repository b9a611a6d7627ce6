"""The operator's fault drill: faults injected into a ``kvgate up`` stack (auth on, simulated
workers, the highly available indexer pair) under loopback client load, one scenario after
the other, and what the clients and the stack saw.

    python -m bench.fault_drill                       # every scenario, ~10 min on 2 cores
    python -m bench.fault_drill --quick               # shorter faults and phases, ~4 min
    python -m bench.fault_drill --scenarios worker-503,router-sigkill
    python -m bench.fault_drill --list                # the scenarios and their faults

Per scenario: wait until the stack is healthy (every worker answers, the router knows them
all and is /ready), start the clients (bench.drill_load: closed loop, mixed streamed and plain
completions, no retries), let them run ``--before-s``, inject the fault, hold it, clear it,
keep the load ``--after-s`` more, stop the clients. Scenarios needing another stack (three
NATS nodes) get their own; the others share one.

Printed per scenario (and saved as JSON under bench/results/fault_drill/): client requests,
failed (any non-200 but a 503 with Retry-After, a connection refused or reset), refused (503
+ Retry-After), streams cut (a 200 stream without ``[DONE]``), 404 answers, time to recover
(bench.drill_report), verifier repairs (growth of ``kvgate_index_verify_repairs_total`` over
the indexers), managed alerts raised by kind (the ALERTS stream, read with the stack's
operator credential) and the router's peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.drill_load import Load, LoadShape
from bench.drill_report import (
    Row,
    alerts_by_kind,
    in_flight_at,
    markdown,
    summarize,
    timeline,
)
from bench.drill_scenarios import SCENARIOS, Scenario
from bench.drill_stack import (
    CHECKS,
    REPAIRS,
    DrillStack,
    PeakSampler,
    StackShape,
    counter_delta,
    rss_mib,
)
from services.common.logging import configure_logging
from tests.up_stack import pid_alive

RESULTS = Path(__file__).parent / "results" / "fault_drill"
SETTLE_TIMEOUT_S = 120.0
LINGER_S = 15.0  # after the after-phase: how long a problem may take to clear before it is
# reported as left behind


@dataclass
class Timing:
    before_s: float
    after_s: float
    quick: bool
    hold_override: float | None = None

    def hold(self, sc: Scenario) -> float:
        if self.hold_override is not None and sc.hold_s:
            return self.hold_override
        return sc.quick_hold_s if self.quick else sc.hold_s


class Progress:
    """One line per phase, with the time since the drill began."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, line: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {line}", flush=True)


class RouterRss:
    """The router's resident memory now (it may have been restarted: found again by pid)."""

    def __init__(self, stack: DrillStack) -> None:
        self.stack = stack
        self.pid: int | None = None

    def __call__(self) -> float | None:
        if self.pid is None or not pid_alive(self.pid):
            self.pid = self.stack.router_pid()
        return rss_mib(self.pid)


async def settle(stack: DrillStack) -> None:
    """Until the stack is healthy (polled: its services report over HTTP, no event)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not await stack.healthy():
        if time.monotonic() > deadline:
            raise RuntimeError(f"stack not healthy after {SETTLE_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.2)


async def lingering(stack: DrillStack, grace_s: float) -> list[str]:
    """The stack's problems still there after ``grace_s`` (polled: no event says "healed")."""
    deadline = time.monotonic() + grace_s
    while True:
        found = await stack.problems()
        if not found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


async def run_scenario(
    stack: DrillStack,
    sc: Scenario,
    timing: Timing,
    shape: LoadShape,
    seed: int,
    progress: Progress,
) -> tuple[Row, dict[str, Any]]:
    """One scenario on a running stack: the row, and the details saved beside it."""
    progress(f"{sc.name}: waiting for a healthy stack")
    await settle(stack)
    hold = timing.hold(sc)
    fault = sc.fault(hold)
    verifier_before = await stack.verifier_counters()
    wall_start = time.time()
    load = Load(stack.url("router"), stack.auth(), shape, seed)
    fault_start = fault_end = None
    left_behind: list[str] = []
    async with PeakSampler(RouterRss(stack)) as rss:
        await load.start()
        try:
            progress(f"{sc.name}: load from {shape.clients} clients, {timing.before_s:.0f} s")
            await asyncio.sleep(timing.before_s)  # the phase's length, not a synchronisation
            progress(f"{sc.name}: inject: {sc.what}" + (f" (hold {hold:.0f} s)" if hold else ""))
            fault_start = time.monotonic()
            try:
                await fault.inject(stack)
                await asyncio.sleep(hold)
            finally:
                fault_end = time.monotonic()
                progress(f"{sc.name}: clear")
                await fault.clear(stack)
            progress(f"{sc.name}: load {timing.after_s:.0f} s after the fault")
            await asyncio.sleep(timing.after_s)
            left_behind = await lingering(stack, LINGER_S)
        finally:
            progress(f"{sc.name}: stopping the clients, reading the stack's counters")
            await load.stop()
    until = time.monotonic()
    row = summarize(
        sc.name,
        sc.what,
        hold,
        load.outcomes,
        fault_end if sc.faulty else None,
        until,
    )
    row.unfinished = load.unfinished
    row.left_behind = left_behind
    hit = in_flight_at(load.outcomes, fault_start) if fault_start is not None else {}
    if sc.faulty:
        row.in_flight_at_fault = sum(hit.values())
    row.router_rss_mib = rss.peak
    verifier_after = await stack.verifier_counters()
    row.repairs = counter_delta(verifier_before[REPAIRS], verifier_after[REPAIRS])
    row.verify_checks = counter_delta(verifier_before[CHECKS], verifier_after[CHECKS])
    alerts = await stack.alerts_between(wall_start, time.time())
    row.alerts = alerts_by_kind(alerts)
    origin = fault_start or until
    details = {
        "fault_start_s": 0.0,
        "fault_end_s": None if fault_end is None else round(fault_end - origin, 3),
        "alerts": alerts,
        "in_flight_at_fault_by_worker": hit,
        "timeline": timeline(load.outcomes, origin),
    }
    progress(
        f"{sc.name}: {row.requests} requests ({row.in_flight_at_fault} in flight at the fault), "
        f"{row.failed} failed, {row.refused} refused, "
        f"{row.cut} cut, recover {row.recover_s}, repairs {row.repairs:.0f} in "
        f"{row.verify_checks:.0f} checks, alerts {row.alerts}"
    )
    return row, details


def stack_shape(sc: Scenario, args: argparse.Namespace) -> StackShape:
    return StackShape(
        workers=args.workers,
        indexers=max(args.indexers, sc.indexers),
        nats_cluster=sc.nats_cluster,
        extra_args=tuple(args.up_arg or ()),
    )


async def drill(args: argparse.Namespace, scenarios: list[Scenario]) -> dict[str, Any]:
    progress = Progress()
    timing = Timing(
        before_s=args.before_s if args.before_s is not None else (3.0 if args.quick else 5.0),
        after_s=args.after_s if args.after_s is not None else (8.0 if args.quick else 15.0),
        quick=args.quick,
        hold_override=args.hold_s,
    )
    shape = LoadShape(clients=args.clients, stream_share=args.stream_share)
    groups: dict[StackShape, list[Scenario]] = {}
    for sc in scenarios:
        groups.setdefault(stack_shape(sc, args), []).append(sc)
    rows: list[Row] = []
    details: dict[str, Any] = {}
    errors: dict[str, str] = {}
    root = Path(args.state_dir or tempfile.mkdtemp(prefix="kvgate-drill-"))
    states = [root / f"stack-{n}" for n in range(len(groups))]
    for state, (stack_args, group) in zip(states, groups.items(), strict=True):
        stack = DrillStack(state, stack_args)
        progress(
            f"starting kvgate up: {stack_args.workers} workers, {stack_args.indexers} indexers, "
            f"{stack_args.nats_cluster} NATS node(s); state {stack.state}"
        )
        try:
            await asyncio.to_thread(stack.start)
            for i, sc in enumerate(group):
                try:
                    row, extra = await run_scenario(
                        stack, sc, timing, shape, args.seed + i, progress
                    )
                except Exception as exc:  # noqa: BLE001 - reported, the drill goes on
                    errors[sc.name] = f"{type(exc).__name__}: {exc}"
                    progress(f"{sc.name}: FAILED TO RUN: {errors[sc.name]}")
                    continue
                rows.append(row)
                details[sc.name] = extra
        finally:
            progress("stopping kvgate up")
            await asyncio.to_thread(stack.stop)
    if not args.keep_state and not errors:  # only what the drill made
        for state in states:
            shutil.rmtree(state, ignore_errors=True)
        if not args.state_dir:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "rows": rows,
        "details": details,
        "errors": errors,
        "state_dir": str(root),
        "timing": timing.__dict__,
        "load": shape.__dict__,
        "seconds": round(time.monotonic() - progress.t0, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python -m bench.fault_drill",
        description=doc.split("\n\n", 1)[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenarios",
        default="",
        help=f"comma-separated scenario names (default: all): {', '.join(SCENARIOS)}",
    )
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    p.add_argument("--quick", action="store_true", help="shorter faults and phases")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument(
        "--indexers", type=int, default=2, help="indexers, at least (default 2: the HA pair)"
    )
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument(
        "--stream-share", type=float, default=0.5, help="share of streamed requests (0.5)"
    )
    p.add_argument("--before-s", type=float, help="load before the fault (5 s; --quick 3 s)")
    p.add_argument("--after-s", type=float, help="load after the fault (15 s; --quick 8 s)")
    p.add_argument("--hold-s", type=float, help="every held fault lasts this long (override)")
    p.add_argument("--seed", type=int, default=0, help="clients' random seed")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results folder ({RESULTS})")
    p.add_argument(
        "--state-dir",
        help="the stacks' state folders (stack-0, ...) go here (default: a temp dir)",
    )
    p.add_argument(
        "--keep-state", action="store_true", help="keep the state (logs) after a clean run"
    )
    p.add_argument(
        "--up-arg",
        action="append",
        help="an extra argument for kvgate up (repeat it), e.g. --up-arg=--database-url=URL",
    )
    return p.parse_args(argv)


def pick(names: str) -> list[Scenario]:
    if not names.strip():
        return list(SCENARIOS.values())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in wanted]


def save(result: dict[str, Any], out: Path, argv: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"fault-drill-{stamp}.json"
    doc = {
        **result,
        "rows": [r.to_dict() for r in result["rows"]],
        "argv": argv,
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list:
        for sc in SCENARIOS.values():
            hold = f"{sc.hold_s:.0f} s (quick {sc.quick_hold_s:.0f} s)" if sc.hold_s else "-"
            print(f"{sc.name:16} {sc.what}; hold {hold}")
        return 0
    # the drill's own NATS client would log its reconnects through a NATS fault
    configure_logging("fault-drill", "error")
    result = asyncio.run(drill(args, pick(args.scenarios)))
    path = save(result, args.out, argv)
    print()
    print(markdown(result["rows"]))
    for name, err in result["errors"].items():
        print(f"\n{name}: did not run to the end: {err} (state kept in {result['state_dir']})")
    print(f"\n{len(result['rows'])} scenario(s) in {result['seconds']:.0f} s; results: {path}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
