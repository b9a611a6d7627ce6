"""What OpenTelemetry tracing adds to a request through ``kvgate router`` (services/common/
tracing.py), end to end, with the proxy bench's parts (``bench.bench_router``: its
instant-answer worker, its request, its latency and load loops, its CPU accounting).

Targets, each its own router process on its own subject prefix of one embedded NATS, all in
front of the same worker:

- ``base``: the router of a tree without tracing (``--base-tree DIR``, e.g. the commit before
  it unpacked with ``git archive``); without it the bench compares against ``off`` only;
- ``off``: this tree, tracing off (the default);
- ``1%`` / ``100%``: ``--otel true --otel-sample-ratio 0.01 / 1``, spans exported over OTLP/HTTP
  (batched, ``OTEL_BSP_*`` defaults) to a sink in its own process that answers 200 and counts
  what it got, as a collector would.

Interleaved pairs: every round each target in turn (a new random order each round) answers
``--requests`` sequential requests (p50 latency at one connection) and ``--seconds`` of load at
``--conns`` connections (the router's CPU per request, from /proc: user + system). Each
round's figures are compared with the same round's reference (``base``, else ``off``), so a
difference is not that of two minutes of a noisy machine; the median of the rounds' differences
is reported, with their range.

The end-to-end figures move with everything else on the machine (sockets, the worker, the
load generator); ``path`` measures the request path alone, to the microsecond: the router's
own ``RequestPath.handle`` in one process, ``--requests`` sequential requests of the proxy
bench's body through the real parser, admission, decision, dispatch, sender and outcome
recorder, the worker's answer coming from a stub in place of the socket (``FastClient.post``),
spans exported over OTLP/HTTP to the sink by the SDK's batch processor; the wall and CPU time
per request (all threads: the exporter's included), each target in its own process, in
interleaved rounds as above.

    python -m bench.tracing_overhead --base-tree /tmp/kvgate-base --rounds 6
    python -m bench.tracing_overhead --modes whole,stream --rounds 4 --seconds 4
    python -m bench.tracing_overhead path --base-tree /tmp/kvgate-base --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.bench_router import (
    MODES,
    _free_port,
    _latency,
    _spawn,
    _throughput_run,
    _tree_cpu_s,
    _wait_http,
    heartbeat_worker,
    pct,
)

RESULTS = Path(__file__).parent / "results" / "tracing"


def serve_sink(port: int) -> None:
    """An OTLP/HTTP trace receiver that keeps nothing: 200 to every export, bytes and spans
    counted (``GET /count``)."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    seen = {"exports": 0, "spans": 0, "bytes": 0}

    async def export(r: web.Request) -> web.Response:
        data = await r.read()
        req = ExportTraceServiceRequest()
        req.ParseFromString(data)
        seen["exports"] += 1
        seen["bytes"] += len(data)
        seen["spans"] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def count(_r: web.Request) -> web.Response:
        return web.json_response(seen)

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


TARGETS = {  # name -> (extra router flags, traced)
    "off": ([], False),
    "1%": (["--otel", "true", "--otel-sample-ratio", "0.01"], True),
    "100%": (["--otel", "true", "--otel-sample-ratio", "1"], True),
}


