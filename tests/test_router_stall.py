"""Stall detection (services/router/stall.py): a stream whose worker goes silent after the
first token, for longer than the latency model says a healthy worker ever would, migrates to
another worker within seconds instead of waiting for --stream-idle-timeout (60 s).

With real simulated workers (engine core, hang fault) and the real router on the real bus;
the bound itself against real policies and latency models.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from services.common.bus import Bus
from services.common.embedded import free_port
from services.core.policy.base import build_policy
from services.router import metrics as M
from services.router.cli import settings
from services.router.stall import StallBound
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_public_surface import _self_signed
from tests.test_router_support import Beats, FakeWorker, RouterProc, shutdown


def _text_of(raw: bytes) -> str:
    text = ""
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if block.startswith(b"data: {"):
            for ch in json.loads(block[6:]).get("choices", []):
                text += ch.get("text", "")
    return text


@pytest.mark.slow
async def test_a_frozen_worker_mid_stream_migrates_within_the_stall_bound(
    nats_url, subjects, bus: Bus
) -> None:
    """The worker serving a stream freezes after a few tokens (engine stops, connection
    open, no error): the stream continues on the other worker after ~--stall-min-s (2 s),
    not after the 60 s idle timeout. Before stall detection this stream hung 60 s."""
    sims = await SimCluster(nats_url, subjects, 2, speedup=1.0).start()
    router = await RouterProc(nats_url, subjects).start()  # slo_aware, idle timeout 60 s
    victim_idx: int | None = None
    try:
        await router.wait_workers(2, timeout=20)
        stalls0 = M.STREAM_STALLS.labels("predicted").value
        migrations0 = M.MIGRATIONS.labels("completed").value
        body = {"model": "m", "prompt": "tell me a long story", "max_tokens": 80, "stream": True}
        raw = b""
        gaps: list[float] = []
        timeout = aiohttp.ClientTimeout(total=30)  # well under the idle timeout
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                victim = resp.headers["x-kvgate-worker"]
                victim_idx = int(victim.rsplit("-", 1)[1])
                frozen_at: float | None = None
                last = time.monotonic()
                async for chunk in resp.content.iter_any():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    raw += chunk
                    if frozen_at is None and raw.count(b"data:") >= 3:
                        async with s.post(
                            sims.url(victim_idx) + "/admin/faults", json={"hang": True}
                        ) as r:
                            assert r.status == 200
                        frozen_at = time.monotonic()
                done_at = time.monotonic()
        assert frozen_at is not None
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert len(_text_of(raw)) == 80  # byte-level: 80 tokens, across both workers
        assert M.STREAM_STALLS.labels("predicted").value == stalls0 + 1
        assert M.MIGRATIONS.labels("completed").value == migrations0 + 1
        # the longest silence the client saw: the 2 s floor (the model predicts ~10 ms per
        # token here), the 50 ms deadline tick and the continuation's first token
        assert 1.9 <= max(gaps) < 5.0, max(gaps)
        assert done_at - frozen_at < 8.0
    finally:
        if victim_idx is not None:  # thaw it, so its server stops cleanly
            async with aiohttp.ClientSession() as s:
                async with s.post(sims.url(victim_idx) + "/admin/faults", json={"hang": False}):
                    pass
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)


@pytest.mark.slow
async def test_a_slow_first_token_is_not_a_stall(nats_url, subjects, bus: Bus) -> None:
    """A long prompt on a slow engine: its first token takes seconds, several times the stall
    bound, while its later tokens come well within it. The first token is left to the idle
    timeout: the stream is served where it was sent, no stall, no retry, no migration."""
    sims = await SimCluster(nats_url, subjects, 1, speedup=0.05).start()
    router = await RouterProc(nats_url, subjects, stall_min_s=1.0).start()
    try:
        await router.wait_workers(1, timeout=20)
        stalls0 = M.STREAM_STALLS.labels("predicted").value
        retries0, migrations0 = M.RETRIES.value, M.MIGRATIONS.labels("completed").value
        prompt = "".join(chr(97 + (i * 7) % 26) for i in range(4096))  # 4096 tokens
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            t0 = time.monotonic()
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                first: float | None = None
                raw = b""
                async for chunk in resp.content.iter_any():
                    if first is None and b'"text"' in chunk:
                        first = time.monotonic() - t0
                    raw += chunk
        assert first is not None and first > 2.0, first  # longer than the 1 s bound
        assert raw.rstrip().endswith(b"data: [DONE]") and len(_text_of(raw)) == 4
        assert M.STREAM_STALLS.labels("predicted").value == stalls0
        assert M.RETRIES.value == retries0
        assert M.MIGRATIONS.labels("completed").value == migrations0
    finally:
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)


@dataclass
class _FrozenTlsWorker(FakeWorker):
    """An https engine (its streams go through aiohttp, not the plain-http client) that
    sends two tokens and then freezes: the connection stays open, nothing more comes."""

    ssl_ctx: ssl.SSLContext | None = None
    thaw: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def start(self, bus: Bus | None = None) -> _FrozenTlsWorker:
        self._bus = bus
        self.port = free_port()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._frozen)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_ctx).start()
        return self

    async def stop(self) -> None:
        self.thaw.set()
        await super().stop()

    async def _frozen(self, r: web.Request) -> web.StreamResponse:
        self.served.append({"body": await r.json(), "path": r.path})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        for t in ("ab ", "cd "):
            chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m"}
            chunk["choices"] = [{"index": 0, "text": t, "finish_reason": None}]
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await self.thaw.wait()
        return resp


async def test_a_frozen_https_worker_mid_stream_migrates(
    nats_url, subjects, bus: Bus, tmp_path: Path
) -> None:
    """The same over https (aiohttp's client, whose own read timeout is the 30 s idle
    timeout here): the stall bound cuts the silent stream, which continues on the other."""
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    frozen = await _FrozenTlsWorker("w0", ssl_ctx=server_ctx).start(bus)
    healthy = await FakeWorker("w1", chunks=4, chunk_text="ef ").start(bus)
    beats = Beats(bus, [frozen, healthy]).start()
    router = await RouterProc(
        nats_url, subjects, policy="round_robin", stream_idle_timeout=30.0, stall_min_s=0.5
    ).start()
    r = router.router
    assert r is not None
    # the router's worker client trusts the test's certificate authority (as an operator's
    # system trust store would trust theirs)
    trusting = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(cert)))
    )
    r.sender.session = trusting
    try:
        await router.wait_workers(2)
        stalls0 = M.STREAM_STALLS.labels("predicted").value
        body = {"model": "m", "prompt": "go", "max_tokens": 12, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            t0 = time.monotonic()
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kvgate-worker"] == "w0"
                raw = await resp.read()
            took = time.monotonic() - t0
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert _text_of(raw) == "ab cd ef ef "  # 6 tokens from w0, the other 6 from w1
        assert healthy.served[-1]["body"]["prompt"].endswith("ab cd ")
        assert M.STREAM_STALLS.labels("predicted").value == stalls0 + 1
        assert took < 5.0, took  # the bound is ~0.7 s here (0.5 s floor, a prefill chunk)
    finally:
        await shutdown(
            ("router", router.stop()),
            ("session", trusting.close()),
            ("beats", beats.stop()),
            ("w0", frozen.stop()),
            ("w1", healthy.stop()),
            each_s=5,
        )


def _bound(**kw: float) -> StallBound:
    return StallBound.from_settings(settings(**kw))


def test_the_bound_follows_the_workers_latency_model() -> None:
    """From the policy's model of that worker: a fresh one (the prior: ~7 ms a step) gets the
    floor; one whose streams took 0.5 s a token gets 20 x that; the idle timeout caps it."""
    policy = build_policy({"name": "slo_aware", "params": {}})
    b = _bound()
    assert (b.factor, b.min_s, b.idle_s) == (20.0, 2.0, 60.0)
    assert b.bound_s(policy, "fresh", 4, 1000.0) == 2.0
    slow = policy.impl.model(policy.state, "slow")  # type: ignore[attr-defined]
    for _ in range(200):
        slow.observe_step(0.5, 4, 4 * 1000.0)
    gap, _ = b.gaps_s(policy, "slow", 4, 1000.0)
    assert 0.45 < gap < 0.55, gap
    assert b.bound_s(policy, "slow", 4, 1000.0) == pytest.approx(20 * gap)
    assert _bound(stream_idle_timeout=5.0).bound_s(policy, "slow", 4, 1000.0) == 5.0
    # reading the bound creates no model for a worker the policy has not seen
    assert "fresh" not in policy.state.extra["slo_models"]


def test_the_bound_leaves_room_for_a_long_prefill_chunk() -> None:
    """A healthy engine computing an 8192-token prefill chunk at 128k context makes the
    decoders wait ~3 s for one step: never judged a stall, whatever the floor."""
    policy = build_policy({"name": "slo_aware", "params": {}})
    policy.state.extra["slo_ctx"] = 131072.0
    _, longest = _bound().gaps_s(policy, "w", 2, 131072.0)
    assert longest > 2.5, longest
    assert _bound().bound_s(policy, "w", 2, 131072.0) == pytest.approx(2 * longest)


def test_policies_without_a_model_use_the_engine_prior_and_zero_turns_it_off() -> None:
    rr = build_policy({"name": "round_robin", "params": {}})
    assert _bound().bound_s(rr, "w", 1, 100.0) == 2.0
    assert _bound(stall_min_s=0.5).bound_s(rr, "w", 1, 100.0) == pytest.approx(
        2 * _bound().gaps_s(rr, "w", 1, 100.0)[1]
    )
    off = _bound(stall_factor=0.0)
    assert not off.enabled and off.bound_s(rr, "w", 1, 100.0) == 60.0


def test_bad_stall_options_are_refused_naming_the_flag() -> None:
    for name, value, flag in (
        ("stall_factor", -1.0, "--stall-factor"),
        ("stall_factor", float("nan"), "--stall-factor"),
        ("stall_min_s", 0.0, "--stall-min-s"),
    ):
        with pytest.raises(ValueError, match=flag):
            _bound(**{name: value})
