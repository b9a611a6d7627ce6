"""Router benchmarks (issue 5), side by side in one run; results recorded in docs/router.md.

1. **decision**: the router's own decision path (parse + tokenize a 4096-token prompt, lazy
   prefix match against a PrefixIndex of 1 M blocks over 64 workers, kv_aware over 64 worker
   states) through the live router's code (``Decider.decide_for``), N times: p50 / p99.
   Target p50 <= 150 us.
2. **proxy**: an instant-answer worker (separate process), then the same requests sent
   directly, through ``kvgate router`` and through ``sglang-router`` (cache_aware), in this run:
   added p50 latency at 1 connection (target <= 1 ms) and throughput at 64 connections
   (target >= 0.6x sglang-router's).

    python -m bench.bench_router                 # everything
    python -m bench.bench_router decision        # only the decision path
    python -m bench.bench_router proxy --seconds 10 --requests 2000
    python -m bench.bench_router proxy --tls --no-sglang   # + the same router over https

With ``--tls`` the proxy bench adds the router serving https itself (``--tls-cert``, a
self-signed P-256 certificate): the same load, plain and TLS side by side.

All traffic goes to 127.0.0.1. NATS for our router is a private embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "router"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# =============================================================================== decision
# ours and the peers' rules (built-in baselines), timed on the same decision
COMPARED_POLICIES = (
    "kv_aware",
    "slo_aware",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd_default",
    "llmd_kv_util",
)


def bench_decision(iters: int, workers: int = 64, blocks: int = 1_000_000) -> dict[str, Any]:
    from services.common.bus import Bus
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat
    from services.core.index import PrefixIndex
    from services.core.keys import block_keys
    from services.router.app import Router
    from services.router.cli import settings

    rng = random.Random(7)
    bs = 16
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(4096))
    ptoks = list(prompt.encode())
    pkeys = block_keys(ptoks, bs)
    index = PrefixIndex()
    wids = [f"w{i:02d}" for i in range(workers)]
    # 8 workers hold the prompt's first 64 blocks (a shared system prompt), one holds 200
    for w in wids[:8]:
        index.apply_stored(w, pkeys[:64])
    index.apply_stored(wids[8], pkeys[:200])
    per = (blocks - len(index)) // workers
    print(f"building index: {blocks:,} blocks over {workers} workers ...", file=sys.stderr)
    for w in wids:
        left = per
        while left > 0:
            n = min(left, 256)
            seed = rng.getrandbits(63)
            index.apply_stored(w, [(seed * 1_000_003 + i) & 0xFFFFFFFFFFFFFFFF for i in range(n)])
            left -= n
    st = settings()

    class Src:
        def __init__(self, idx: PrefixIndex) -> None:
            self.index = idx
            self.ready = True

    router = Router(st, Bus("nats://127.0.0.1:1", "bench"), index_source=Src(index))
    now = time.monotonic()
    cap = WorkerCapacity(block_size=bs, num_gpu_blocks=27_000, max_num_seqs=256, max_model_len=8192)
    for i, w in enumerate(wids):
        router.state.on_heartbeat(
            WorkerHeartbeat(
                worker_id=w,
                instance_id="i",
                url=f"http://127.0.0.1:{9000 + i}",
                model="m",
                capacity=cap,
            ),
            now,
        )
        s = router.state.states[w]
        s.inflight = rng.randint(0, 40)
        s.pending_prefill_tokens = rng.randint(0, 8000)
    body = {"model": "m", "prompt": prompt, "max_tokens": 128}
    policy = router.policies.control

    async def run() -> tuple[list[float], list[float], list[float], list[float]]:
        total, parse, match, dec = [], [], [], []
        from services.core.policy import RequestInfo, decide

        for i in range(iters + 200):
            t0 = time.perf_counter()
            parsed = await router.parser.parse(body, chat=False)
            t1 = time.perf_counter()
            d, _ = router.decider.decide_for(parsed, f"r{i}", None, policy, set())
            t2 = time.perf_counter()
            # components, separately. "hash + prefix match" is the lazy match_prompt path
            # (hashing stops where no worker matches); decide_for hashes the whole chain once
            # when the policy keeps routed memory and matches those keys, so the components
            # need not add up to the total exactly.
            overlaps = router.decider.overlaps(parsed, router.state.states)
            t3 = time.perf_counter()
            req = RequestInfo(f"r{i}", "m", len(parsed.token_ids), 128)
            decide(policy, req, router.state.snapshot, overlaps)
            t4 = time.perf_counter()
            if i >= 200:  # warm-up
                total.append(t2 - t0)
                parse.append(t1 - t0)
                match.append(t3 - t2)
                dec.append(t4 - t3)
        assert d.worker_id is not None
        return total, parse, match, dec

    total, parse, match, dec = asyncio.run(run())
    us = 1e6
    # every routing policy's own cost on the same request and snapshot (the peer baselines'
    # rules beside ours), each on a fresh policy
    from services.core.policy import RequestInfo, build_policy, decide

    parsed = asyncio.run(router.parser.parse(body, chat=False))
    overlaps = router.decider.overlaps(parsed, router.state.states)
    per_policy: dict[str, float] = {}
    for name in COMPARED_POLICIES:
        pol = build_policy({"name": name, "params": {}})
        times = []
        for i in range(iters + 200):
            req = RequestInfo(f"p{i}", "m", len(parsed.token_ids), 128)
            t0 = time.perf_counter()
            decide(pol, req, router.state.snapshot, overlaps)
            if i >= 200:
                times.append(time.perf_counter() - t0)
        per_policy[name] = pct(times, 50) * us
    out = {
        "workers": workers,
        "indexed_blocks": len(index),
        "prompt_tokens": len(ptoks),
        "iters": iters,
        "total_p50_us": pct(total, 50) * us,
        "total_p99_us": pct(total, 99) * us,
        "parse_tokenize_p50_us": pct(parse, 50) * us,
        "prefix_match_p50_us": pct(match, 50) * us,
        "policy_decide_p50_us": pct(dec, 50) * us,
        "target_p50_us": 150,
        "policy_decide_p50_us_by_policy": per_policy,
    }
    print(
        f"decision path (4096-token prompt, {workers} workers, {len(index):,} blocks): "
        f"p50 {out['total_p50_us']:.1f} us, p99 {out['total_p99_us']:.1f} us "
        f"[parse+tokenize {out['parse_tokenize_p50_us']:.1f}, hash + prefix match "
        f"{out['prefix_match_p50_us']:.1f}, {policy.name} decide {out['policy_decide_p50_us']:.1f}] "
        f"target p50 <= 150 us: {'PASS' if out['total_p50_us'] <= 150 else 'FAIL'}"
    )
    print(
        "policy decide p50 (same request and snapshot): "
        + ", ".join(f"{k} {v:.1f} us" for k, v in per_policy.items())
    )
    return out


# =============================================================================== worker
def serve_worker(port: int) -> None:
    """An engine that answers at once (separate process; used by the proxy bench)."""
    from aiohttp import web

    answer = json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": "ok ok ok ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104},
        }
    ).encode()

    async def complete(r: web.Request) -> web.Response:
        await r.read()
        return web.Response(body=answer, content_type="application/json")

    async def ok(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def info(_r: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "tokenizer_path": "m", "is_generation": True})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/generate", complete)
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/model_info", info)
    app.router.add_get("/server_info", info)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# =============================================================================== proxy
async def _wait_http(url: str, timeout: float, pred=None) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    conn = aiohttp.TCPConnector(ssl=_client_tls(url))
    async with aiohttp.ClientSession(connector=conn) as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200 and (pred is None or pred(await r.json(content_type=None))):
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {timeout}s")


BODY = {
    "model": "m",
    "prompt": "The quick brown fox jumps over the lazy dog. " * 2,
    "max_tokens": 8,
}


# the client API key of the "kvgate-keys" router (issue 18: the cost of checking keys)
CLIENT_KEY = "sk-bench-0123456789abcdef"


def _headers(url: str) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if "#key" in url:
        h["Authorization"] = f"Bearer {CLIENT_KEY}"
    return h


def _client_tls(url: str) -> ssl.SSLContext | bool:
    """For an https target: a context trusting the bench's own certificate."""
    return TLS_TRUST.get("ctx", True) if url.startswith("https://") else True


