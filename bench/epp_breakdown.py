"""Where the EPP's CPU per request goes, against the router's, in one run (issue 39).

Measured on the same request (``bench.bench_router``'s, one bench worker, the same policy):

- ``router``: ``kvgate router``'s CPU per whole request (its process, from /proc, at
  ``--conns`` connections: ``bench.bench_router``'s measurement);
- ``grpc-floor``: a do-nothing ext_proc server on the EPP's grpcio (``bench.bench_epp null``),
  its CPU per request driven as ``bench.bench_epp`` drives the EPP: what the protocol alone
  costs a Python gRPC server;
- in this process, without gRPC, the EPP's own work over the ext_proc messages the gateway
  sends (prebuilt, as ``bench.bench_epp``'s client sends them), on an EPP core that hears the
  same worker: first the real :meth:`EppStream.on` sequence (the total), then the same steps
  one at a time, each timed on this thread's CPU clock (the timer's own cost taken out):

  ``read``      the request messages read: headers, subset hint, the body chunk;
  ``intake``    tenancy, JSON decode, parse + tokenize, SLO headers, session, canary arm
                (``RequestPath.intake``, the router's own);
  ``admission`` quota, queue and the decision (``Admission.decide_or_wait``, the router's);
  ``dispatch``  ticket, endpoint, circuit, follower hold, counters;
  ``answer``    the pick's ext_proc answers built (header + metadata, the body sent back);
  ``response``  the response's messages read (headers, served endpoint, the body chunks:
                first token, usage) and their pass-through answers built;
  ``settle``    the ticket released, flow control, the outcome recorded;

  and, apart, ``decide()`` alone (``Decider.decide_for`` on the same parsed request and state)
  and parse + tokenize alone (JSON decode and ``RequestParser.parse``): the work both front
  doors share; and ``decide()`` as admission calls it in the staged requests (each one's
  dispatch and release changing the state it reads), with admission's own work beside it.

The router's decide and tokenize are the same code on the same state, so what an EPP in
another language would still pay per request is at least ``decide`` + ``tokenize`` (the
decision core in Python) plus its own protocol floor.

    python -m bench.epp_breakdown                    # whole answers, 3 runs
    python -m bench.epp_breakdown --mode stream --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_epp import Gateway, _measure_epp
from bench.bench_router import (
    MODES,
    _free_port,
    _machine_ns,
    _measure_targets,
    _spawn,
    _wait_http,
    heartbeat_worker,
    start_bench_worker,
)
from bench.common import write_result
from services.core.policy import DEFAULT_POLICY
from services.epp import endpoints
from services.epp import metrics as M
from services.epp import protocol as P
from services.epp.picker import NO_BODY_PATH, Pick, _with_aliases
from services.epp.response_watch import ResponseWatch
from services.router import metrics as RM

RESULTS = Path(__file__).parent / "results" / "epp"
STAGES = ("read", "intake", "admission", "dispatch", "answer", "response", "settle")
_clock = time.thread_time_ns


def _timer_ns() -> float:
    """The cost of one clock read (subtracted once per timed step)."""
    best = float("inf")
    for _ in range(5):
        t0 = _clock()
        for _ in range(10_000):
            _clock()
        best = min(best, (_clock() - t0) / 10_000)
    return best


class Messages:
    """The gateway's messages for one request, prebuilt (``bench.bench_epp.Gateway``'s)."""

    def __init__(self, mode: str, endpoint: str) -> None:
        gw = Gateway(_NoChannel(), mode, endpoint, True)
        self.request = [gw.request_headers, gw.request_body]
        self.response = [gw.response_headers, *gw.response_body]


class _NoChannel:
    """Enough of a gRPC channel for ``Gateway`` to build its stub (never called here)."""

    def unary_unary(self, *a: Any, **k: Any) -> None:
        return None

    stream_stream = unary_stream = stream_unary = unary_unary


async def whole_on(stream_cls: Any, picker: Any, msgs: Messages, max_body: int) -> None:
    """One request through the real ``EppStream`` (as the servicer drives it)."""
    s = stream_cls(picker, max_body)
    try:
        for m in msgs.request:
            await s.on(m)
        for m in msgs.response:
            await s.on(m)
        s.data_plane_closed()
    finally:
        s.close()


async def staged(picker: Any, msgs: Messages, max_body: int, acc: dict[str, int]) -> None:
    """The same request as :meth:`EppStream.on` and :meth:`Picker._pick` take it, step by
    step, each step's CPU added to ``acc`` (ns)."""
    r = picker.router
    t = _clock()
    # read
    hreq, breq = msgs.request
    hreq.WhichOneof("request")
    headers = P.headers_of(hreq.request_headers)
    subset = P.subset_hint(hreq)
    breq.WhichOneof("request")
    body = bytearray()
    body += breq.request_body.body
    if len(body) > max_body:
        raise AssertionError("body over the limit")
    raw = bytes(body)
    t1 = _clock()
    acc["read"] += t1 - t
    # intake
    t0 = time.perf_counter()
    path = headers.get(":path", "").split("?", 1)[0]
    tenancy = r.request_tenancy(headers)
    ctx = await r.path.intake(
        raw, _with_aliases(headers), path, path == "/v1/chat/completions", t0, tenancy
    )
    assert not isinstance(ctx, Exception) and subset is None and ctx.path != NO_BODY_PATH
    t2 = _clock()
    acc["intake"] += t2 - t1
    # admission + decide
    d = await r.admission.decide_or_wait(ctx)
    assert d.worker_id is not None, d
    t3 = _clock()
    acc["admission"] += t3 - t2
    # dispatch
    ticket = r.dispatcher.dispatch(ctx, d)
    endpoint = endpoints.worker_endpoint(r.state, ticket.worker_id)
    assert endpoint is not None
    r.circuits.sent(ticket.worker_id)
    await r.dispatcher.hold(d)
    ctx.sent_at = time.monotonic()
    RM.INFLIGHT.inc()
    M.PICKED.inc()
    M.PICK_SECONDS.observe(time.perf_counter() - t0)
    pick = Pick(ctx, ticket, endpoint, picker._with_fallbacks(endpoint, ctx, d.scores))
    t4 = _clock()
    acc["dispatch"] += t4 - t3
    # answer
    P.pick_response(pick.value, len(raw), None, None)
    P.request_body_response(raw)
    t5 = _clock()
    acc["answer"] += t5 - t4
    # response
    rh, *chunks = msgs.response
    rh.WhichOneof("request")
    ctx.http_status, ctype = P.status_and_type(rh.response_headers)
    watch = ResponseWatch(ctx, "text/event-stream" in ctype)
    served = P.served_endpoint(rh)
    if served:
        picker.served_by(pick, served)
    finished = False
    for m in chunks:
        m.WhichOneof("request")
        chunk, end = m.response_body.body, m.response_body.end_of_stream
        if chunk and ctx.ttft is None:
            picker.first_token(pick)
        watch.chunk(chunk, end)
        finished = finished or end
        P.response_body_pass(chunk, end)
    t6 = _clock()
    acc["response"] += t6 - t5
    picker.settle(pick, finished)
    acc["settle"] += _clock() - t6


