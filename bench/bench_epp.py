"""``kvgate epp`` beside ``kvgate router`` in one run (issue 39): what picking an endpoint for
a gateway costs against proxying the request.

A real gRPC client plays Envoy's part (the same generated ``envoy.service.ext_proc.v3``
protos, one ext_proc stream per HTTP request, FULL_DUPLEX_STREAMED as a GIE gateway
configures it): request headers, the body in one chunk, then the worker's answer as the
gateway would relay it (response headers with the served endpoint, the body: one chunk for a
``whole`` answer, or the same 24 one-token SSE chunks + usage + [DONE] as
``bench.bench_router``'s worker writes for ``stream``, one ext_proc message each). Every answer
is read back before the next message goes, as Envoy waits for it.

Per mode and run, side by side, each target in its own process on the same 2 cores:

- ``kvgate router`` (``bench.bench_router``'s measurement: an instant-answer worker, added p50
  at one connection over the direct call, throughput at ``--conns`` connections and the
  router's CPU per request, all its threads, from /proc);
- ``kvgate epp`` with the same policy: the pick's round trip p50 at one stream (what the
  gateway waits before it forwards the request: the EPP's added latency, including this
  Python client's own send and receive), the whole ext_proc stream's p50, picks per second at
  1 and ``--conns`` concurrent streams and the EPP's CPU per request at ``--conns`` streams;
- ``epp-nobody``: the same EPP, the gateway sending no response body (response_body_mode
  NONE: the pick and the response headers only; TTFT, ITL and usage are then not learnt);
- ``grpc-floor``: a do-nothing ext_proc server in the same grpcio (``python -m
  bench.bench_epp null``: a constant pick, every message answered as the EPP answers it, no
  decision, no state): what the protocol itself costs a Python gRPC server per request;

and the ratio EPP CPU / router CPU per request (target ≤ 1/3) and the pick's p50 (target
≤ 0.3 ms), also as the part over the do-nothing server's p50 (this client's own time and the
protocol's floor taken out).

    python -m bench.bench_epp                          # whole + stream, 3 runs
    python -m bench.bench_epp --modes whole --runs 5 --seconds 6
    python -m bench.bench_epp --profile DIR            # the EPP under cProfile (DIR/epp-*.prof)
    python -m bench.bench_epp null --port 9009          # only the do-nothing ext_proc server

Where the EPP's CPU goes (its own work by step, decide, tokenize, the gRPC floor):
``python -m bench.epp_breakdown``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_router import (
    MODES,
    STREAM_TOKENS,
    _free_port,
    _machine_ns,
    _measure_targets,
    _spawn,
    _tree_cpu_s,
    _wait_http,
    heartbeat_worker,
    pct,
    start_bench_worker,
)
from bench.common import write_result
from services.core.policy import DEFAULT_POLICY

RESULTS = Path(__file__).parent / "results" / "epp"
TARGET_CPU_RATIO = 1 / 3
TARGET_PICK_P50_MS = 0.3


# ================================================================= the gateway's messages
def _answer_chunks(mode: str) -> tuple[str, list[bytes]]:
    """The content type and body chunks ``bench.bench_router``'s worker answers ``mode`` with
    (the bytes a gateway relays through the EPP's response path)."""
    whole = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": "ok ok ok ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104},
    }
    if mode == "whole":
        return "application/json", [json.dumps(whole).encode()]

    def chunk(choices: list[Any], usage: dict[str, int] | None = None) -> bytes:
        c: dict[str, Any] = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": choices,
        }
        if usage is not None:
            c["usage"] = usage
        return b"data: " + json.dumps(c).encode() + b"\n\n"

    tok = [{"index": 0, "text": " ok", "finish_reason": None}]
    last = [{"index": 0, "text": " ok", "finish_reason": "length"}]
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": STREAM_TOKENS,
        "total_tokens": 100 + STREAM_TOKENS,
    }
    chunks = [chunk(tok) for _ in range(STREAM_TOKENS - 1)] + [chunk(last), chunk([], usage)]
    return "text/event-stream", [*chunks, b"data: [DONE]\n\n"]


