"""Router benchmarks (issue 5), side by side in one run; results recorded in docs/router.md.

1. **decision**: the router's own decision path (parse + tokenize a 4096-token prompt, lazy
   prefix match against a PrefixIndex of 1 M blocks over 64 workers, the router's default
   policy, ``kv_aware``, over 64 worker states; ``--policy`` picks another) through the live
   router's code (``Decider.decide_for``), N times: p50 / p99. Target p50 <= 150 us.
2. **proxy**: an instant-answer worker (separate process), then the same requests sent
   directly, through ``kvgate router`` (its default policy unless ``--policy``) and through
   ``sglang-router`` (cache_aware), in this run, non-streaming (``whole``) and streaming
   (``stream``: 24 one-token SSE chunks + usage): added p50 latency at 1 connection (target
   <= 0.4 ms), throughput at 64 connections (target >= 0.8x sglang-router's) and each
   target's CPU time per request.

    python -m bench.bench_router                 # everything
    python -m bench.bench_router decision        # only the decision path
    python -m bench.bench_router decision --policy kv_aware
    python -m bench.bench_router proxy --seconds 10 --requests 2000
    python -m bench.bench_router proxy --tls --no-sglang   # + the same router over https
    python -m bench.bench_router proxy --modes stream --no-sglang --profile DIR  # py-spy
    python -m bench.bench_router proxy --modes whole --rounds 4   # targets take turns
    python -m bench.bench_router proxy --modes whole --rounds 4 --also-policies round_robin,kv_aware
    python -m bench.bench_router proxy --rounds 4 --no-keys --peered   # + a router with a peer

``--rounds N`` splits each target's throughput time into N turns, the targets taking turns, so
a ratio is not the difference between two minutes of a noisy machine. Beside each target's
CPU per request the table shows the worker's and the load generator's while that target ran,
and the three together: on shared cores that sum sets the throughput. ``--also-policies``
adds a router per named policy (``round_robin``: the request path without a policy's work).

With ``--tls`` the proxy bench adds the router serving https itself (``--tls-cert``, a
self-signed P-256 certificate): the same load, plain and TLS side by side.

All traffic goes to 127.0.0.1. NATS for our routers is a private embedded server, each router
on its own subject prefix (routers on one prefix share in-flight counts, as one deployment's
replicas do; ``--peered`` measures that on purpose).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import write_result
from services.core.policy import DEFAULT_POLICY

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


def offline_router(
    index: Any, wids: list[str], bs: int, rng: random.Random, policy: str | None = None
) -> Any:
    """A router with no network over ``index`` (its replica stands ready): ``wids`` heard
    from, each with random load (in flight 0-40, queued prefill 0-8000 tokens), running
    ``policy`` (None: the router's default). The decision benches time its ``Decider``."""
    from services.common.bus import Bus
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat
    from services.router.app import Router
    from services.router.cli import settings

    class Src:
        def __init__(self, idx: Any) -> None:
            self.index = idx
            self.ready = True

    # the router's own settings (flags, env) are not read
    st = settings(policy=policy) if policy is not None else settings()
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
    return router


def decision_setup(
    workers: int = 64, blocks: int = 1_000_000, policy: str = DEFAULT_POLICY["name"]
) -> tuple[Any, dict[str, Any], Any]:
    """The decision bench's router (no network), request body and index: a 4096-token prompt
    whose first 64 blocks 8 workers hold and whose first 200 one worker holds, ``blocks``
    random blocks over ``workers`` workers with random load. Also used to profile it."""
    from services.core.index import PrefixIndex
    from services.core.keys import block_keys

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
    router = offline_router(index, wids, bs, rng, policy)
    body = {"model": "m", "prompt": prompt, "max_tokens": 128}
    return router, body, index


def decision_loop(n: int, workers: int, blocks: int, policy: str) -> None:
    """``n`` decisions of the bench's request through ``Decider.decide_for`` (for profilers)."""
    router, body, _ = decision_setup(workers, blocks, policy)
    pol = router.policies.control
    parsed = asyncio.run(router.parser.parse(body, chat=False))
    for i in range(n):
        router.decider.decide_for(parsed, f"r{i}", None, pol, set())


def bench_decision(
    iters: int, workers: int = 64, blocks: int = 1_000_000, policy: str = DEFAULT_POLICY["name"]
) -> dict[str, Any]:
    router, body, index = decision_setup(workers, blocks, policy)
    policy = router.policies.control

    def _keys_for(pol: Any, parsed: Any) -> tuple[tuple[int, ...], int]:
        if not router.lifecycle.wants_block_keys(pol):
            return (), 0
        bs = next(iter(router.state.block_sizes))
        return tuple(router.parser.keys(parsed, bs)), bs

    async def run() -> tuple[list[float], list[float], list[float], list[float]]:
        total, parse, match, dec = [], [], [], []
        from services.core.policy import RequestInfo, decide

        for i in range(iters + 200):
            t0 = time.perf_counter()
            parsed = await router.parser.parse(body, chat=False)
            t1 = time.perf_counter()
            d, _ = router.decider.decide_for(parsed, f"r{i}", None, policy, set())
            t2 = time.perf_counter()
            # components, separately, as decide_for runs them: the prompt's whole key chain
            # hashed and matched when the policy keeps routed memory (it gets the keys), else
            # the lazy match_prompt path (hashing stops where no worker matches)
            keys, bs = _keys_for(policy, parsed)
            overlaps = router.decider.overlaps(parsed, router.state.states, keys, bs)
            t3 = time.perf_counter()
            req = RequestInfo(f"r{i}", "m", len(parsed.token_ids), 128, block_keys=keys)
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
    per_policy: dict[str, float] = {}
    keyed: list[str] = []
    for name in COMPARED_POLICIES:
        pol = build_policy({"name": name, "params": {}})
        # the request as decide_for builds it: block keys for the policies that keep routed
        # memory or a routed-prompt tree (their cost includes using them)
        keys, bs = _keys_for(pol, parsed)
        if keys:
            keyed.append(name)
        overlaps = router.decider.overlaps(parsed, router.state.states, keys, bs)
        times = []
        for i in range(iters + 200):
            req = RequestInfo(f"p{i}", "m", len(parsed.token_ids), 128, block_keys=keys)
            t0 = time.perf_counter()
            decide(pol, req, router.state.snapshot, overlaps)
            if i >= 200:
                times.append(time.perf_counter() - t0)
        per_policy[name] = pct(times, 50) * us
    out = {
        "policy": policy.name,
        "workers": workers,
        "indexed_blocks": len(index),
        "prompt_tokens": len(body["prompt"]),
        "iters": iters,
        "total_p50_us": pct(total, 50) * us,
        "total_p99_us": pct(total, 99) * us,
        "parse_tokenize_p50_us": pct(parse, 50) * us,
        "prefix_match_p50_us": pct(match, 50) * us,
        "policy_decide_p50_us": pct(dec, 50) * us,
        "target_p50_us": 150,
        "policy_decide_p50_us_by_policy": per_policy,
        "policies_given_block_keys": keyed,
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
        + f" (given the prompt's block keys: {', '.join(keyed) or 'none'})"
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

    # a streamed answer: STREAM_TOKENS chunks of one token each (OpenAI completions format),
    # the last with its finish_reason, then the usage chunk when the request asked for it
    # (stream_options.include_usage, as vLLM does) and [DONE]; each chunk is its own write
    def chunk(text: str, finish: str | None) -> bytes:
        c = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(c).encode() + b"\n\n"

    tokens = [chunk(" ok", None) for _ in range(STREAM_TOKENS - 1)] + [chunk(" ok", "length")]
    usage_chunk = (
        b"data: "
        + json.dumps(
            {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 0,
                "model": "m",
                "choices": [],
                "usage": {
                    "prompt_tokens": 100,
                    "completion_tokens": STREAM_TOKENS,
                    "total_tokens": 100 + STREAM_TOKENS,
                },
            }
        ).encode()
        + b"\n\n"
    )

    async def complete(r: web.Request) -> web.StreamResponse:
        body = json.loads(await r.read())
        if not body.get("stream"):
            return web.Response(body=answer, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(r)
        for c in tokens:
            await out.write(c)
        if (body.get("stream_options") or {}).get("include_usage"):
            await out.write(usage_chunk)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

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

    # sglang-router asks each new worker whether it speaks gRPC (an HTTP/2 preface) before it
    # settles on HTTP; aiohttp refuses the preface with a logged traceback, which would read as
    # a fault of the run. Only that refusal is dropped; any other server error is still logged.
    def not_a_grpc_probe(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))

    logging.getLogger("aiohttp.server").addFilter(not_a_grpc_probe)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# =============================================================================== proxy
async def _get_json(url: str, key: str) -> Any:
    """``key`` of the JSON at ``url`` (a router's /health)."""
    import aiohttp

    conn = aiohttp.TCPConnector(ssl=_client_tls(url))
    async with aiohttp.ClientSession(connector=conn) as s, s.get(url) as r:
        return (await r.json(content_type=None))[key]


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
# tokens per streamed answer (each its own SSE chunk), plus the usage chunk
STREAM_TOKENS = 24
# the streaming request: the client asks for the usage chunk (so every proxy relays the same
# upstream stream: STREAM_TOKENS chunks + usage + [DONE])
STREAM_BODY = {
    **BODY,
    "max_tokens": STREAM_TOKENS,
    "stream": True,
    "stream_options": {"include_usage": True},
}
MODES = {"whole": BODY, "stream": STREAM_BODY}


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


def _complete(body: dict[str, Any], status: int, data: bytes) -> bool:
    """A 200 with the whole answer (a stream up to its [DONE])."""
    return status == 200 and (not body.get("stream") or data.endswith(b"data: [DONE]\n\n"))


async def _latency(url: str, n: int, body: dict[str, Any] = BODY) -> list[float]:
    import aiohttp

    data = json.dumps(body).encode()
    lat = []
    conn = aiohttp.TCPConnector(limit=1, ssl=_client_tls(url))
    async with aiohttp.ClientSession(connector=conn) as s:
        for i in range(n + 100):
            t0 = time.perf_counter()
            async with s.post(url.split("#")[0], data=data, headers=_headers(url)) as r:
                got = await r.read()
                assert _complete(body, r.status, got), (r.status, got[-64:])
            if i >= 100:
                lat.append(time.perf_counter() - t0)
    return lat


async def _throughput_run(
    url: str, conns: int, seconds: float, body: dict[str, Any] = BODY
) -> tuple[int, float, int]:
    """``conns`` connections sending ``body`` for ``seconds``: (complete answers, seconds
    measured, errors)."""
    import aiohttp

    data = json.dumps(body).encode()
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds

    async def loop(s: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.monotonic() < stop_at:
            async with s.post(url.split("#")[0], data=data, headers=_headers(url)) as r:
                got = await r.read()
                if _complete(body, r.status, got):
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
    return done, el, errors


def _stop_children(pid: int) -> None:
    """SIGTERM the direct children of ``pid`` (the router py-spy runs)."""
    with contextlib.suppress(OSError, ValueError):
        for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            os.kill(int(kid), signal.SIGTERM)


def _spawn(argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, **kw)


def _free_port() -> int:
    from services.common.embedded import free_port

    return free_port()


async def start_bench_worker(procs: list[subprocess.Popen], env: dict[str, str]) -> str:
    """Start the instant-answer bench worker (``python -m bench.bench_router worker``, appended
    to ``procs``) and wait until it answers; its URL."""
    wport = _free_port()
    procs.append(
        _spawn(
            [sys.executable, "-m", "bench.bench_router", "worker", "--port", str(wport)],
            env=env,
        )
    )
    wurl = f"http://127.0.0.1:{wport}"
    await _wait_http(wurl + "/health", 20)
    return wurl


async def heartbeat_worker(bus: Any, url: str, prefixes: list[Any]) -> None:
    """Announce the bench worker at ``url`` on every subject prefix in ``prefixes`` (one per
    target deployment; the caller may add prefixes while it runs) every 0.5 s, until
    cancelled."""
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat

    hb = WorkerHeartbeat(
        worker_id="bench-w0",
        instance_id="i0",
        url=url,
        model="m",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=1_000_000, max_num_seqs=4096, max_model_len=8192
        ),
    )
    while True:
        hb.ts = time.time()
        for subjects in list(prefixes):
            await bus.publish(subjects.heartbeat(hb.worker_id), hb)
        await asyncio.sleep(0.5)


async def bench_proxy(
    requests: int,
    seconds: float,
    conns: int,
    with_sglang: bool,
    processes: tuple[int, ...] = (1, 2),
    with_tls: bool = False,
    modes: tuple[str, ...] = ("whole", "stream"),
    with_keys: bool = True,
    profile: Path | None = None,
    policy: str = DEFAULT_POLICY["name"],
    rounds: int = 1,
    also_policies: tuple[str, ...] = (),
    peered: bool = False,
) -> dict[str, Any]:
    from services.common.bus import Bus
    from services.common.embedded import EmbeddedNats, env_without_proxy
    from services.common.subjects import Subjects

    machine_ns = _machine_ns()  # before anything of the bench runs
    procs: list[subprocess.Popen] = []
    profiled: list[int] = []  # indexes in procs of py-spy wrappers
    env = env_without_proxy()
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-router-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    results: dict[str, Any] = {
        "requests": requests,
        "seconds": seconds,
        "connections": conns,
        "policy": policy,
        "rounds": rounds,
        "also_policies": list(also_policies),
        "machine_ns": machine_ns,
    }
    beat_task = None
    bus = None
    try:
        wurl = await start_bench_worker(procs, env)
        # our router(s), with heartbeats for the worker published from here. Each router gets
        # its own subject prefix: the targets are separate deployments, and routers sharing one
        # would hear each other and share their in-flight counts on every change
        # (services/router/load_share.py), a cost a lone router does not pay
        prefixes: list[Subjects] = []
        bus = Bus(nats.url, "bench", Subjects("benchrouter"))
        await bus.connect(max_wait_s=10)
        beat_task = asyncio.create_task(heartbeat_worker(bus, wurl, prefixes))
        targets = {"direct": wurl}
        pids = {"direct": procs[-1].pid}  # whose CPU time is measured per target
        # (name, processes, policy, extra flags): the same router with client API keys
        # checked, over https, with other policies (what a policy's own work costs end to end)
        variants = [("kvgate" if n == 1 else f"kvgate-{n}proc", n, policy, []) for n in processes]
        if with_keys:
            variants.append(("kvgate-keys", 1, policy, ["--api-keys", f"other-key,{CLIENT_KEY}"]))
        if with_tls:  # the same router serving https itself (--tls-cert / --tls-key)
            cert, key = _self_signed_cert(state / "tls")
            TLS_TRUST["ctx"] = ssl.create_default_context(cafile=str(cert))
            variants.append(
                ("kvgate-tls", 1, policy, ["--tls-cert", str(cert), "--tls-key", str(key)])
            )
        variants += [(f"kvgate-{p}", 1, p, []) for p in also_policies]
        if peered:  # the router with another one on its bus (not a target: it stays idle)
            variants.append(("kvgate-peered", 1, policy, []))

        def router_argv(port: int, prefix: str, pol: str, n: int, extra: list[str]) -> list[str]:
            return [
                sys.executable,
                "-m",
                "services.cli",
                "router",
                "--port",
                str(port),
                "--nats-url",
                nats.url,
                "--subject-prefix",
                prefix,
                "--log-level",
                "warning",
                "--policy",
                pol,
                "--processes",
                str(n),
                *extra,
            ]

        health: dict[str, str] = {}  # each router's /health (peers heard, read after the runs)
        for name, n, pol, extra in variants:
            rport = _free_port()
            prefix = f"benchrouter-{len(prefixes)}"
            prefixes.append(Subjects(prefix))
            # --profile: the single-process router runs under py-spy (collapsed stacks)
            wrap = (
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--nonblocking",
                ]
                + ["--output", str(profile / f"{name}.txt"), "--"]
                if profile is not None and name == "kvgate"
                else []
            )
            if wrap:
                profiled.append(len(procs))
            procs.append(_spawn([*wrap, *router_argv(rport, prefix, pol, n, extra)], env=env))
            tls = "--tls-cert" in extra
            rurl = f"{'https' if tls else 'http'}://127.0.0.1:{rport}"
            await _wait_http(rurl + "/health", 30, lambda j: j.get("workers", 0) >= 1)
            targets[name] = rurl + ("#key" if "--api-keys" in extra else "")
            pids[name] = procs[-1].pid
            health[name] = rurl + "/health"
            if name == "kvgate-peered":
                procs.append(_spawn(router_argv(_free_port(), prefix, pol, 1, []), env=env))
                await _wait_http(rurl + "/health", 30, lambda j: bool(j.get("peer_routers")))
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
                pids["sglang-router"] = procs[-1].pid
            except Exception as exc:
                print(f"sglang-router could not run: {exc!r}; reporting ours only", file=sys.stderr)
                results["sglang_error"] = repr(exc)
        for mode in modes:
            results[mode] = _measure_mode(
                await _measure_targets(
                    targets,
                    pids,
                    MODES[mode],
                    requests,
                    conns,
                    seconds,
                    mode,
                    rounds,
                    worker_pid=pids["direct"],  # the worker answers the direct target
                ),
                mode,
            )
        # who heard whom: a single-process target with a peer would pay for sharing its counts
        # (services/router/load_share.py); only kvgate-peered and the multi-process ones do
        peers = results["peer_routers"] = {
            name: len(await _get_json(url, "peer_routers")) for name, url in health.items()
        }
        _summary(results, modes, conns)
        print("peer routers heard: " + ", ".join(f"{n} {k}" for n, k in peers.items()))
        if "whole" not in modes:
            return results
        results.update(results["whole"])  # the non-streaming figures at the top level too
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
        line = f"kvgate added p50 {k['p50_ms'] - d:.3f} ms (target <= 0.4 ms: {'PASS' if k['p50_ms'] - d <= 0.4 else 'FAIL'})"
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
                f"{results['throughput_ratio_vs_sglang']:.2f}x (target >= 0.8x: "
                f"{'PASS' if results['throughput_ratio_vs_sglang'] >= 0.8 else 'FAIL'})"
            )
        print(line)
    finally:
        if beat_task is not None:
            beat_task.cancel()
        if bus is not None:
            await bus.close()
        for i in profiled:  # stop the profiled router; py-spy then writes its stacks
            _stop_children(procs[i].pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[i].wait(30)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        nats.stop()
    return results


_own_cpu_s = time.process_time  # the load generator's CPU seconds (this process)


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (py-spy's own excluded)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if "py-spy" not in Path(f"/proc/{p}/comm").read_text():
                total += (int(fields[11]) + int(fields[12])) / tick
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (t / "children").read_text().split())
    return total


async def _measure_targets(
    targets: dict[str, str],
    pids: dict[str, int],
    body: dict[str, Any],
    requests: int,
    conns: int,
    seconds: float,
    mode: str,
    rounds: int = 1,
    *,
    worker_pid: int,
) -> dict[str, dict[str, float]]:
    """p50 / p99 at one connection, then req/s at ``conns``: each target sends ``requests``
    sequential requests and runs ``seconds`` of load in all, both in ``rounds`` turns (with 2
    or more the targets take turns, so each sees the same minutes of a noisy machine, and an
    added latency is not the difference between two minutes). Besides each target's own CPU
    per request, the worker's (``worker_pid``) and this process's (the load generator's)
    while that target is measured: the three share the cores, so their sum per request is
    what sets the throughput."""
    out: dict[str, dict[str, float]] = {}
    urls = {}
    lats: dict[str, list[float]] = {}
    for name, target in targets.items():
        base, _, key = target.partition("#")
        urls[name] = base + "/v1/completions" + (f"#{key}" if key else "")
        lats[name] = []
    for turn in range(rounds):
        n = max(1, requests // rounds + (turn < requests % rounds))
        for name in targets:
            lats[name] += await _latency(urls[name], n, body)
    done = dict.fromkeys(targets, 0)
    spent = dict.fromkeys(targets, 0.0)
    # CPU seconds while each target is measured: its own processes' (for a router, its
    # whole cost), the worker's and this process's (the load generator's)
    cpu = dict.fromkeys(targets, 0.0)
    worker_cpu = dict.fromkeys(targets, 0.0)
    client_cpu = dict.fromkeys(targets, 0.0)
    errors = dict.fromkeys(targets, 0)
    for _ in range(rounds):
        for name in targets:
            cpu0, wcpu0, ccpu0 = _tree_cpu_s(pids[name]), _tree_cpu_s(worker_pid), _own_cpu_s()
            n, el, errs = await _throughput_run(urls[name], conns, seconds / rounds, body)
            cpu[name] += _tree_cpu_s(pids[name]) - cpu0
            worker_cpu[name] += _tree_cpu_s(worker_pid) - wcpu0
            client_cpu[name] += _own_cpu_s() - ccpu0
            done[name] += n
            spent[name] += el
            errors[name] += errs
    for name in targets:
        lat = lats[name]
        rps, errs = done[name] / spent[name], errors[name]
        per_request_us = 1e6 / max(1, done[name])
        cpu_us = cpu[name] * per_request_us
        # the three processes together (the direct target's process is the worker)
        own_and_worker = cpu[name] if pids[name] == worker_pid else cpu[name] + worker_cpu[name]
        out[name] = {
            "cpu_us_per_request": cpu_us,
            "worker_cpu_us_per_request": worker_cpu[name] * per_request_us,
            "client_cpu_us_per_request": client_cpu[name] * per_request_us,
            "all_cpu_us_per_request": (own_and_worker + client_cpu[name]) * per_request_us,
            "p50_ms": pct(lat, 50) * 1e3,
            "p99_ms": pct(lat, 99) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3,
            "throughput_rps": rps,
            "errors": errs,
        }
        print(
            f"[{mode:6s}] {name:14s} 1-conn p50 {out[name]['p50_ms']:.3f} ms  "
            f"p99 {out[name]['p99_ms']:.3f} ms   {conns}-conn {rps:,.0f} req/s  errors {errs}  "
            f"CPU {cpu_us:.0f} us/request",
            flush=True,
        )
    return out


def _measure_mode(res: dict[str, Any], mode: str) -> dict[str, Any]:
    """Added p50 over the direct call and the throughput ratio to sglang-router."""
    d = res["direct"]["p50_ms"]
    for name, r in list(res.items()):
        if isinstance(r, dict) and name != "direct":
            r["added_p50_ms"] = r["p50_ms"] - d
            if "sglang-router" in res and name != "sglang-router":
                r["ratio_vs_sglang"] = r["throughput_rps"] / res["sglang-router"]["throughput_rps"]
    return res


def _summary(results: dict[str, Any], modes: tuple[str, ...], conns: int) -> None:
    """One table: each mode, each target side by side (targets: issue 20)."""
    print(
        f"\n{'mode':7s} {'target':20s} {'1-conn p50':>11s} {'added':>8s} {f'{conns}-conn req/s':>14s}"
        f" {'÷ sglang':>9s} {'CPU us/req':>10s} {'worker':>7s} {'client':>7s} {'all':>6s}"
    )
    for mode in modes:
        for name, r in results[mode].items():
            ratio = f"{r['ratio_vs_sglang']:.2f}x" if "ratio_vs_sglang" in r else ""
            added = f"{r['added_p50_ms']:+.3f}" if "added_p50_ms" in r else ""
            print(
                f"{mode:7s} {name:20s} {r['p50_ms']:9.3f}ms {added:>8s} "
                f"{r['throughput_rps']:14,.0f} {ratio:>9s} {r['cpu_us_per_request']:10.0f}"
                f" {r['worker_cpu_us_per_request']:7.0f} {r['client_cpu_us_per_request']:7.0f}"
                f" {r['all_cpu_us_per_request']:6.0f}"
            )
        k = results[mode].get("kvgate", {})
        if "ratio_vs_sglang" in k:
            print(
                f"{mode:7s} targets: added p50 {k['added_p50_ms']:.3f} ms <= 0.4 ms "
                f"{'PASS' if k['added_p50_ms'] <= 0.4 else 'FAIL'}; throughput "
                f"{k['ratio_vs_sglang']:.2f}x >= 0.8x sglang-router "
                f"{'PASS' if k['ratio_vs_sglang'] >= 0.8 else 'FAIL'}"
            )
    with contextlib.suppress(OSError):
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "machine_ns" in results:
        print(
            f"machine: CPython runs sum((1,2,3)) in {results['machine_ns']:.0f} ns (best of 5; "
            "~45 on a normal day of the development VM, 67-97 on a slow one): absolute "
            "latencies move with it"
        )


def _machine_ns() -> float:
    """How fast this machine runs CPython now: ``python -m timeit 'sum((1,2,3))'``'s figure."""
    import timeit

    n = 200_000
    return min(timeit.repeat("sum((1, 2, 3))", number=n, repeat=5)) / n * 1e9


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
    ap.add_argument(
        "--policy",
        default=DEFAULT_POLICY["name"],
        help="the router's policy (name or JSON spec, as kvgate router --policy): on the "
        "decision bench's timed path and in the proxy bench's router; the decision bench's "
        "per-policy comparison always times every baseline",
    )
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
    ap.add_argument(
        "--modes",
        default="whole,stream",
        help="(proxy) request kinds, in this order: whole (non-streaming), stream (SSE, "
        f"{STREAM_TOKENS} one-token chunks + usage)",
    )
    ap.add_argument("--no-keys", action="store_true", help="(proxy) skip the API-key router")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="(proxy) split each target's throughput time into this many turns, the targets "
        "taking turns (2 or more: every target sees the same minutes of a noisy machine)",
    )
    ap.add_argument(
        "--also-policies",
        default="",
        help="(proxy) comma-separated built-in policies: one more single-process router each "
        "(kvgate-NAME), measured beside the others (round_robin: the router without a "
        "policy's own work)",
    )
    ap.add_argument(
        "--peered",
        action="store_true",
        help="(proxy) add kvgate-peered: the router with a second, idle router on its bus, "
        "so it shares its in-flight counts on every change (what load sharing costs a router "
        "under load; the other targets each have a bus of their own)",
    )
    ap.add_argument(
        "--profile",
        default="",
        help="(proxy) run the kvgate router under py-spy; collapsed stacks go to this directory",
    )
    ap.add_argument(
        "--loop",
        type=int,
        default=0,
        help="(decision) only run this many decisions through decide_for, untimed, to be "
        "sampled by a profiler (py-spy record -- python -m bench.bench_router decision --loop N)",
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
    if a.what == "decision" and a.loop:
        decision_loop(a.loop, a.workers, a.blocks, a.policy)
        return 0
    if a.what in ("all", "decision"):
        res["decision"] = bench_decision(a.iters, a.workers, a.blocks, a.policy)
    if a.what in ("all", "proxy"):
        procs = tuple(int(x) for x in a.kvgate_processes.split(",") if x.strip())
        modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
        if a.rounds < 1:
            ap.error("--rounds must be at least 1")
        from services.core.policy import policy_names

        also = tuple(p.strip() for p in a.also_policies.split(",") if p.strip())
        unknown = [p for p in also if p not in policy_names()]
        if unknown:
            ap.error(f"--also-policies: unknown {unknown}; choose from {policy_names()}")
        bad = [m for m in modes if m not in MODES]
        if bad:
            ap.error(f"--modes: unknown {bad}; choose from {sorted(MODES)}")
        prof = Path(a.profile) if a.profile else None
        if prof is not None:
            prof.mkdir(parents=True, exist_ok=True)
        res["proxy"] = asyncio.run(
            bench_proxy(
                a.requests,
                a.seconds,
                a.conns,
                not a.no_sglang,
                procs,
                a.tls,
                modes,
                not a.no_keys,
                prof,
                a.policy,
                a.rounds,
                also,
                a.peered,
            )
        )
    write_result(a.out, "bench_router", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