async def shared_parts(r: Any, msgs: Messages, n: int) -> dict[str, float]:
    """``decide()`` alone and parse + tokenize alone, ns each, over ``n`` requests."""
    from services.router.request_path import _json_decode

    raw = msgs.request[1].request_body.body
    pol = r.policies.control
    parsed = await r.parser.parse(_json_decode(raw), False, "/v1/completions")
    t = _clock()
    for i in range(n):
        r.decider.decide_for(parsed, f"b{i}", None, pol, set())
    decide = (_clock() - t) / n
    t = _clock()
    for _ in range(n):
        await r.parser.parse(_json_decode(raw), False, "/v1/completions")
    tokenize = (_clock() - t) / n
    return {"decide": decide, "tokenize": tokenize}


async def epp_parts(picker: Any, msgs: Messages, n: int, timer: float) -> dict[str, float]:
    """The EPP's own work per request, µs: the real stream's total, then each step, then the
    shared parts; steps and total interleaved in blocks so both see the same minutes."""
    from services.epp.stream import EppStream

    max_body = 1 << 20
    for _ in range(200):  # warm
        await whole_on(EppStream, picker, msgs, max_body)
        await staged(picker, msgs, max_body, dict.fromkeys(STAGES, 0))
    acc = dict.fromkeys(STAGES, 0)
    total = 0
    done = 0
    block = 250
    while done < n:
        t = _clock()
        for _ in range(block):
            await whole_on(EppStream, picker, msgs, max_body)
        total += _clock() - t
        for _ in range(block):
            await staged(picker, msgs, max_body, acc)
        done += block
        await asyncio.sleep(0)  # the heartbeats (none of the steps waits on the loop)
    out = {k: max(0.0, v / done - timer) / 1e3 for k, v in acc.items()}
    out["steps_sum"] = sum(out[k] for k in STAGES)
    out["total"] = total / done / 1e3
    shared = await shared_parts(picker.router, msgs, n)
    out["decide"] = shared["decide"] / 1e3
    out["tokenize"] = shared["tokenize"] / 1e3
    out["decide_in_flow"], out["admission_own"] = await decide_in_flow(picker, msgs, n, timer)
    return out