class Gateway:
    """Prebuilt ext_proc messages of one kind of request, and one stream driven with them."""

    def __init__(self, channel: Any, mode: str, endpoint: str, response_body: bool) -> None:
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        from services.epp import protocol as P

        self.stub = pb_grpc.ExternalProcessorStub(channel)
        body = json.dumps(MODES[mode]).encode()

        def headers(hs: dict[str, str]) -> Any:
            return base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]
            )

        self.request_headers = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=headers(
                    {
                        ":authority": "gateway.example",
                        ":path": "/v1/completions",
                        ":method": "POST",
                        ":scheme": "http",
                        "content-type": "application/json",
                        "content-length": str(len(body)),
                        "user-agent": "bench",
                        "x-forwarded-proto": "http",
                    }
                )
            )
        )
        self.request_body = pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=True)
        )
        ctype, chunks = _answer_chunks(mode)
        self.response_headers = pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=headers({":status": "200", "content-type": ctype}),
                end_of_stream=not response_body,
            )
        )
        self.response_headers.metadata_context.filter_metadata[P.LB_NAMESPACE].fields[
            P.SERVED_KEY
        ].string_value = endpoint
        self.response_body = (
            [
                pb.ProcessingRequest(
                    response_body=pb.HttpBody(body=c, end_of_stream=i == len(chunks) - 1)
                )
                for i, c in enumerate(chunks)
            ]
            if response_body
            else []
        )

    async def one(self) -> tuple[float, bool]:
        """One request's ext_proc stream: (seconds to the pick, picked)."""
        call = self.stub.Process()
        t0 = time.perf_counter()
        await call.write(self.request_headers)
        await call.write(self.request_body)
        first = await call.read()
        t_pick = time.perf_counter() - t0
        if first.WhichOneof("response") != "request_headers":
            call.cancel()
            return t_pick, False
        await call.read()  # the body, sent back
        await call.write(self.response_headers)
        await call.read()
        for m in self.response_body:
            await call.write(m)
            await call.read()
        await call.done_writing()
        await call.read()  # EOF: the EPP ended its side
        return t_pick, True


async def _epp_latency(gw: Gateway, n: int) -> tuple[list[float], list[float]]:
    """``n`` sequential streams (after 100 untimed): pick round trips and whole streams."""
    picks, streams = [], []
    for i in range(n + 100):
        t0 = time.perf_counter()
        t_pick, ok = await gw.one()
        assert ok, "the EPP did not pick"
        if i >= 100:
            picks.append(t_pick)
            streams.append(time.perf_counter() - t0)
    return picks, streams


async def _epp_throughput(gw: Gateway, conns: int, seconds: float) -> tuple[int, float, int]:
    """``conns`` concurrent streams for ``seconds``: (picks, seconds, refusals)."""
    done = refused = 0
    stop_at = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done, refused
        while time.monotonic() < stop_at:
            _, ok = await gw.one()
            if ok:
                done += 1
            else:
                refused += 1

    await asyncio.gather(*(gw.one() for _ in range(conns)))  # warm
    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(conns)))
    return done, time.monotonic() - t0, refused


async def _measure_epp(
    gw: Gateway, pid: int, requests: int, conns: int, seconds: float
) -> dict[str, float]:
    picks, streams = await _epp_latency(gw, requests)
    c0 = _tree_cpu_s(pid)
    n1, el1, _ = await _epp_throughput(gw, 1, seconds / 2)
    cpu1 = _tree_cpu_s(pid) - c0
    c0, own0 = _tree_cpu_s(pid), time.process_time()
    n, el, refused = await _epp_throughput(gw, conns, seconds)
    cpu, own = _tree_cpu_s(pid) - c0, time.process_time() - own0
    return {
        "pick_p50_ms": pct(picks, 50) * 1e3,
        "pick_p99_ms": pct(picks, 99) * 1e3,
        "stream_p50_ms": pct(streams, 50) * 1e3,
        "picks_per_s_1": n1 / el1,
        "cpu_us_per_request_1": cpu1 / max(1, n1) * 1e6,
        "picks_per_s": n / el,
        "cpu_us_per_request": cpu / max(1, n) * 1e6,
        "client_cpu_us_per_request": own / max(1, n) * 1e6,
        "refused": refused,
    }


