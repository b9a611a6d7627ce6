"""Defence in depth: a credential that NATS lets publish (here the test's unrestricted one, the
"privileged but wrong" case) still cannot steer a router. The router, with the real api and its
signing key:

- drops a heartbeat whose payload names another worker than its subject (the "evil" hijack);
- drops an unsigned or foreign-signed workers.control drain;
- drops an unsigned policy.updated with revision 10^9, and one signed by the api's key with a
  revision the api never stored (a replay "from the future");
- counts each in kvgate_router_rejected_messages_total and raises a forged_message alert;
- still applies the api's real activation afterwards (no lock-out), and the api's resync repairs
  a POLICY stream that holds the forged revision.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.api.testing import ApiHarness, start_api
from services.common.bus import Bus
from services.common.schemas import Alert, PolicyUpdated, WorkerControl, decode
from services.common.signing import Signer, new_seed
from services.common.streams import require_alert_streams, require_policy_stream
from services.router.trust import REJECTED
from tests.test_router_support import Beats, FakeWorker, RouterProc


def _rejected(type_name: str, reason: str) -> float:
    return REJECTED.labels(type_name, reason)._value.get()


@pytest.fixture
def api_seed(tmp_path: Path) -> Path:
    path = tmp_path / "api.nk"
    path.write_bytes(new_seed())
    return path


@pytest.fixture
async def api(
    fresh_database_url: str, nats_url: str, subject_prefix: str, api_seed: Path
) -> AsyncIterator[ApiHarness]:
    h = await start_api(
        fresh_database_url,
        nats_url,
        subject_prefix,
        admin_token="boot-admin-token-123",
        signing_seed=str(api_seed),
    )
    yield h
    await h.stop()


class AlertInbox:
    """forged_message alert signals the router sends, as they arrive."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Alert] = asyncio.Queue()

    async def start(self, bus: Bus) -> AlertInbox:
        await require_alert_streams(bus)

        async def on(msg) -> None:
            alert = decode(Alert, msg.data)
            if alert.kind == "forged_message":
                self.queue.put_nowait(alert)

        await bus.client.subscribe(bus.subjects.alert_signal("router"), cb=on)
        return self

    async def next(self, reason: str) -> Alert:
        while True:
            alert = await asyncio.wait_for(self.queue.get(), 5)
            if alert.details.get("reason") == reason:
                return alert


async def test_router_rejects_forgeries_from_a_privileged_credential(
    api: ApiHarness, nats_url, subjects, bus: Bus, api_seed: Path
) -> None:
    alerts = await AlertInbox().start(bus)
    workers = [await FakeWorker(f"w{i}").start(bus) for i in range(2)]
    beats = Beats(bus, workers).start()
    api_key = Signer.from_file(api_seed).public_key
    router = await RouterProc(
        nats_url, subjects, policy="round_robin", trusted_signers=api_key
    ).start()
    r = router.router
    assert r is not None
    try:
        await router.wait_workers(2)

        # 1. the hijack: "evil" announced on w0's subject
        before = _rejected("WorkerHeartbeat", "subject_mismatch")
        evil = workers[0].heartbeat()
        evil.worker_id, evil.url = "evil", "http://127.0.0.1:9/attacker"
        await bus.publish(subjects.heartbeat("w0"), evil)
        await alerts.next("subject_mismatch")
        assert _rejected("WorkerHeartbeat", "subject_mismatch") == before + 1
        assert "evil" not in r.state.states

        # 2. a drain nobody signed, and one signed by a key the router does not trust
        before = _rejected("WorkerControl", "unsigned")
        await bus.publish(
            subjects.worker_control("w1"), WorkerControl(worker_id="w1", action="drain")
        )
        await alerts.next("unsigned")
        assert _rejected("WorkerControl", "unsigned") == before + 1
        rogue = Bus(nats_url, "rogue", subjects)
        rogue.signer = Signer(new_seed())
        await rogue.connect(max_wait_s=5)
        try:
            await rogue.publish(
                subjects.worker_control("w1"), WorkerControl(worker_id="w1", action="drain")
            )
            await alerts.next("untrusted_signer")
        finally:
            await rogue.close()
        assert r.state.routable_count() == 2  # nobody was drained

        # 3. the lock-out: revision 10^9, unsigned, into the POLICY stream itself
        await require_policy_stream(bus)
        forged = PolicyUpdated(revision=10**9, name="random", version=1, spec={"name": "random"})
        await bus.js_publish(subjects.policy_updated, forged)
        await alerts.next("unsigned")
        assert r.policies.revision < 10**9

        # ... and a notice signed with the api's key (say, replayed from an older deployment)
        # carrying a revision the api never stored: from the future
        replay = Bus(nats_url, "replay", subjects)
        replay.signer = Signer.from_file(api_seed)
        await replay.connect(max_wait_s=5)
        try:
            before = _rejected("PolicyUpdated", "future_revision")
            await replay.publish(subjects.policy_updated, forged)
            await alerts.next("future_revision")
            assert _rejected("PolicyUpdated", "future_revision") == before + 1
        finally:
            await replay.close()
        assert r.policies.revision < 10**9

        # the api's real activation is applied (not shadowed by 10^9)
        applied = r.policy_applied
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": "lr", "spec": {"name": "least_request"}}
        )
        assert status in (200, 201)
        assert (await api.call("POST", "/api/v1/policies/lr/activate"))[0] == 200
        await asyncio.wait_for(applied.wait(), 5)
        assert r.policies.control.name == "least_request"
        _, active = await api.call("GET", "/api/v1/active-policy")
        assert r.policies.revision == active["revision"]

        # and the POLICY stream no longer holds the forged revision after the api's resync
        async def stream_revision() -> int:
            raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
            return decode(PolicyUpdated, raw.data).revision

        assert await stream_revision() == active["revision"]
    finally:
        await router.stop()
        await beats.stop()
        for w in workers:
            await w.stop()


async def test_stream_with_a_forged_revision_is_repaired_by_resync(
    api: ApiHarness, bus: Bus, subjects
) -> None:
    status, _ = await api.call(
        "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
    )
    assert status in (200, 201)
    assert (await api.call("POST", "/api/v1/policies/p/activate"))[0] == 200
    await require_policy_stream(bus)
    forged = PolicyUpdated(revision=10**9, name="random", version=1, spec={"name": "random"})
    await bus.js_publish(subjects.policy_updated, forged)
    assert api.service is not None and api.service.ctx is not None
    assert await api.service.ctx.publisher.resync()  # before: ">= stored" meant "nothing to do"
    raw = await bus.js.get_last_msg(subjects.policy_stream, subjects.policy_updated)
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert decode(PolicyUpdated, raw.data).revision == active["revision"] < 10**9
