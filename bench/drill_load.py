"""The fault drill's clients: ``clients`` concurrent loops, each sending one OpenAI completion
at a time (half of them streamed, by default) to a router, recording every outcome.

No client retries: each request's first answer is its outcome. Outcomes are judged, not
smoothed:

- ``ok``: 200 and complete (a stream ended with ``data: [DONE]``, a plain answer parsed);
- ``cut``: a streamed 200 that did not end with ``[DONE]`` after only text (the connection
  dropped, an error event, the client's timeout);
- ``refused``: 503 with ``Retry-After`` (the router asks the client to come back);
- ``failed``: everything else (any other non-200, a connection refused or reset, a timeout
  before the answer's status).

Prompts share a pooled prefix (a cached system prompt) and end in a unique suffix, so every
request both hits the cache and stores new blocks (KV events flow all the time).

Invariant: every request a client started before :meth:`Load.stop` is recorded exactly once,
or counted in ``unfinished`` when it outlived the stop's grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

MODEL = "sim-llama-8b"
OK, CUT, REFUSED, FAILED = "ok", "cut", "refused", "failed"
# pooled prefixes: 12 system prompts of 20-40 words (shared blocks across requests)
POOL = [
    f"system prompt {i}: you answer as assistant number {i}. "
    + " ".join(f"rule{i}x{j}" for j in range(20 + 2 * i))
    for i in range(12)
]


@dataclass
class Outcome:
    """One request as the client saw it (times: ``time.monotonic()``)."""

    sent: float
    done: float
    stream: bool
    status: int  # HTTP status; -1: no status (connection failed, timeout before headers)
    kind: str  # OK, CUT, REFUSED or FAILED
    detail: str = ""  # why it was not ok (status and a bit of the body, or the exception)
    worker: str = ""  # the worker the router chose first (its x-kvgate-worker header)


def judge(status: int, retry_after: bool, stream: bool, complete: bool) -> str:
    """The outcome kind of a request (module docstring)."""
    if status == 200:
        return OK if complete else (CUT if stream else FAILED)
    if status == 503 and retry_after:
        return REFUSED
    return FAILED


@dataclass
class LoadShape:
    clients: int = 8
    stream_share: float = 0.5  # share of requests streamed
    max_tokens: tuple[int, int] = (32, 192)  # uniform range; ~6.5 ms a token on the sim
    think_s: float = 0.05  # pause between a client's requests (the VM has 2 shared cores)
    # pause after a request that was not ok: clients spinning on a refused port would steal
    # the CPU a restarting service needs, and lengthen the recovery the drill measures
    backoff_s: float = 0.25
    timeout_s: float = 60.0  # one request, end to end


@dataclass
class Load:
    """Closed-loop clients against ``url`` (the router's base URL) until :meth:`stop`."""

    url: str
    headers: dict[str, str]
    shape: LoadShape = field(default_factory=LoadShape)
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    unfinished: int = 0
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            headers=self.headers,
            connector=aiohttp.TCPConnector(limit=self.shape.clients),
            timeout=aiohttp.ClientTimeout(total=self.shape.timeout_s),
        )
        for c in range(self.shape.clients):
            rng = random.Random(self.seed * 1000 + c)
            self._tasks.append(asyncio.create_task(self._client(rng)))

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop sending; wait up to ``grace_s`` for the requests in flight."""
        self._stopping.set()
        if self._tasks:
            _done, pending = await asyncio.wait(self._tasks, timeout=grace_s)
            self.unfinished = len(pending)
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        if self._session is not None:
            await self._session.close()

    def counts(self, since: float = 0.0) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes if o.sent >= since)

    async def _client(self, rng: random.Random) -> None:
        while not self._stopping.is_set():
            stream = rng.random() < self.shape.stream_share
            prompt = (
                rng.choice(POOL) + f" question {uuid.uuid4().hex}: " + "word " * rng.randint(4, 24)
            )
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": rng.randint(*self.shape.max_tokens),
                "temperature": 0,
                "stream": stream,
            }
            outcome = await self._send(body, stream)
            self.outcomes.append(outcome)
            pause = self.shape.think_s if outcome.kind == OK else self.shape.backoff_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause)

    async def _send(self, body: dict, stream: bool) -> Outcome:
        assert self._session is not None
        sent = time.monotonic()
        status, retry_after, complete, detail, worker = -1, False, False, "", ""
        try:
            async with self._session.post(self.url + "/v1/completions", json=body) as resp:
                status = resp.status
                worker = resp.headers.get("x-kvgate-worker", "")
                retry_after = "Retry-After" in resp.headers
                if status != 200:
                    detail = f"HTTP {status}: {(await resp.text())[:200]}"
                elif stream:
                    complete, detail = await _read_stream(resp)
                else:
                    complete = bool((await resp.json()).get("choices"))
                    detail = "" if complete else "answer without choices"
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            detail = f"{type(exc).__name__}: {exc}"[:200]
        kind = judge(status, retry_after, stream, complete)
        detail = "" if kind == OK else detail
        return Outcome(sent, time.monotonic(), stream, status, kind, detail, worker)


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[bool, str]:
    """(ended with [DONE], why not): reads the SSE body to its end."""
    error = ""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":  # after an error event the stream still failed its client
            return not error, error
        if b'"error"' in data:
            with contextlib.suppress(ValueError):
                error = str(json.loads(data).get("error"))[:200]
    return False, error or "stream ended without [DONE]"