async def decide_in_flow(picker: Any, msgs: Messages, n: int, timer: float) -> tuple[float, float]:
    """``decide()`` (``Decider.decide_for``) as admission calls it in the staged requests,
    between dispatches and releases that change the state it reads (its caches kept warm
    by ``shared_parts``'s loop are not), and admission's own work beside it, µs each: a pass
    of its own, since timing the call adds a clock read to the admission step."""
    decider = picker.router.decider
    inner = decider.decide_for
    spent = [0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = _clock()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += _clock() - t

    acc = dict.fromkeys(STAGES, 0)
    decider.decide_for = timed
    try:
        for i in range(n):
            await staged(picker, msgs, 1 << 20, acc)
            if i % 250 == 249:
                await asyncio.sleep(0)
    finally:
        del decider.decide_for  # the class's method again
    decide = max(0.0, spent[0] / n - timer) / 1e3
    # the admission step's interval holds its own clock read and the wrapper's two
    return decide, max(0.0, acc["admission"] / n - 3 * timer) / 1e3 - decide


async def _profile(picker: Any, msgs: Messages, n: int, path: Path) -> None:
    """``n`` requests through the real ``EppStream`` under cProfile (written to ``path``)."""
    import cProfile
    import pstats

    from services.epp.stream import EppStream

    for _ in range(200):
        await whole_on(EppStream, picker, msgs, 1 << 20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        await whole_on(EppStream, picker, msgs, 1 << 20)
    prof.disable()
    prof.dump_stats(str(path))
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


async def bench(
    requests: int,
    seconds: float,
    conns: int,
    runs: int,
    mode: str,
    policy: str,
    n: int,
    profile: Path | None = None,
) -> dict[str, Any]:
    import grpc

    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats, env_without_proxy
    from services.common.subjects import Subjects
    from services.epp.cli import settings as epp_settings
    from services.epp.picker import Picker
    from services.router.app import Router, freeze_startup_heap

    env = env_without_proxy()
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-eppbd-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    procs: list[subprocess.Popen] = []
    beat_task = bus = router = channel = None
    res: dict[str, Any] = {"mode": mode, "policy": policy, "machine_ns": _machine_ns(), "runs": []}
    try:
        wurl = await start_bench_worker(procs, env)
        worker_pid = procs[-1].pid
        prefixes = [Subjects("benchbd-router"), Subjects("benchbd-epp")]
        bus = Bus(nats.url, "bench", prefixes[0])
        await bus.connect(max_wait_s=10)
        beat_task = asyncio.create_task(heartbeat_worker(bus, wurl, prefixes))
        rport = _free_port()
        procs.append(
            _spawn(
                [sys.executable, "-m", "services.cli", "router", "--port", str(rport)]
                + ["--subject-prefix", "benchbd-router", "--nats-url", nats.url]
                + ["--log-level", "warning", "--policy", policy],
                env=env,
            )
        )
        router_pid = procs[-1].pid
        rurl = f"http://127.0.0.1:{rport}"
        nport = _free_port()
        procs.append(
            _spawn([sys.executable, "-m", "bench.bench_epp", "null", "--port", str(nport)], env=env)
        )
        null_pid = procs[-1].pid
        # the EPP's core in this process, on its own bus connection and prefix
        st = epp_settings(nats_url=nats.url, subject_prefix="benchbd-epp", policy=policy)
        ebus = Bus(nats.url, "epp-bench", prefixes[1])
        await ebus.connect(max_wait_s=10)
        router = Router(st, ebus)
        await router.start()
        picker = Picker(router)
        await _wait_http(rurl + "/health", 30, lambda j: j.get("workers", 0) >= 1)
        for _ in range(200):
            if router.state.routable_count() >= 1:
                break
            await asyncio.sleep(0.05)
        assert router.state.routable_count() >= 1, "the EPP core heard no worker"
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{nport}")
        await asyncio.wait_for(channel.channel_ready(), 20)
        endpoint = wurl.removeprefix("http://")
        floor_gw = Gateway(channel, mode, endpoint, True)
        msgs = Messages(mode, endpoint)
        freeze_startup_heap()  # as kvgate epp does once started
        timer = _timer_ns()
        if profile is not None:
            await _profile(picker, msgs, n, profile)
        for run in range(runs):
            print(f"--- {mode}, run {run + 1}/{runs}", flush=True)
            proxied = await _measure_targets(
                {"kvgate": rurl},
                {"kvgate": router_pid},
                MODES[mode],
                requests,
                conns,
                seconds,
                mode,
                worker_pid=worker_pid,
            )
            floor = await _measure_epp(floor_gw, null_pid, requests, conns, seconds)
            parts = await epp_parts(picker, msgs, n, timer)
            row = {
                "router_cpu_us": proxied["kvgate"]["cpu_us_per_request"],
                "floor_cpu_us": floor["cpu_us_per_request"],
                **{f"epp_{k}_us": v for k, v in parts.items()},
            }
            res["runs"].append(row)
            _print_run(run + 1, row)
        if res["runs"]:
            _summary(res)
    finally:
        if channel is not None:
            await channel.close()
        if beat_task is not None:
            beat_task.cancel()
        if router is not None:
            await router.stop()
        for b in (bus, locals().get("ebus")):
            if b is not None:
                await b.close()
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        nats.stop()
    return res


def _print_run(run: int, row: dict[str, float]) -> None:
    steps = "  ".join(f"{k} {row[f'epp_{k}_us']:.1f}" for k in STAGES)
    print(
        f"run {run}: router {row['router_cpu_us']:.0f} us/request (decide {row['epp_decide_us']:.1f},"
        f" in the flow {row['epp_decide_in_flow_us']:.1f},"
        f" tokenize {row['epp_tokenize_us']:.1f}); grpc floor {row['floor_cpu_us']:.0f} us; EPP own"
        f" work {row['epp_total_us']:.1f} us (steps: {steps}; sum {row['epp_steps_sum_us']:.1f})",
        flush=True,
    )


SHARED = ("intake", "admission", "dispatch", "settle")  # the router's own code, run by both
OWN = ("read", "answer", "response")  # the ext_proc messages read and answered


def _summary(res: dict[str, Any]) -> None:
    rows = res["runs"]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    router, floor, own = med("router_cpu_us"), med("floor_cpu_us"), med("epp_total_us")
    decide, tok = med("epp_decide_us"), med("epp_tokenize_us")
    shared = sum(med(f"epp_{k}_us") for k in SHARED)
    specific = sum(med(f"epp_{k}_us") for k in OWN)
    third = router / 3
    print()
    print(f"medians over {len(rows)} runs, µs per {res['mode']} request:")
    print(f"  router, its whole CPU per request     {router:7.1f}  (1/3 of it: {third:.1f})")
    print(f"  EPP own work without gRPC (EppStream) {own:7.1f}")
    for k in STAGES:
        print(f"    {k:10s}                          {med(f'epp_{k}_us'):7.1f}")
    print(f"  of which the router's shared core     {shared:7.1f}  ({' + '.join(SHARED)})")
    print(f"    decide() alone                      {decide:7.1f}")
    print(
        f"    decide() in the flow (in admission) {med('epp_decide_in_flow_us'):7.1f}"
        f"  (admission's own work beside it: {med('epp_admission_own_us'):.1f})"
    )
    print(f"    parse + tokenize alone              {tok:7.1f}")
    print(f"  of which ext_proc reading / answers   {specific:7.1f}  ({' + '.join(OWN)})")
    print(f"  Python gRPC floor (do-nothing server) {floor:7.1f}  ({floor / router:.2f}x)")
    print(
        f"  own work + floor                      {own + floor:7.1f}  ({(own + floor) / router:.2f}x)"
    )
    print(
        f"  a native ext_proc front end, protocol cost aside: calling kvgate's Python core as "
        f"it is >= {shared:.1f} ({shared / router:.2f}x); calling only decide() and the "
        f"tokenizer >= {decide + tok:.1f} ({(decide + tok) / router:.2f}x); target "
        f"<= {third:.1f} (0.33x)"
    )
    print(f"machine: sum((1,2,3)) {res['machine_ns']:.0f} ns (~45 on a normal day)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.epp_breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--mode", default="whole", choices=sorted(MODES), help="the answer's kind")
    ap.add_argument("--runs", type=int, default=3, help="runs (router, floor, EPP parts in turn)")
    ap.add_argument("--requests", type=int, default=300, help="sequential requests (latency)")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of load per target")
    ap.add_argument("--conns", type=int, default=64, help="concurrent streams / connections")
    ap.add_argument("--n", type=int, default=3000, help="requests per in-process measurement")
    ap.add_argument("--policy", default=DEFAULT_POLICY["name"], help="the policy of both")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON result")
    ap.add_argument(
        "--profile", default="", help="first profile the EPP's own work (cProfile) into this file"
    )
    a = ap.parse_args(argv)
    if a.runs < (0 if a.profile else 1) or a.n < 1:
        ap.error("--runs (0 only with --profile) and --n must be at least 1")
    res = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
    res.update(
        asyncio.run(
            bench(
                a.requests,
                a.seconds,
                a.conns,
                a.runs,
                a.mode,
                a.policy,
                a.n,
                Path(a.profile) if a.profile else None,
            )
        )
    )
    write_result(a.out, "epp_breakdown", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
