"""Disaggregated serving, live: `kvgate up --prefill-workers P --decode-workers D` (real
processes: embedded NATS and Postgres, simulated prefill and decode workers, indexer,
telemetry, api, router), N requests through the router with the official ``openai`` client
(streaming chat, streaming completions and whole completions, in turn), and one prefill worker
killed (its crash fault: port closed, heartbeats stopped) when ``--kill-at`` of them are done.

    python -m bench.pd_live [--requests 1000] [--concurrency 16] [--kill-at 0.3]
                            [--policy pd_slo] [--handshake nixl|bootstrap] [--prefill 2]
                            [--decode 2]

Prints one JSON line: requests, errors (any exception or non-200), errors after the kill,
the P/D pairs seen (x-kvgate-prefill-worker / x-kvgate-worker), how many were prefilled on
another worker than the decoder, and the router's own counts (retries, P/D prefill failures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from services.common import stackfile
from services.common.embedded import env_without_proxy, free_port, port_open

PORTS = ("router", "router-operator", "api", "indexer", "telemetry")
SYSTEMS = [
    "You are a meticulous assistant for a logistics company. Answer with numbered steps. " * 12,
    "You review legal contracts. Quote the clause, then explain its risk plainly. " * 12,
    "You are a tutor for undergraduate physics. Derive before you conclude. " * 12,
]


def _free_range(n: int) -> int:
    for _ in range(200):
        base = random.randint(20_000, 40_000)
        if all(not port_open("127.0.0.1", base + i, 0.05) for i in range(n)):
            return base
    raise SystemExit("no free port range")


def start_stack(state: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, dict[str, int]]:
    ports = {k: free_port() for k in PORTS}
    ports["sim"] = _free_range(args.prefill + args.decode)
    argv = [sys.executable, "-m", "services.cli", "up"]
    argv += ["--prefill-workers", str(args.prefill), "--decode-workers", str(args.decode)]
    argv += ["--state-dir", str(state)]
    for k, p in ports.items():
        argv += [f"--{k}-port", str(p)]
    env = env_without_proxy()
    for var in ("KVGATE_API_ADMIN_TOKEN", "KVGATE_NATS_URL", "KVGATE_DATABASE_URL"):
        env.pop(var, None)
    env["KVGATE_ROUTER_POLICY"] = args.policy
    env["KVGATE_ROUTER_PD_HANDSHAKE"] = args.handshake
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    deadline = time.monotonic() + 180
    out = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if "Press Ctrl-C to stop" in line:
            return proc, ports
    proc.kill()
    raise SystemExit("kvgate up did not come up:\n" + "".join(out))


def router_counts(operator_port: int) -> dict[str, float]:
    """The router's P/D and retry counters, one entry per label set."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{operator_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    keep = ("kvgate_router_pd_requests_total", "kvgate_router_retries_total")
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in keep:
                labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                out[smp.name + (f"{{{labels}}}" if labels else "")] = smp.value
    return out


async def load(args: argparse.Namespace, ports: dict[str, int], key: str) -> dict:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ports['router']}/v1", api_key=key or "x", max_retries=0
    )
    sem = asyncio.Semaphore(args.concurrency)
    done = 0
    killed_at: int | None = None
    kill_after = int(args.requests * args.kill_at)
    victim = ""
    prefill_used: Counter[str] = Counter()  # requests each prefill worker served so far
    errors: list[str] = []
    errors_after_kill = 0
    pairs: Counter[str] = Counter()
    by_prefill_after: Counter[str] = Counter()
    rng = random.Random(args.seed)

    async def kill() -> None:
        """Crash the prefill worker that served the most requests so far (the one the
        policy leans on: killing an idle one would test nothing)."""
        nonlocal killed_at, victim
        killed_at = done
        victim = max(sorted(prefill_used), key=lambda w: prefill_used[w]) if prefill_used else ""
        victim = victim or "prefill-0"
        index = int(victim.rsplit("-", 1)[1]) if "-" in victim else 0
        url = f"http://127.0.0.1:{ports['sim'] + index}/admin/faults"
        await asyncio.to_thread(
            urllib.request.urlopen,
            urllib.request.Request(
                url, data=b'{"crash": true}', headers={"Content-Type": "application/json"}
            ),
            None,
            5,
        )

    async def one(i: int) -> None:
        nonlocal done, errors_after_kill
        system = SYSTEMS[i % len(SYSTEMS)]
        question = f"Question {i}: {rng.random():.6f}. What should we check first, and why?"
        max_tokens = 16 + i % 17
        async with sem:
            after_kill = killed_at is not None  # sent after the kill
            try:
                kind = i % 3
                if kind == 0:
                    async with client.chat.completions.with_streaming_response.create(
                        model="sim-llama-8b",
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": question},
                        ],
                        max_tokens=max_tokens,
                        stream=True,
                    ) as resp:
                        headers = resp.headers
                        text = "".join(
                            [
                                c.choices[0].delta.content or ""
                                async for c in await resp.parse()
                                if c.choices
                            ]
                        )
                elif kind == 1:
                    async with client.completions.with_streaming_response.create(
                        model="sim-llama-8b",
                        prompt=system + question,
                        max_tokens=max_tokens,
                        stream=True,
                    ) as resp:
                        headers = resp.headers
                        text = "".join(
                            [c.choices[0].text async for c in await resp.parse() if c.choices]
                        )
                else:
                    raw = await client.completions.with_raw_response.create(
                        model="sim-llama-8b", prompt=system + question, max_tokens=max_tokens
                    )
                    headers = raw.headers
                    text = raw.parse().choices[0].text
                if not text:
                    raise RuntimeError("empty answer")
                pre = headers.get("x-kvgate-prefill-worker")
                pairs[f"{pre or 'local'}->{headers.get('x-kvgate-worker')}"] += 1
                if pre:
                    prefill_used[pre] += 1
                if after_kill:
                    by_prefill_after[pre or "local"] += 1
            except Exception as exc:  # every failure counts: the figure is zero of them
                errors.append(f"{i}: {type(exc).__name__}: {exc}"[:300])
                if after_kill:
                    errors_after_kill += 1
        done += 1
        if done == kill_after and killed_at is None:
            await kill()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    await client.close()
    remote = sum(n for p, n in pairs.items() if not p.startswith("local"))
    return {
        "requests": args.requests,
        "errors": len(errors),
        "errors_after_kill": errors_after_kill,
        "killed": victim,
        "killed_after_requests": killed_at,
        "disaggregated": remote,
        "local_prefill": sum(pairs.values()) - remote,
        "prefill_after_kill": dict(by_prefill_after),
        "pairs": dict(sorted(pairs.items())),
        "wall_s": round(wall, 1),
        "first_errors": errors[:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kill-at", type=float, default=0.3, help="fraction done before the kill")
    ap.add_argument("--policy", default="pd_slo", help="the router's P/D policy")
    ap.add_argument("--handshake", default="nixl", choices=["nixl", "bootstrap", "auto"])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-pd-live-") as tmp:
        state = Path(tmp) / "state"
        proc, ports = start_stack(state, args)
        try:
            key = stackfile.read_client_key(state) or ""
            out = asyncio.run(load(args, ports, key))
            out["policy"], out["handshake"] = args.policy, args.handshake
            out["router"] = router_counts(ports["router-operator"])
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(out))
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
