"""Signed orders are fresh, unique and ordered (issue 35): a router with the real api's key
rejects an api-signed ``workers.control`` drain that is replayed (after an uncordon), stale,
from the future, out of order, or whose envelope was tampered with; counts each in
kvgate_router_rejected_messages_total, raises forged_message; and still applies a fresh one.

The POLICY stream's newest notice is checked on read: a router starting over an unsigned
notice skips it, asks the api to repair the stream and gets the api's policy; the api's resync
overwrites a notice that is not its own signed one; and the api's own notice, however old,
is still accepted at start (the freshness window is for live messages only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.publisher import STREAM_REPAIRS
from services.api.testing import ApiHarness, start_api
from services.common.bus import Bus
from services.common.replay_guard import ReplayGuard
from services.common.schemas import PolicyUpdated, WorkerControl, decode, encode
from services.common.signing import (
    ISSUED_AT_HEADER,
    NONCE_HEADER,
    SEQ_HEADER,
    Envelope,
    Signer,
    Verifier,
    new_seed,
)
from tests.test_router_support import Beats, FakeWorker, RouterProc, wait_until
from tests.test_security_router_trust import AlertInbox, _rejected

HOUR_S = 3600.0


@pytest.fixture
def api_seed(tmp_path: Path) -> Path:
    path = tmp_path / "api.nk"
    path.write_bytes(new_seed())
    return path


@pytest.fixture
def seed(api_seed: Path) -> bytes:
    return api_seed.read_bytes()


@pytest.fixture
async def api(
    fresh_database_url: str, nats_url: str, subject_prefix: str, api_seed: Path
) -> AsyncIterator[ApiHarness]:
    # no periodic republish / resync during a test: each test drives the api itself
    h = await start_api(
        fresh_database_url,
        nats_url,
        subject_prefix,
        signing_seed=str(api_seed),
        republish_s=HOUR_S,
    )
    yield h
    await h.stop()


class Fleet:
    """Two fake workers beating, and a router that trusts the api's key."""

    def __init__(self, bus: Bus, nats_url: str, subjects: Any, api_key: str) -> None:
        self.bus, self.nats_url, self.subjects, self.api_key = bus, nats_url, subjects, api_key
        self.workers: list[FakeWorker] = []
        self.beats: Beats | None = None
        self.router: RouterProc | None = None

    async def __aenter__(self) -> Fleet:
        self.workers = [await FakeWorker(f"sim-{i}").start(self.bus) for i in (1, 2)]
        self.beats = Beats(self.bus, self.workers).start()
        self.router = await RouterProc(
            self.nats_url, self.subjects, policy="round_robin", trusted_signers=self.api_key
        ).start()
        await self.router.wait_workers(2)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.beats is not None:
            await self.beats.stop()
        for w in self.workers:
            await w.stop()

    def draining(self, wid: str) -> bool:
        assert self.router is not None and self.router.router is not None
        return self.router.router.state.states[wid].draining


async def test_captured_drain_replayed_after_uncordon_is_rejected(
    api: ApiHarness, nats_url: str, subjects, bus: Bus, api_seed: Path
) -> None:
    alerts = await AlertInbox().start(bus)
    captured: asyncio.Queue[Any] = asyncio.Queue()

    async def capture(msg: Any) -> None:
        captured.put_nowait(msg)

    await bus.client.subscribe(subjects.worker_control("sim-2"), cb=capture)
    await bus.client.flush()
    async with Fleet(bus, nats_url, subjects, Signer.from_file(api_seed).public_key) as fleet:
        # the operator drains sim-2; the attacker records the api-signed order
        assert (await api.call("POST", "/api/v1/workers/sim-2/drain", {}))[0] == 200
        drain = await asyncio.wait_for(captured.get(), 5)
        assert decode(WorkerControl, drain.data).action == "drain"
        await wait_until(lambda: fleet.draining("sim-2"), 5, "sim-2 drained")
        # ... then uncordons it
        assert (await api.call("POST", "/api/v1/workers/sim-2/uncordon", {}))[0] == 200
        await wait_until(lambda: not fleet.draining("sim-2"), 5, "sim-2 uncordoned")

        # the attacker re-publishes the captured drain, byte for byte
        before = _rejected("WorkerControl", "replayed")
        await bus.client.publish(drain.subject, drain.data, headers=drain.headers)
        alert = await alerts.next("replayed")
        assert _rejected("WorkerControl", "replayed") == before + 1
        assert alert.severity == "critical" and "re-published" in alert.remedy
        assert not fleet.draining("sim-2")

        # the api's own orders still work
        assert (await api.call("POST", "/api/v1/workers/sim-2/drain", {}))[0] == 200
        await wait_until(lambda: fleet.draining("sim-2"), 5, "sim-2 drained again")