# ================================================================ the grpc floor
def serve_null(port: int) -> None:
    """A do-nothing ext_proc server (grpc.aio, as ``kvgate epp``): each message answered as
    the EPP answers it (a constant pick and the body sent back, response headers and chunks
    passed), nothing decided, parsed or recorded. The floor of any EPP on this gRPC stack."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from services.epp import protocol as P

    pick = P.pick_response("127.0.0.1:1", None)

    class Null(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_body":
                    yield pick
                    yield P.request_body_response(req.request_body.body)
                elif kind == "response_headers":
                    yield P.RESPONSE_HEADERS_PASS
                elif kind == "response_body":
                    b = req.response_body
                    yield P.response_body_pass(b.body, b.end_of_stream)

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Null(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


# ====================================================================== the run
async def bench(
    requests: int,
    seconds: float,
    conns: int,
    runs: int,
    modes: tuple[str, ...],
    policy: str,
    profile: Path | None,
) -> dict[str, Any]:
    import grpc

    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats, env_without_proxy
    from services.common.subjects import Subjects

    machine_ns = _machine_ns()
    env = env_without_proxy()
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-epp-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    procs: list[subprocess.Popen] = []
    beat_task = None
    bus = None
    channel = null_channel = None
    res: dict[str, Any] = {
        "requests": requests,
        "seconds": seconds,
        "connections": conns,
        "runs": runs,
        "policy": policy,
        "machine_ns": machine_ns,
    }
    try:
        wurl = await start_bench_worker(procs, env)
        worker_pid = procs[-1].pid
        # the router and the EPP each on a subject prefix of its own (two deployments), both
        # hearing the same worker's heartbeats from here
        prefixes = [Subjects("benchepp-router"), Subjects("benchepp-epp")]
        bus = Bus(nats.url, "bench", prefixes[0])
        await bus.connect(max_wait_s=10)
        beat_task = asyncio.create_task(heartbeat_worker(bus, wurl, prefixes))
        common = ["--nats-url", nats.url, "--log-level", "warning", "--policy", policy]
        rport = _free_port()
        procs.append(
            _spawn(
                [sys.executable, "-m", "services.cli", "router", "--port", str(rport)]
                + ["--subject-prefix", "benchepp-router", *common],
                env=env,
            )
        )
        router_pid = procs[-1].pid
        rurl = f"http://127.0.0.1:{rport}"
        await _wait_http(rurl + "/health", 30, lambda j: j.get("workers", 0) >= 1)
        eport, oport = _free_port(), _free_port()
        wrap = (
            [sys.executable, "-m", "cProfile", "-o", str(profile / f"epp-{os.getpid()}.prof")]
            if profile is not None
            else [sys.executable]
        )
        procs.append(
            _spawn(
                [*wrap, "-m", "services.cli", "epp", "--port", str(eport)]
                + ["--operator-port", str(oport), "--subject-prefix", "benchepp-epp", *common],
                env=env,
            )
        )
        epp_pid = procs[-1].pid
        await _wait_http(f"http://127.0.0.1:{oport}/health", 30, lambda j: j.get("workers", 0) >= 1)
        nport = _free_port()
        procs.append(
            _spawn([sys.executable, "-m", "bench.bench_epp", "null", "--port", str(nport)], env=env)
        )
        null_pid = procs[-1].pid
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{eport}")
        null_channel = grpc.aio.insecure_channel(f"127.0.0.1:{nport}")
        await asyncio.wait_for(null_channel.channel_ready(), 20)
        endpoint = wurl.removeprefix("http://")
        pids = {"epp": epp_pid, "epp-nobody": epp_pid, "grpc-floor": null_pid}
        for mode in modes:
            gws = {
                "epp": Gateway(channel, mode, endpoint, True),
                "epp-nobody": Gateway(channel, mode, endpoint, False),
                "grpc-floor": Gateway(null_channel, mode, endpoint, True),
            }
            per_run: list[dict[str, Any]] = []
            for run in range(runs):
                print(f"--- {mode}, run {run + 1}/{runs}", flush=True)
                r: dict[str, Any] = {}
                proxied = await _measure_targets(
                    {"direct": wurl, "kvgate": rurl},
                    {"direct": worker_pid, "kvgate": router_pid},
                    MODES[mode],
                    requests,
                    conns,
                    seconds,
                    mode,
                    worker_pid=worker_pid,
                )
                r["router"] = proxied["kvgate"]
                r["router"]["added_p50_ms"] = (
                    proxied["kvgate"]["p50_ms"] - proxied["direct"]["p50_ms"]
                )
                for name, gw in gws.items():
                    r[name] = await _measure_epp(gw, pids[name], requests, conns, seconds)
                    r[name]["cpu_ratio"] = (
                        r[name]["cpu_us_per_request"] / r["router"]["cpu_us_per_request"]
                    )
                    e = r[name]
                    print(
                        f"[{mode:6s}] {name:10s} pick p50 {e['pick_p50_ms']:.3f} ms  p99 "
                        f"{e['pick_p99_ms']:.3f} ms  stream p50 {e['stream_p50_ms']:.3f} ms  "
                        f"1-stream {e['picks_per_s_1']:,.0f}/s  {conns}-stream "
                        f"{e['picks_per_s']:,.0f}/s  CPU {e['cpu_us_per_request']:.0f} us/request"
                        f" ({e['cpu_ratio']:.2f}x the router's)  refused {e['refused']}",
                        flush=True,
                    )
                per_run.append(r)
            res[mode] = per_run
        _summary(res, modes, conns)
    finally:
        for ch in (channel, null_channel):
            if ch is not None:
                await ch.close()
        if beat_task is not None:
            beat_task.cancel()
        if bus is not None:
            await bus.close()
        for p in reversed(procs):  # the EPP first: under cProfile it writes its profile on exit
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        nats.stop()
    return res


def _summary(res: dict[str, Any], modes: tuple[str, ...], conns: int) -> None:
    print()
    print(
        f"{'mode':6s} {'run':>3s} {'router CPU':>10s} {'router +p50':>11s} | "
        f"{'EPP CPU':>8s} {'÷router':>7s} {'pick p50':>8s} {'-floor':>7s} {'picks/s@1':>9s} "
        f"{f'picks/s@{conns}':>10s} | {'nobody CPU':>10s} {'÷router':>7s} | {'floor CPU':>9s} "
        f"{'÷router':>7s}"
    )
    for mode in modes:
        ratios, p50s, over, floors = [], [], [], []
        for i, r in enumerate(res[mode]):
            ro, e, nb, fl = r["router"], r["epp"], r["epp-nobody"], r["grpc-floor"]
            ratios.append(e["cpu_ratio"])
            p50s.append(e["pick_p50_ms"])
            over.append(e["pick_p50_ms"] - fl["pick_p50_ms"])
            floors.append(fl["cpu_ratio"])
            print(
                f"{mode:6s} {i + 1:3d} {ro['cpu_us_per_request']:8.0f}us "
                f"{ro['added_p50_ms']:9.3f}ms | {e['cpu_us_per_request']:6.0f}us "
                f"{e['cpu_ratio']:7.2f} {e['pick_p50_ms']:6.3f}ms "
                f"{e['pick_p50_ms'] - fl['pick_p50_ms']:5.3f}ms {e['picks_per_s_1']:9,.0f} "
                f"{e['picks_per_s']:10,.0f} | {nb['cpu_us_per_request']:8.0f}us "
                f"{nb['cpu_ratio']:7.2f} | {fl['cpu_us_per_request']:7.0f}us {fl['cpu_ratio']:7.2f}"
            )
        cpu_ok = statistics.median(ratios) <= TARGET_CPU_RATIO
        p50_ok = statistics.median(p50s) <= TARGET_PICK_P50_MS
        print(
            f"{mode}: EPP CPU ÷ router CPU per request, median {statistics.median(ratios):.2f} "
            f"(target <= {TARGET_CPU_RATIO:.2f}: {'PASS' if cpu_ok else 'FAIL'}); pick p50 "
            f"median {statistics.median(p50s):.3f} ms (target <= {TARGET_PICK_P50_MS} ms: "
            f"{'PASS' if p50_ok else 'FAIL'}), {statistics.median(over):.3f} ms over the "
            f"do-nothing server's; the do-nothing server alone costs "
            f"{statistics.median(floors):.2f}x the router's CPU per request"
        )
    print(
        f"machine: CPython runs sum((1,2,3)) in {res['machine_ns']:.0f} ns (best of 5; ~45 on a "
        "normal day of the development VM): absolute figures move with it"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_epp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "what", nargs="?", default="all", choices=["all", "null"], help="null: the floor server"
    )
    ap.add_argument("--port", type=int, default=0, help="(null) port")
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests (latency)")
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds per throughput run")
    ap.add_argument("--conns", type=int, default=64, help="concurrent streams / connections")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (router and EPP in turn)")
    ap.add_argument("--modes", default="whole,stream", help="whole and/or stream")
    ap.add_argument(
        "--policy", default=DEFAULT_POLICY["name"], help="the policy of both the router and EPP"
    )
    ap.add_argument(
        "--profile", default="", help="run the EPP under cProfile; its profile goes here"
    )
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON result")
    a = ap.parse_args(argv)
    if a.what == "null":
        serve_null(a.port)
        return 0
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {sorted(MODES)}")
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    prof = Path(a.profile) if a.profile else None
    if prof is not None:
        prof.mkdir(parents=True, exist_ok=True)
    res = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count()}
    res.update(asyncio.run(bench(a.requests, a.seconds, a.conns, a.runs, modes, a.policy, prof)))
    write_result(a.out, "bench_epp", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
