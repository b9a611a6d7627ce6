"""The client side of ``kvgate bench``: streams a workload through an OpenAI-compatible endpoint
(the router, or an external router) with aiohttp and measures every request.

- Open loop: each request is sent at its ``arrival_s`` after the start (Poisson or the trace's
  timestamps), however many are in flight. Closed loop (``concurrency`` > 0): that many
  clients, each sending the next request as soon as its previous one finished.
- Either way a turn of a multi-turn session waits until the previous turn has finished.
- Per request: TTFT (first streamed text chunk), the gaps between later chunks (ITL), end to
  end, usage (prompt / completion / cached tokens) and the worker that served it (response
  header), or the error / timeout.

Uses ``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage``; the
prompt is the workload's ASCII text, so prompt tokens are its bytes under the byte tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import aiohttp

from bench.metrics import ERROR, OK, REJECTED, TIMEOUT, RequestResult
from bench.workloads import BenchRequest

# headers that name the serving worker: the router's, then the worker's own
WORKER_HEADERS = ("x-kvgate-worker", "x-kvgate-served-by", "x-worker-id")


def tenant_headers(req: BenchRequest) -> dict[str, str]:
    """A multi-tenant workload's tenant and band, as a trusted gateway names them (believed by
    a router with ``--trust-tenant-header``, ignored by any other)."""
    if req.tenant is None:
        return {}
    h = {"x-kvgate-tenant": req.tenant}
    if req.priority != "standard":
        h["x-kvgate-priority"] = req.priority
    return h


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    req: BenchRequest,
    result: RequestResult,
    clock: Callable[[], float],
    timeout_s: float,
) -> None:
    """Send one streaming completion and fill ``result`` (never raises for request failures)."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = result.send_s = clock()
    last: float | None = None
    chunks = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers=tenant_headers(req)) as resp:
                for h in WORKER_HEADERS:
                    if h in resp.headers:
                        result.worker = resp.headers[h]
                        break
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    result.status = REJECTED if resp.status in (400, 413, 429) else ERROR
                    result.error = f"HTTP {resp.status}: {text}"
                    result.e2e_s = clock() - start
                    return
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        msg = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in msg:
                        result.status = ERROR
                        result.error = str(msg["error"])[:300]
                        break
                    choices = msg.get("choices") or []
                    text = ""
                    if choices:
                        c = choices[0]
                        text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if text:
                        now = clock()
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        chunks += 1
                    usage = msg.get("usage")
                    if usage:
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        result.completion_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = int(details.get("cached_tokens") or 0)
        if result.status == OK and result.ttft_s is None:
            result.status = ERROR
            result.error = "stream ended without any text"
        if result.status == OK and not result.completion_tokens:
            result.completion_tokens = chunks  # no usage chunk: count chunks
        if result.status == OK and not result.prompt_tokens:
            result.prompt_tokens = req.prompt_tokens
    except TimeoutError:
        result.status = TIMEOUT
        result.error = f"no completion within {timeout_s} s"
    except (aiohttp.ClientError, OSError) as exc:
        result.status = ERROR
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2e_s = clock() - start


async def run_load(
    base_url: str,
    requests: Sequence[BenchRequest],
    model: str,
    concurrency: int = 0,
    timeout_s: float = 120.0,
    progress: Callable[[int], object] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run the workload; returns (results in workload order, run duration in seconds)."""
    url = base_url.rstrip("/") + "/v1/completions"
    results = [RequestResult(r.request_id, prompt_tokens=r.prompt_tokens) for r in requests]
    done_events = {r.request_id: asyncio.Event() for r in requests}
    prev: dict[int, str] = {}
    last_of_session: dict[str, str] = {}
    for i, r in enumerate(requests):
        if r.session_id is not None:
            if r.session_id in last_of_session:
                prev[i] = last_of_session[r.session_id]
            last_of_session[r.session_id] = r.request_id
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def one(i: int) -> None:
            r = requests[i]
            before = prev.get(i)
            if before is not None:
                await done_events[before].wait()
            try:
                await stream_one(session, url, model, r, results[i], clock, timeout_s)
            finally:
                done_events[r.request_id].set()
                if progress is not None:
                    progress(1)

        if concurrency > 0:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(requests)):
                queue.put_nowait(i)

            async def client() -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await one(i)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:

            async def timed(i: int) -> None:
                delay = requests[i].arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule itself, not synchronisation
                await one(i)

            await asyncio.gather(*(timed(i) for i in range(len(requests))))
    return results, clock()