async def test_stale_future_tampered_and_reordered_orders_are_rejected(
    api: ApiHarness, nats_url: str, subjects, bus: Bus, api_seed: Path, seed: bytes
) -> None:
    alerts = await AlertInbox().start(bus)
    subject = subjects.worker_control("sim-1")

    def order(action: str) -> bytes:
        return encode(WorkerControl(worker_id="sim-1", action=action, by="bootstrap-admin"))  # type: ignore[arg-type]

    async def send(data: bytes, headers: dict[str, str]) -> None:
        await bus.client.publish(subject, data, headers=headers)

    async def rejected(reason: str, data: bytes, headers: dict[str, str]) -> None:
        before = _rejected("WorkerControl", reason)
        await send(data, headers)
        await alerts.next(reason)
        assert _rejected("WorkerControl", reason) == before + 1

    async with Fleet(bus, nats_url, subjects, Signer.from_file(api_seed).public_key) as fleet:
        drain = order("drain")
        # signed with the api's key an hour ago (a captured order, or a clock far behind)
        stale = Signer(seed, clock=lambda: time.time() - HOUR_S).headers(subject, drain)
        await rejected("stale", drain, stale)
        # and an hour ahead
        future = Signer(seed, clock=lambda: time.time() + HOUR_S).headers(subject, drain)
        await rejected("future", drain, future)
        # the stale one with its date moved to now: the signature covers the date
        tampered = {**stale, ISSUED_AT_HEADER: str(int(time.time() * 1000))}
        await rejected("bad_signature", drain, tampered)

        # signed drain-then-uncordon, delivered uncordon-then-drain: the older one is refused
        signer = Signer(seed)
        early = signer.headers(subject, drain)
        uncordon = order("uncordon")
        late = signer.headers(subject, uncordon)
        assert int(early[SEQ_HEADER]) < int(late[SEQ_HEADER])
        await send(uncordon, late)
        await rejected("out_of_order", drain, early)
        assert not fleet.draining("sim-1")

        # a fresh, legitimately signed order is applied
        await send(drain, signer.headers(subject, drain))
        await wait_until(lambda: fleet.draining("sim-1"), 5, "sim-1 drained")


async def _signed_policy(api: ApiHarness, spec_name: str) -> dict[str, Any]:
    status, _ = await api.call(
        "POST", "/api/v1/policies", {"name": "p", "spec": {"name": spec_name}}
    )
    assert status in (200, 201)
    assert (await api.call("POST", "/api/v1/policies/p/activate"))[0] == 200
    _, active = await api.call("GET", "/api/v1/active-policy")
    return active


async def _poison(bus: Bus, subjects: Any, revision: int) -> None:
    """What a stolen api credential can do: an unsigned notice as the stream's newest (the api
    created the POLICY stream when it started)."""
    forged = PolicyUpdated(revision=revision, name="random", version=1, spec={"name": "random"})
    await bus.js_publish(subjects.policy_updated, forged)


async def _stored_notice(bus: Bus, subjects: Any) -> tuple[PolicyUpdated, str]:
    raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
    return decode(PolicyUpdated, raw.data), raw.headers or {}


async def test_api_resync_replaces_an_unsigned_newest_notice(
    api: ApiHarness, bus: Bus, subjects, api_seed: Path
) -> None:
    active = await _signed_policy(api, "least_request")
    # the forgery copies the current revision, so comparing revisions alone sees nothing wrong
    await _poison(bus, subjects, active["revision"])
    assert api.service is not None and api.service.ctx is not None
    publisher = api.service.ctx.publisher
    before = STREAM_REPAIRS.labels("unsigned")._value.get()
    assert await publisher.resync()
    assert STREAM_REPAIRS.labels("unsigned")._value.get() == before + 1
    notice, headers = await _stored_notice(bus, subjects)
    verifier = Verifier([Signer.from_file(api_seed).public_key])
    raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
    assert verifier.reject_reason(raw.subject, raw.data, headers) == ""
    assert (notice.revision, notice.spec["name"]) == (active["revision"], "least_request")
    assert not await publisher.resync()  # its own notice now: nothing to do


async def test_router_skips_a_poisoned_stored_notice_and_gets_the_api_policy(
    api: ApiHarness, nats_url: str, subjects, bus: Bus, api_seed: Path
) -> None:
    alerts = await AlertInbox().start(bus)
    active = await _signed_policy(api, "least_request")
    await _poison(bus, subjects, active["revision"])
    before = _rejected("PolicyUpdated", "unsigned")
    async with Fleet(bus, nats_url, subjects, Signer.from_file(api_seed).public_key) as fleet:
        assert fleet.router is not None and fleet.router.router is not None
        r = fleet.router.router
        await alerts.next("unsigned")
        assert _rejected("PolicyUpdated", "unsigned") == before + 1
        # the router asked the api to repair the stream; the api's notice arrives live
        await wait_until(lambda: r.policies.control.name == "least_request", 5, "api policy")
        assert r.policies.revision == active["revision"]
    notice, headers = await _stored_notice(bus, subjects)
    assert notice.spec["name"] == "least_request" and headers.get(NONCE_HEADER)


