"""The canary story against real Postgres and real NATS, fed with synthetic RouterOutcome
messages on the real ``router.outcomes`` stream (what routers publish): the real consumer,
evaluator, state machine and publisher run. Step durations are sped up to ~1 s."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable

import pytest

from services.api.canary import machine
from services.api.canary.runner import EvaluatorLoop
from services.api.canary.stats import ArmStats
from services.api.db import Database
from services.api.models import Canary
from services.api.testing import ApiHarness, start_api
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.schemas import PolicyUpdated, RouterOutcome, decode, encode, encode_batch
from services.common.streams import require_outcomes_stream

FAST = {
    "steps": [0.1, 0.5, 1.0],
    "step_duration_s": 1.0,
    "criteria": {"min_samples": 20, "max_ttft_p95_ratio": 1.3},
}


@pytest.fixture
async def api(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> AsyncIterator[ApiHarness]:
    h = await start_api(fresh_database_url, nats_url, subject_prefix)
    try:
        yield h
    finally:
        await h.close()


class SyntheticRouter:
    """Follows policy notices like a router and publishes outcomes for each arm: the
    candidate's TTFT is ``candidate_ttft``, the control's ``control_ttft``."""

    def __init__(self, bus: Bus, control_ttft: float, candidate_ttft: float) -> None:
        self.bus = bus
        self.ttft = {"control": control_ttft, "candidate": candidate_ttft}
        self.notice: PolicyUpdated | None = None
        self.notices: list[PolicyUpdated] = []
        self.sent = 0
        self._task: asyncio.Task[None] | None = None
        self.rng = random.Random(7)
        self._progress = asyncio.Event()
        self._noticed = asyncio.Event()

    async def wait_notice(self, pred: Callable[[PolicyUpdated], bool], timeout: float = 10) -> None:
        """Until a received notice satisfies ``pred`` (the API publishes a decision's notice
        after committing it, so the HTTP view can be ahead of the bus)."""
        async with asyncio.timeout(timeout):
            while not any(pred(n) for n in self.notices):
                self._noticed.clear()
                await self._noticed.wait()

    async def wait_sent(self, n: int) -> None:
        while self.sent < n:
            self._progress.clear()
            await self._progress.wait()

    async def start(self) -> None:
        await require_outcomes_stream(self.bus)

        async def on(n: PolicyUpdated, _raw) -> None:
            if self.notice is None or n.revision > self.notice.revision:
                self.notice = n
                self.notices.append(n)
                self._noticed.set()

        await self.bus.subscribe(self.bus.subjects.policy_updated, PolicyUpdated, on)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            # re-cancels: nats-py can swallow a cancel that lands inside a publish
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            n = self.notice
            if n is not None and n.canary is not None:
                for _ in range(20):
                    arm = "candidate" if self.rng.random() < n.canary.fraction else "control"
                    o = RouterOutcome(
                        request_id=f"r{self.sent}",
                        router_id="synthetic",
                        ts=time.time(),
                        policy=n.canary.candidate_name if arm == "candidate" else n.name,
                        arm=arm,
                        canary_id=n.canary.canary_id,
                        status="ok",
                        prompt_tokens=100,
                        cached_tokens=50,
                        ttft_s=self.ttft[arm] * (0.9 + 0.2 * self.rng.random()),
                    )
                    await self.bus.js_publish(self.bus.subjects.router_outcomes, o)
                    self.sent += 1
                self._progress.set()
            await asyncio.sleep(0.05)  # the synthetic traffic's pace, not synchronisation


async def setup_policies(api: ApiHarness) -> None:
    for name, algo in (("control", "kv_aware"), ("cand", "least_request")):
        status, _ = await api.call(
            "POST", "/api/v1/policies", {"name": name, "spec": {"name": algo}}
        )
        assert status == 201
    assert (await api.call("POST", "/api/v1/policies/control/activate"))[0] == 200


async def wait_state(api: ApiHarness, cid: str, states: set[str], timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, body = await api.call("GET", f"/api/v1/canaries/{cid}", token="viewer")
        if body["state"] in states:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"canary still {body['state']}: {body['decisions']}")
        await asyncio.sleep(0.1)  # polling the HTTP view; no event exists for it


async def test_better_candidate_is_promoted_step_by_step(api: ApiHarness, bus: Bus) -> None:
    await setup_policies(api)
    router = SyntheticRouter(bus, control_ttft=0.2, candidate_ttft=0.15)
    await router.start()
    try:
        status, c = await api.call("POST", "/api/v1/canaries", {"policy": "cand", **FAST})
        assert status == 201 and c["fraction"] == 0.1 and c["published"]
        assert (await api.call("POST", "/api/v1/canaries", {"policy": "cand"}))[0] == 409
        assert (await api.call("POST", "/api/v1/policies/control/activate"))[0] == 409
        done = await wait_state(api, c["id"], {"promoted", "rolled_back"})
    finally:
        await router.stop()
    assert done["state"] == "promoted", done["decisions"]
    # a step whose window closed before the synthetic traffic gave 20 samples per arm records
    # one "hold" for lack of samples (a loaded machine); anything else must not appear
    holds = [d for d in done["decisions"] if d["action"] == "hold"]
    assert all(d["reason"].startswith("step window over but too few samples") for d in holds)
    moves = [d for d in done["decisions"] if d["action"] != "hold"]
    actions = [(d["action"], d["fraction"]) for d in moves]
    assert actions == [("start", 0.1), ("advance", 0.1), ("advance", 0.5), ("complete", 1.0)]
    for d in moves[1:]:
        nums = d["numbers"]
        assert nums["candidate"]["requests"] >= 20 and all(x["passed"] for x in nums["checks"])
        ratio = next(x for x in nums["checks"] if x["name"] == "ttft_p95_ratio")["value"]
        assert ratio < 1.0
    # at 100 % the control's baseline came from the previous window
    assert done["decisions"][-1]["numbers"]["baseline_window"] == 1
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert (active["name"], active["canary"]) == ("cand", None)
    await router.wait_notice(lambda n: n.canary is None and n.name == "cand")
    fractions = [n.canary.fraction if n.canary else None for n in router.notices]
    assert fractions == [0.1, 0.5, 1.0, None]
    assert router.notices[-1].name == "cand"
    assert [n.revision for n in router.notices] == sorted({n.revision for n in router.notices})


async def test_worse_candidate_is_rolled_back_with_reason(api: ApiHarness, bus: Bus) -> None:
    await setup_policies(api)
    router = SyntheticRouter(bus, control_ttft=0.2, candidate_ttft=0.6)
    await router.start()
    try:
        _, c = await api.call("POST", "/api/v1/canaries", {"policy": "cand", **FAST})
        done = await wait_state(api, c["id"], {"promoted", "rolled_back"})
    finally:
        await router.stop()
    assert done["state"] == "rolled_back"
    assert "ttft_p95_ratio" in done["reason"]
    last = done["decisions"][-1]
    assert last["action"] == "rollback" and last["by"] == "api"
    check = next(x for x in last["numbers"]["checks"] if x["name"] == "ttft_p95_ratio")
    assert check["passed"] is False and check["value"] > 2.0
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert (active["name"], active["canary"]) == ("control", None)
    canary_revs = [n.revision for n in router.notices if n.canary is not None]
    assert canary_revs  # the router followed the canary
    await router.wait_notice(lambda n: n.canary is None and n.revision > max(canary_revs))
    s = bus.subjects
    notice = decode(
        PolicyUpdated, (await bus.js.get_last_msg(s.policy_stream, s.policy_updated)).data
    )
    assert notice.name == "control" and notice.canary is None
    _, audit = await api.call("GET", f"/api/v1/audit?target_id={c['id']}")
    assert [e["action"] for e in audit["entries"]] == ["canary.rollback", "canary.start"]


async def test_api_restart_mid_canary_resumes(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    api = await start_api(fresh_database_url, nats_url, subject_prefix)
    router = SyntheticRouter(bus, control_ttft=0.2, candidate_ttft=0.18)
    await router.start()
    try:
        await setup_policies(api)
        _, c = await api.call(
            "POST", "/api/v1/canaries", {"policy": "cand", **FAST, "step_duration_s": 1.5}
        )
        deadline = time.monotonic() + 20
        while (await api.call("GET", f"/api/v1/canaries/{c['id']}"))[1]["step_index"] < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await api.stop()  # the API goes away mid-canary; routers keep sending outcomes
        stopped_at = router.sent
        await asyncio.wait_for(router.wait_sent(stopped_at + 100), 20)
        await api.start()  # a fresh service on the same database and durable consumers
        done = await wait_state(api, c["id"], {"promoted", "rolled_back"})
    finally:
        await router.stop()
        await api.close()
    assert done["state"] == "promoted"
    windows = [d["window"] for d in done["decisions"] if d["action"] in ("advance", "complete")]
    assert windows == [0, 1, 2]


async def test_two_evaluators_never_decide_the_same_window_twice(
    fresh_database_url: str,
) -> None:
    from services.api.testing import migrate

    await migrate(fresh_database_url)
    dbs = [Database(fresh_database_url) for _ in range(3)]
    evaluators = [EvaluatorLoop(db, None, tick_s=0.01, name=f"e{i}") for i, db in enumerate(dbs)]
    try:
        async with dbs[0].transaction() as s:
            st = await machine.lock_state(s)
            st.active_name, st.active_version, st.active_spec = "a", 1, {"name": "random"}
            c = await machine.start(
                s,
                candidate=("b", 1, {"name": "random"}),
                control=("a", 1, {"name": "random"}),
                steps=[0.2, 0.6, 1.0],
                step_duration_s=10.0,
                criteria=machine.Criteria(min_samples=5),
                actor="test",
                now=1000.0,
            )
            cid = c.id
        good = ArmStats()
        for _ in range(10):
            good.add("ok", 0.1, 10, 5)
        now = 1000.0
        applied: list[list[tuple[str, str]]] = []
        for window in range(3):
            async with dbs[0].transaction() as s:
                for arm in ("control", "candidate"):
                    await machine.add_stats(s, cid, window, arm, good)
            now += 11.0
            results = await asyncio.gather(*(e.tick(now) for e in evaluators))
            applied.append([a for r in results for a in r])
            # everyone again: the state moved on, nobody re-decides the old window
            again = await asyncio.gather(*(e.tick(now) for e in evaluators))
            assert all(r == [] for r in again)
        assert [len(a) for a in applied] == [1, 1, 1]
        assert [a[0][1] for a in applied] == ["advance", "advance", "complete"]
        async with dbs[0].session() as s:
            from sqlalchemy import select

            from services.api.models import CanaryDecision

            rows = (
                (await s.execute(select(CanaryDecision).where(CanaryDecision.canary_id == cid)))
                .scalars()
                .all()
            )
            final = (await s.execute(select(Canary).where(Canary.id == cid))).scalar_one()
        transitions = [(r.window, r.action) for r in rows if r.action != "start"]
        assert sorted(transitions) == [(0, "advance"), (1, "advance"), (2, "complete")]
        assert final.state == "promoted"
    finally:
        for db in dbs:
            await db.close()


async def test_pause_resume_promote_abort_by_hand(api: ApiHarness, bus: Bus) -> None:
    await setup_policies(api)
    _, c = await api.call(
        "POST", "/api/v1/canaries", {"policy": "cand", **FAST, "step_duration_s": 600}
    )
    cid = c["id"]
    url = f"/api/v1/canaries/{cid}"
    assert (await api.call("POST", f"{url}/resume"))[0] == 409
    assert (await api.call("POST", f"{url}/pause", token="viewer"))[0] == 403
    status, body = await api.call("POST", f"{url}/pause", {"reason": "investigating"})
    assert status == 200 and body["state"] == "paused"
    status, body = await api.call("POST", f"{url}/resume")
    assert body["state"] == "running" and body["window"] == 1
    status, body = await api.call("POST", f"{url}/promote", {"to": "next"})
    assert body["step_index"] == 1 and body["fraction"] == 0.5 and body["published"]
    status, body = await api.call("POST", f"{url}/abort", {"reason": "changed my mind"})
    assert status == 200 and body["state"] == "aborted" and body["reason"] == "changed my mind"
    assert (await api.call("POST", f"{url}/promote"))[0] == 409
    _, full = await api.call("GET", url)
    assert [d["action"] for d in full["decisions"]] == [
        "start",
        "pause",
        "resume",
        "advance",
        "abort",
    ]
    assert all("control" in d["numbers"] for d in full["decisions"][1:])
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert active["name"] == "control" and active["canary"] is None
    # a new canary, promoted by hand to 100 %
    _, c2 = await api.call("POST", "/api/v1/canaries", {"policy": "cand"})
    assert c2["steps"] == [0.05, 0.25, 0.5, 1.0] and c2["step_duration_s"] == 600.0
    _, body = await api.call("POST", f"/api/v1/canaries/{c2['id']}/promote")
    assert body["state"] == "promoted"
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert active["name"] == "cand"
    assert (await api.call("DELETE", "/api/v1/policies/control"))[0] == 200
    assert (await api.call("DELETE", "/api/v1/policies/cand"))[0] == 409
    status, body = await api.call(
        "POST", "/api/v1/canaries", {"policy": "cand", "steps": [0.5, 0.2, 0.5]}
    )
    assert status == 400 and body["error"]["field"] == "steps"  # distinct (any order is fine)
    status, body = await api.call("POST", "/api/v1/canaries", {"policy": "cand", "steps": [0, 1]})
    assert status == 400 and body["error"]["field"] == "steps[0]"


async def test_outcomes_are_counted_per_arm_in_the_current_window(
    api: ApiHarness, bus: Bus
) -> None:
    """Streamed outcomes count their TTFT, non-streamed ones their end-to-end time; outcomes
    of other canaries, without a canary or from before the window are not counted. The
    candidate's arrive as one array (a router's tick), the rest one per message."""
    await setup_policies(api)
    _, c = await api.call(
        "POST", "/api/v1/canaries", {"policy": "cand", **FAST, "step_duration_s": 600}
    )
    await require_outcomes_stream(bus)
    now = time.time()

    def out(arm: str, **kw) -> RouterOutcome:
        base = dict(
            request_id="r",
            router_id="x",
            ts=now + 1,
            policy="p",
            arm=arm,
            canary_id=c["id"],
            prompt_tokens=100,
            cached_tokens=40,
        )
        return RouterOutcome(**{**base, **kw})

    msgs = (
        [out("candidate", ttft_s=0.1, e2e_s=2.0) for _ in range(5)]
        + [out("candidate", ttft_s=None, e2e_s=0.5) for _ in range(3)]
        + [out("control", status="timeout") for _ in range(2)]
        + [out("control", status="error"), out("control", status="cancelled")]
        + [out("control", canary_id=None), out("control", canary_id="other")]
        + [out("control", ts=now - 3600)]  # before the window
    )
    await bus.js.publish(bus.subjects.router_outcomes, encode_batch([encode(m) for m in msgs[:8]]))
    for m in msgs[8:]:
        await bus.js_publish(bus.subjects.router_outcomes, m)
    deadline = time.monotonic() + 10
    while True:
        _, body = await api.call("GET", f"/api/v1/canaries/{c['id']}")
        cur = body["current"]
        if cur["candidate"]["requests"] == 8 and cur["control"]["requests"] == 3:
            break
        assert time.monotonic() < deadline, cur
        await asyncio.sleep(0.05)  # polling the HTTP view; no event exists for it
    cand, ctrl = cur["candidate"], cur["control"]
    assert cand["ttft_samples"] == 8 and cand["ttft_p50_s"] < 0.11 < cand["ttft_p95_s"] < 0.6
    assert cand["cache_hit_rate"] == 0.4
    assert (ctrl["timeouts"], ctrl["errors"], ctrl["ttft_samples"]) == (2, 1, 0)