# the https router's certificate, trusted by the load generator (set by bench_proxy)
TLS_TRUST: dict[str, ssl.SSLContext] = {}


def _self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (openssl, P-256), as an operator would make one."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "router.crt", directory / "router.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


async def _latency(url: str, n: int) -> list[float]:
    import aiohttp

    data = json.dumps(BODY).encode()
    lat = []
    conn = aiohttp.TCPConnector(limit=1, ssl=_client_tls(url))
    async with aiohttp.ClientSession(connector=conn) as s:
        for i in range(n + 100):
            t0 = time.perf_counter()
            async with s.post(url.split("#")[0], data=data, headers=_headers(url)) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 100:
                lat.append(time.perf_counter() - t0)
    return lat


async def _throughput(url: str, conns: int, seconds: float) -> tuple[float, int]:
    import aiohttp

    data = json.dumps(BODY).encode()
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds

    async def loop(s: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.monotonic() < stop_at:
            async with s.post(url.split("#")[0], data=data, headers=_headers(url)) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    errors += 1

    conn = aiohttp.TCPConnector(limit=conns, ssl=_client_tls(url))
    async with aiohttp.ClientSession(connector=conn) as s:

        async def warm() -> None:
            async with s.post(url.split("#")[0], data=data, headers=_headers(url)) as r:
                await r.read()

        await asyncio.gather(*(warm() for _ in range(conns)))  # open the connections
        t0 = time.monotonic()
        await asyncio.gather(*(loop(s) for _ in range(conns)))
        el = time.monotonic() - t0
    return done / el, errors


def _spawn(argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, **kw)


def _free_port() -> int:
    from services.common.embedded import free_port

    return free_port()


async def bench_proxy(
    requests: int,
    seconds: float,
    conns: int,
    with_sglang: bool,
    processes: tuple[int, ...] = (1, 2),
    with_tls: bool = False,
) -> dict[str, Any]:
    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat
    from services.common.subjects import Subjects

    procs: list[subprocess.Popen] = []
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost"}
    for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(v, None)
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-router-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    results: dict[str, Any] = {"requests": requests, "seconds": seconds, "connections": conns}
    beat_task = None
    bus = None
    try:
        wport = _free_port()
        procs.append(
            _spawn(
                [sys.executable, "-m", "bench.bench_router", "worker", "--port", str(wport)],
                env=env,
            )
        )
        wurl = f"http://127.0.0.1:{wport}"
        await _wait_http(wurl + "/health", 20)
        # our router(s), with heartbeats for the worker published from here
        prefix = "benchrouter"
        bus = Bus(nats.url, "bench", Subjects(prefix))
        await bus.connect(max_wait_s=10)
        hb = WorkerHeartbeat(
            worker_id="bench-w0",
            instance_id="i0",
            url=wurl,
            model="m",
            capacity=WorkerCapacity(
                block_size=16, num_gpu_blocks=1_000_000, max_num_seqs=4096, max_model_len=8192
            ),
        )

        async def beats() -> None:
            while True:
                hb.ts = time.time()
                await bus.publish(bus.subjects.heartbeat(hb.worker_id), hb)
                await asyncio.sleep(0.5)

        beat_task = asyncio.create_task(beats())
        targets = {"direct": wurl}
        # (name, processes, extra flags): the same router with client API keys checked
        variants = [("kvgate" if n == 1 else f"kvgate-{n}proc", n, []) for n in processes]
        variants.append(("kvgate-keys", 1, ["--api-keys", f"other-key,{CLIENT_KEY}"]))
        if with_tls:  # the same router serving https itself (--tls-cert / --tls-key)
            cert, key = _self_signed_cert(state / "tls")
            TLS_TRUST["ctx"] = ssl.create_default_context(cafile=str(cert))
            variants.append(("kvgate-tls", 1, ["--tls-cert", str(cert), "--tls-key", str(key)]))
        for name, n, extra in variants:
            rport = _free_port()
            procs.append(
                _spawn(
                    [
                        sys.executable,
                        "-m",
                        "services.cli",
                        "router",
                        "--port",
                        str(rport),
                        "--nats-url",
                        nats.url,
                        "--subject-prefix",
                        prefix,
                        "--log-level",
                        "warning",
                        "--policy",
                        "kv_aware",
                        "--processes",
                        str(n),
                        *extra,
                    ],
                    env=env,
                )
            )
            tls = "--tls-cert" in extra
            rurl = f"{'https' if tls else 'http'}://127.0.0.1:{rport}"
            await _wait_http(rurl + "/health", 30, lambda j: j.get("workers", 0) >= 1)
            targets[name] = rurl + ("#key" if "--api-keys" in extra else "")
        if with_sglang:
            try:
                import sglang_router  # noqa: F401

                from bench.stack import cache_aware_router_argv

                sport, mport = _free_port(), _free_port()
                procs.append(
                    _spawn(
                        [
                            *cache_aware_router_argv(
                                [sys.executable, "-m", "sglang_router.launch_router"],
                                sport,
                                [wurl],
                                mport,
                            ),
                            "--log-level",
                            "warn",
                        ],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                await _wait_http(f"http://127.0.0.1:{sport}/health", 60)
                targets["sglang-router"] = f"http://127.0.0.1:{sport}"
            except Exception as exc:
                print(f"sglang-router could not run: {exc!r}; reporting ours only", file=sys.stderr)
                results["sglang_error"] = repr(exc)
        for name, target in targets.items():
            base, _, key = target.partition("#")
            url = base + "/v1/completions" + (f"#{key}" if key else "")
            lat = await _latency(url, requests)
            rps, errs = await _throughput(url, conns, seconds)
            results[name] = {
                "p50_ms": pct(lat, 50) * 1e3,
                "p99_ms": pct(lat, 99) * 1e3,
                "mean_ms": statistics.fmean(lat) * 1e3,
                "throughput_rps": rps,
                "errors": errs,
            }
            print(
                f"{name:14s} 1-conn p50 {results[name]['p50_ms']:.3f} ms  p99 {results[name]['p99_ms']:.3f} ms   "
                f"{conns}-conn {rps:,.0f} req/s  errors {errs}"
            )
        d = results["direct"]["p50_ms"]
        k = results["kvgate"]
        results["kvgate_added_p50_ms"] = k["p50_ms"] - d
        if "kvgate-keys" in results:
            kk = results["kvgate-keys"]
            results["api_key_check_added_p50_ms"] = kk["p50_ms"] - k["p50_ms"]
            print(
                f"client API key check: p50 {kk['p50_ms'] - k['p50_ms']:+.3f} ms, throughput "
                f"{kk['throughput_rps'] / k['throughput_rps']:.2f}x the router without keys"
            )
        if "kvgate-tls" in results:
            kt = results["kvgate-tls"]
            results["tls_added_p50_ms"] = kt["p50_ms"] - k["p50_ms"]
            results["tls_added_p99_ms"] = kt["p99_ms"] - k["p99_ms"]
            print(
                f"TLS on the OpenAI port (kept-alive connections): p50 {kt['p50_ms']:.3f} vs "
                f"{k['p50_ms']:.3f} ms ({kt['p50_ms'] - k['p50_ms']:+.3f}), p99 "
                f"{kt['p99_ms']:.3f} vs {k['p99_ms']:.3f} ms; throughput "
                f"{kt['throughput_rps']:,.0f} vs {k['throughput_rps']:,.0f} req/s "
                f"({kt['throughput_rps'] / k['throughput_rps']:.2f}x)"
            )
        line = f"kvgate added p50 {k['p50_ms'] - d:.3f} ms (target <= 1 ms: {'PASS' if k['p50_ms'] - d <= 1 else 'FAIL'})"
        if "sglang-router" in results:
            sg = results["sglang-router"]
            results["sglang_added_p50_ms"] = sg["p50_ms"] - d
            results["throughput_ratio_vs_sglang"] = k["throughput_rps"] / sg["throughput_rps"]
            for name in list(results):
                if name.startswith("kvgate-") and isinstance(results[name], dict):
                    r = results[name]["throughput_rps"] / sg["throughput_rps"]
                    results[f"throughput_ratio_{name}_vs_sglang"] = r
                    print(f"{name}: throughput {r:.2f}x sglang-router's")
            line += (
                f"; sglang-router added p50 {sg['p50_ms'] - d:.3f} ms; throughput kvgate/sglang "
                f"{results['throughput_ratio_vs_sglang']:.2f}x (target >= 0.6x: "
                f"{'PASS' if results['throughput_ratio_vs_sglang'] >= 0.6 else 'FAIL'})"
            )
        print(line)
    finally:
        if beat_task is not None:
            beat_task.cancel()
        if bus is not None:
            await bus.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        nats.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "what", nargs="?", default="all", choices=["all", "decision", "proxy", "worker"]
    )
    ap.add_argument("--iters", type=int, default=3000, help="decision-path iterations")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks")
    ap.add_argument("--workers", type=int, default=64, help="workers in the decision bench")
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests (latency)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds per throughput run")
    ap.add_argument("--conns", type=int, default=64, help="connections for throughput")
    ap.add_argument("--no-sglang", action="store_true", help="skip sglang-router")
    ap.add_argument(
        "--kvgate-processes", default="1", help="router process counts to measure (--processes)"
    )
    ap.add_argument(
        "--tls",
        action="store_true",
        help="(proxy) also run the router over https (--tls-cert/--tls-key, a self-signed "
        "certificate) and print plain vs TLS side by side",
    )
    ap.add_argument("--port", type=int, default=0, help="(worker) port")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON result")
    a = ap.parse_args(argv)
    if a.what == "worker":
        serve_worker(a.port)
        return 0
    res: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
    }
    if a.what in ("all", "decision"):
        res["decision"] = bench_decision(a.iters, a.workers, a.blocks)
    if a.what in ("all", "proxy"):
        procs = tuple(int(x) for x in a.kvgate_processes.split(",") if x.strip())
        res["proxy"] = asyncio.run(
            bench_proxy(a.requests, a.seconds, a.conns, not a.no_sglang, procs, a.tls)
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_router_{int(time.time())}.json"
    path.write_text(json.dumps(res, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