async def test_stored_notice_older_than_the_window_is_still_accepted_at_start(
    api: ApiHarness, nats_url: str, subjects, bus: Bus, seed: bytes
) -> None:
    assert api.service is not None and api.service.ctx is not None
    # the api activated this policy a day ago (the stream keeps only its newest notice)
    api.service.ctx.bus.signer = Signer(seed, clock=lambda: time.time() - 24 * HOUR_S)
    active = await _signed_policy(api, "least_request")
    stale_before = _rejected("PolicyUpdated", "stale")
    async with Fleet(bus, nats_url, subjects, Signer(seed).public_key) as fleet:
        assert fleet.router is not None and fleet.router.router is not None
        r = fleet.router.router
        assert r.policies.control.name == "least_request"  # applied during start
        assert r.policies.revision == active["revision"]
        # live, the same day-old signature is stale
        raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
        await bus.client.publish(raw.subject, raw.data, headers=raw.headers)
        await wait_until(
            lambda: _rejected("PolicyUpdated", "stale") == stale_before + 1, 5, "stale rejected"
        )


def test_every_envelope_field_is_covered_by_the_signature() -> None:
    signer = Signer(new_seed(), instance="api-a")
    verifier = Verifier([signer.public_key])
    data = encode(WorkerControl(worker_id="w", action="drain"))
    headers = signer.headers("p.workers.control.w", data)
    assert verifier.reject_reason("p.workers.control.w", data, headers) == ""
    assert verifier.reject_reason("p.workers.control.x", data, headers) == "bad_signature"
    env = Envelope.from_headers(headers)
    assert env is not None
    changed = {
        "Kvgate-Instance": "api-b",
        "Kvgate-Seq": str(env.seq + 1),
        "Kvgate-Issued-At": str(env.issued_at_ms + 1),
        "Kvgate-Nonce": "A" * 22,
    }
    for name, value in changed.items():
        assert verifier.reject_reason("p.workers.control.w", data, {**headers, name: value}) == (
            "bad_signature"
        ), name
    missing = {k: v for k, v in headers.items() if k != NONCE_HEADER}
    assert verifier.reject_reason("p.workers.control.w", data, missing) == "bad_envelope"


def test_replay_guard_forgets_stale_nonces_and_stays_bounded() -> None:
    now = [1_000_000.0]
    guard = ReplayGuard(max_age_s=10, max_skew_s=1, max_nonces=3, clock=lambda: now[0])
    signer = Signer(new_seed(), clock=lambda: now[0])
    envs = [signer.envelope() for _ in range(5)]
    assert all(guard.check(f"s{i}", e) == "" for i, e in enumerate(envs))
    assert guard.check("s4", envs[4]) == "replayed"
    assert len(guard._nonces) == 3  # bounded: the oldest were dropped
    now[0] += 11  # every one of them is stale now: their nonces are forgotten, not needed
    assert guard.check("s4", envs[4]) == "stale"
    fresh = signer.envelope()
    assert guard.check("s9", fresh) == "" and list(guard._nonces) == [fresh.nonce]


async def test_a_router_started_after_a_drain_and_its_uncordon_rejects_the_captured_drain(
    api: ApiHarness, nats_url: str, subjects, bus: Bus, api_seed: Path
) -> None:
    """A router that saw neither the drain nor its uncordon (started after both, inside the
    freshness window) has no nonce or sequence to hold the captured drain against; the api
    re-sends the uncordon for the window, so the router holds a later sequence and the copy
    is out of order."""
    alerts = await AlertInbox().start(bus)
    subject = subjects.worker_control("sim-2")
    seen: asyncio.Queue[Any] = asyncio.Queue()

    async def capture(msg: Any) -> None:
        seen.put_nowait(msg)

    await bus.client.subscribe(subject, cb=capture)
    await bus.client.flush()
    assert (await api.call("POST", "/api/v1/workers/sim-2/drain", {}))[0] == 200
    drain = await asyncio.wait_for(seen.get(), 5)
    assert (await api.call("POST", "/api/v1/workers/sim-2/uncordon", {}))[0] == 200
    await asyncio.wait_for(seen.get(), 5)  # the uncordon, before any router started

    assert api.service is not None and api.service.controls is not None
    async with Fleet(bus, nats_url, subjects, Signer.from_file(api_seed).public_key) as fleet:
        # the republisher's round (driven here: the fixture turns the period off)
        assert await api.service.controls.once() == 1
        resent = await asyncio.wait_for(seen.get(), 5)
        assert decode(WorkerControl, resent.data).action == "uncordon"
        env = Envelope.from_headers(resent.headers)
        assert env is not None
        assert fleet.router is not None and fleet.router.router is not None
        guard = fleet.router.router.trust.replay
        await wait_until(
            lambda: guard.last_seq(env.signer, env.instance, subject) == env.seq,
            5,
            "the router took the re-sent uncordon",
        )
        before = _rejected("WorkerControl", "out_of_order")
        await bus.client.publish(drain.subject, drain.data, headers=drain.headers)
        await alerts.next("out_of_order")
        assert _rejected("WorkerControl", "out_of_order") == before + 1
        assert not fleet.draining("sim-2")

    # once the window has passed the uncordon is no longer re-sent, and its row is gone
    api.service.controls.uncordon_resend_s = 0.0
    assert await api.service.controls.once() == 0
    assert await api.service.controls.once() == 0