async def run(
    base_tree: Path | None,
    modes: tuple[str, ...],
    rounds: int,
    requests: int,
    seconds: float,
    conns: int,
    seed: int,
) -> dict[str, Any]:
    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats, env_without_proxy
    from services.common.subjects import Subjects

    env = env_without_proxy()
    for v in [k for k in env if k.startswith("OTEL_")]:
        env.pop(v)  # the targets' tracing is what the bench sets, nothing inherited
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-tracing-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    procs: list[subprocess.Popen] = []
    beat_task = None
    bus = None
    try:
        wport, sport = _free_port(), _free_port()
        me = [sys.executable, "-m"]
        procs.append(_spawn([*me, "bench.bench_router", "worker", "--port", str(wport)], env))
        procs.append(_spawn([*me, "bench.tracing_overhead", "sink", "--port", str(sport)], env))
        wurl, sink = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{sport}"
        await _wait_http(wurl + "/health", 20)
        await _wait_http(sink + "/count", 20)
        prefixes: list[Subjects] = []
        bus = Bus(nats.url, "bench", Subjects("benchtracing"))
        await bus.connect(max_wait_s=10)
        beat_task = asyncio.create_task(heartbeat_worker(bus, wurl, prefixes))
        targets: dict[str, tuple[list[str], bool, Path | None]] = {}
        if base_tree is not None:
            targets["base"] = ([], False, base_tree)
        for name, (flags, traced) in TARGETS.items():
            targets[name] = (flags, traced, None)
        urls: dict[str, str] = {}
        pids: dict[str, int] = {}
        for name, (flags, traced, tree) in targets.items():
            rport = _free_port()
            prefix = f"benchtracing-{len(prefixes)}"
            prefixes.append(Subjects(prefix))
            renv = dict(env)
            if tree is not None:  # the other tree's code first on the path, run from there
                renv["PYTHONPATH"] = str(tree)
            if traced:
                renv["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
            argv = [*me, "services.cli", "router", "--port", str(rport), "--nats-url", nats.url]
            argv += ["--subject-prefix", prefix, "--log-level", "warning", *flags]
            procs.append(_spawn(argv, renv, cwd=str(tree) if tree is not None else None))
            url = f"http://127.0.0.1:{rport}"
            await _wait_http(url + "/health", 30, lambda j: j.get("workers", 0) >= 1)
            urls[name], pids[name] = url + "/v1/completions", procs[-1].pid
        ref = "base" if "base" in targets else "off"
        rng = random.Random(seed)
        results: dict[str, Any] = {"reference": ref, "rounds": rounds, "modes": {}}
        for mode in modes:
            body = MODES[mode]
            per: dict[str, dict[str, list[float]]] = {
                n: {"p50_us": [], "cpu_us": []} for n in targets
            }
            for _ in range(rounds):
                order = list(targets)
                rng.shuffle(order)
                for name in order:
                    lat = await _latency(urls[name], requests, body)
                    cpu0 = _tree_cpu_s(pids[name])
                    done, _el, errs = await _throughput_run(urls[name], conns, seconds, body)
                    assert errs == 0, (name, errs)
                    per[name]["p50_us"].append(pct(lat, 50) * 1e6)
                    per[name]["cpu_us"].append((_tree_cpu_s(pids[name]) - cpu0) / done * 1e6)
            results["modes"][mode] = _summarise(per, ref)
            _print(mode, results["modes"][mode], ref)
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(sink + "/count") as r:
            results["sink"] = await r.json()
        print(f"OTLP sink received: {results['sink']}")
        with contextlib.suppress(OSError):
            results["load_average"] = os.getloadavg()
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return results
    finally:
        if beat_task is not None:
            beat_task.cancel()
            with contextlib.suppress(BaseException):
                await beat_task
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        for p in reversed(procs):  # the routers first: they flush their spans to the sink
            p.terminate()
            with contextlib.suppress(Exception):
                p.wait(10)
        nats.stop()


# One target of the ``path`` bench, run with the tree under test first on the path (the base
# tree has no tracing module: this is the only code both trees run). argv: ratio ("off": no
# tracing set up), requests.
PATH_CHILD = r"""
import asyncio, json, random, sys, time

ratio, n = sys.argv[1], int(sys.argv[2])


async def main():
    from bench.bench_router import BODY, offline_router
    from services.core.index import PrefixIndex
    from services.router.http_server import Headers, Request
    from services.router.upstream import Response as Upstream

    if ratio != "off":
        from services.common import tracing

        class St:
            otel = True
            otel_sample_ratio = float(ratio)

        assert tracing.setup("router", St())
    router = offline_router(PrefixIndex(), ["w0"], 16, random.Random(1))
    s = router.state.states["w0"]
    s.inflight = s.pending_prefill_tokens = 0
    answer = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0,
        "model": "m", "choices": [{"index": 0, "text": "ok ok ok ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104}}).encode()

    async def post(base, path, body, headers, timeout):  # the worker, without the socket
        return Upstream(200, {"content-type": "application/json"}, answer)

    router.fast.post = post
    body = json.dumps(BODY).encode()
    headers = Headers({"host": "127.0.0.1", "content-type": "application/json",
                       "content-length": str(len(body))})
    path = router.path

    async def one():
        req = Request(None, "POST", "/v1/completions", "", headers, "1.1", True)
        req._body = body
        r = await path.handle(req, chat=False)
        assert r.status == 200, r.body
        await asyncio.sleep(0)  # the request's settling (release, outcome) runs now

    for _ in range(2000):
        await one()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        await one()
    w1, c1 = time.perf_counter(), time.process_time()
    print(json.dumps({"wall_us": (w1 - w0) / n * 1e6, "cpu_us": (c1 - c0) / n * 1e6}))


asyncio.run(main())
"""


def run_path(base_tree: Path | None, rounds: int, requests: int, seed: int) -> dict[str, Any]:
    """The ``path`` bench: each target in a new process per round, interleaved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    sport = _free_port()
    sink = f"http://127.0.0.1:{sport}"
    me = [sys.executable, "-m"]
    sink_proc = _spawn([*me, "bench.tracing_overhead", "sink", "--port", str(sport)], env)
    try:
        asyncio.run(_wait_http(sink + "/count", 20))
        here = str(Path(__file__).resolve().parent.parent)
        targets: dict[str, tuple[str, str]] = {}  # name -> (tree, ratio)
        if base_tree is not None:
            targets["base"] = (str(base_tree), "off")
        targets.update({"off": (here, "off"), "1%": (here, "0.01"), "100%": (here, "1")})
        rng = random.Random(seed)
        per: dict[str, dict[str, list[float]]] = {n: {"p50_us": [], "cpu_us": []} for n in targets}
        for _ in range(rounds):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                tree, ratio = targets[name]
                cenv = {**env, "PYTHONPATH": tree, "OTEL_EXPORTER_OTLP_ENDPOINT": sink}
                out = subprocess.run(
                    [sys.executable, "-c", PATH_CHILD, ratio, str(requests)],
                    env=cenv,
                    cwd=tree,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                # (the wall time per request stands in the p50 column: one loop, no spread)
                per[name]["p50_us"].append(got["wall_us"])
                per[name]["cpu_us"].append(got["cpu_us"])
        ref = "base" if "base" in targets else "off"
        res = _summarise(per, ref)
        print("\n[path] wall time per request in the p50 columns")
        _print("path", res, ref)
        import urllib.request

        with urllib.request.urlopen(sink + "/count", timeout=10) as r:
            seen = json.loads(r.read())
        print(f"OTLP sink received: {seen}")
        return {"reference": ref, "rounds": rounds, "requests": requests, "path": res, "sink": seen}
    finally:
        sink_proc.terminate()
        with contextlib.suppress(Exception):
            sink_proc.wait(10)


def _summarise(per: dict[str, dict[str, list[float]]], ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, xs in per.items():
        row: dict[str, Any] = {
            "p50_us": statistics.median(xs["p50_us"]),
            "cpu_us_per_request": statistics.median(xs["cpu_us"]),
        }
        if name != ref:
            for k, key in (("p50_us", "added_p50_us"), ("cpu_us", "added_cpu_us")):
                d = [a - b for a, b in zip(xs[k], per[ref][k], strict=True)]
                row[key] = statistics.median(d)
                row[key + "_range"] = [min(d), max(d)]
        row["rounds"] = xs
        out[name] = row
    return out


def _print(mode: str, res: dict[str, Any], ref: str) -> None:
    print(f"\n[{mode}] median of the rounds; added = median of (target - {ref}) per round [range]")
    print(f"{'target':8s} {'1-conn p50':>11s} {'added':>24s} {'CPU/request':>12s} {'added':>24s}")
    for name, r in res.items():
        if name == ref:
            added_p50 = added_cpu = "(reference)"
        else:
            lo, hi = r["added_p50_us_range"]
            added_p50 = f"{r['added_p50_us']:+7.1f} [{lo:+.1f}, {hi:+.1f}]"
            lo, hi = r["added_cpu_us_range"]
            added_cpu = f"{r['added_cpu_us']:+7.1f} [{lo:+.1f}, {hi:+.1f}]"
        print(
            f"{name:8s} {r['p50_us']:9.1f}us {added_p50:>24s} "
            f"{r['cpu_us_per_request']:10.1f}us {added_cpu:>24s}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tracing_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd")
    sk = sub.add_parser("sink", help="(internal) the OTLP/HTTP sink process")
    sk.add_argument("--port", type=int, required=True)
    pa = sub.add_parser("path", help="the request path alone, in process (see above)")
    pa.add_argument("--base-tree", type=Path, help="a kvgate tree without tracing (reference)")
    pa.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    pa.add_argument("--requests", type=int, default=20_000, help="requests per target per round")
    pa.add_argument("--seed", type=int, default=1, help="seed of the rounds' orders")
    pa.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--base-tree", type=Path, help="a kvgate tree without tracing (reference)")
    ap.add_argument("--modes", default="whole", help="comma-separated: whole, stream")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    ap.add_argument(
        "--requests", type=int, default=1000, help="sequential requests per target per round"
    )
    ap.add_argument("--seconds", type=float, default=3.0, help="load per target per round")
    ap.add_argument("--conns", type=int, default=16, help="connections of the load")
    ap.add_argument("--seed", type=int, default=1, help="seed of the rounds' orders")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.cmd == "sink":
        serve_sink(args.port)
        return 0
    if args.cmd == "path":
        res = run_path(args.base_tree, args.rounds, args.requests, args.seed)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))
        return 0
    if args.base_tree is not None and not (args.base_tree / "services" / "cli.py").exists():
        ap.error(f"--base-tree {args.base_tree}: no services/cli.py there")
    modes = tuple(m for m in args.modes.split(",") if m)
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (whole, stream)")
    res = asyncio.run(
        run(
            args.base_tree,
            modes,
            args.rounds,
            args.requests,
            args.seconds,
            args.conns,
            args.seed,
        )
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
