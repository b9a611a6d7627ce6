"""Router memory under maximum-size request bodies (issue 18), side by side with the limits off.

A real ``kvgate router`` process (private embedded NATS, no workers) gets three concurrent
requests of each kind; we record its resident memory when idle and its peak (VmHWM) after:

- ``max-body``: three bodies just under ``--max-body-bytes`` (4 MiB) whose prompt is over
  ``--max-prompt-chars`` (refused with 400 before tokenizing);
- ``max-tokenized``: three bodies whose prompt is just under ``--max-prompt-chars`` (tokenized,
  then refused for want of a worker);
- ``oversize-length``: three 60 MB bodies with a Content-Length (refused with 413 before reading);
- ``oversize-chunked``: three 60 MB chunked bodies (refused with 413 once 4 MiB were read);
- ``limits-off``: the same 60 MB bodies against a router run with the previous behaviour
  (64 MiB body limit, no prompt-size check): the peer column.

The bound to hold: peak RSS < 2 x idle RSS + the body limit.

    python -m bench.bench_body_limit --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.common.embedded import EmbeddedNats, env_without_proxy, free_port

MIB = 1 << 20
LIMIT = 4 * MIB
PROMPT_LIMIT = 1_000_000
BIG = 60_000_000


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found")


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * prompt_chars, "max_tokens": 1}).encode()


async def _post(url: str, data: bytes, chunked: bool) -> int:
    import aiohttp

    async def gen():
        for i in range(0, len(data), 1 << 16):
            yield data[i : i + (1 << 16)]

    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url,
                data=gen() if chunked else data,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=120),
            ) as r:
                await r.read()
                return r.status
    except aiohttp.ClientError:
        return -1  # the router closed the connection while we were still sending


async def _wait_health(url: str, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(url)


def _start_router(port: int, nats_url: str, argv: list[str]) -> subprocess.Popen:
    env = env_without_proxy()
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "router", "--port", str(port),
         "--nats-url", nats_url, "--subject-prefix", f"benchbody{os.getpid()}",
         "--log-level", "warning", "--queue-timeout", "1", *argv],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def one_case(nats_url: str, name: str, body: bytes, chunked: bool, argv: list[str]) -> dict:
    port = free_port()
    proc = _start_router(port, nats_url, argv)
    try:
        await _wait_health(f"http://127.0.0.1:{port}/health", 60)
        await asyncio.sleep(1.0)  # let start-up allocations settle before the idle reading
        idle = _rss_kib(proc.pid, "VmRSS")
        url = f"http://127.0.0.1:{port}/v1/completions"
        statuses = await asyncio.gather(*(_post(url, body, chunked) for _ in range(3)))
        peak = _rss_kib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 20)
    return {
        "case": name,
        "idle_rss_mib": idle / 1024,
        "peak_rss_mib": peak / 1024,
        "bound_mib": (2 * idle * 1024 + LIMIT) / MIB,
        "statuses": statuses,
    }


async def run(runs: int) -> list[dict[str, Any]]:
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-body-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    out: list[dict[str, Any]] = []
    limits = ["--max-body-bytes", str(LIMIT), "--max-prompt-chars", str(PROMPT_LIMIT)]
    previous = ["--max-body-bytes", str(64 * MIB), "--max-prompt-chars", "0"]
    cases = [
        ("max-body", _body(LIMIT - 100), False, limits),
        ("max-tokenized", _body(PROMPT_LIMIT - 100), False, limits),
        ("oversize-length", _body(BIG), False, limits),
        ("oversize-chunked", _body(BIG), True, limits),
        ("limits-off (60 MB)", _body(BIG), False, previous),
    ]
    try:
        for run_no in range(runs):
            for name, body, chunked, argv in cases:
                r = await one_case(nats.url, name, body, chunked, argv)
                r["run"] = run_no
                ok = r["peak_rss_mib"] < r["bound_mib"]
                print(
                    f"run {run_no} {name:20s} idle {r['idle_rss_mib']:7.1f} MiB  peak "
                    f"{r['peak_rss_mib']:7.1f} MiB  bound {r['bound_mib']:7.1f} MiB  "
                    f"{'within' if ok else 'OVER'}  statuses {r['statuses']}",
                    flush=True,
                )
                out.append(r)
    finally:
        nats.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_body_limit", description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "router"))
    a = ap.parse_args(argv)
    results = asyncio.run(run(a.runs))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "body_limit.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
