"""Router replicas and control: global in-flight counts across two routers, policy hot reload
from policy.updated (within 1 s, no dropped request), the newest policy at startup, canary
arms, and routing on with NATS down (embedded server stopped and restarted)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp

from services.common.bus import Bus
from services.common.schemas import CanaryAssignment, PolicyUpdated, RouterOutcome
from services.common.streams import require_outcomes_stream, require_policy_stream
from services.common.subjects import Subjects
from services.router import metrics as M
from tests.test_router_support import Beats, FakeWorker, RouterProc, post, wait_until


async def test_two_routers_share_inflight_counts(nats_url, subjects, bus: Bus) -> None:
    hold = asyncio.Event()
    workers = [await FakeWorker(f"w{i}", hold=hold).start(bus) for i in range(4)]
    beats = Beats(bus, workers).start()
    a = await RouterProc(nats_url, subjects, policy="least_request", router_id="ra").start()
    b = await RouterProc(nats_url, subjects, policy="least_request", router_id="rb").start()
    try:
        await a.wait_workers(4)
        await b.wait_workers(4)
        async with aiohttp.ClientSession() as s:
            tasks = []
            for i, r in enumerate([a, b, a, b]):
                tasks.append(
                    asyncio.create_task(
                        post(s, r.url + "/v1/completions", {"model": "m", "prompt": f"q{i}"})
                    )
                )
                # the other router must see this one before the next request (an event on its side:
                # its global in-flight total reaches i + 1)
                other = b if r is a else a
                await wait_until(
                    lambda o=other, n=i + 1: (
                        sum(st.inflight for st in o.router.state.states.values()) == n
                    ),
                    what="in-flight shared",
                )
            # each worker got exactly one request although each router alone saw only two
            assert sorted(len(w.served) for w in workers) == [1, 1, 1, 1]
            hold.set()
            assert all(t[0] == 200 for t in await asyncio.gather(*tasks))
    finally:
        await a.stop()
        await b.stop()
        await beats.stop()
        for w in workers:
            await w.stop()


async def _publish_policy(bus: Bus, msg: PolicyUpdated) -> None:
    await require_policy_stream(bus)
    await bus.js_publish(bus.subjects.policy_updated, msg)


async def test_policy_hot_reload_within_1s_without_drops(nats_url, subjects, bus: Bus) -> None:
    workers = [await FakeWorker(f"w{i}").start(bus) for i in range(2)]
    beats = Beats(bus, workers).start()
    # a policy published before the router starts is the one it uses
    await _publish_policy(
        bus,
        PolicyUpdated(
            revision=1, name="rr-bar", version=1, spec={"name": "round_robin", "params": {}}
        ),
    )
    router = await RouterProc(nats_url, subjects, policy="random").start()
    r = router.router
    try:
        await router.wait_workers(2)
        # operators see the policy they named, at its version, not the algorithm
        async with aiohttp.ClientSession() as s, s.get(router.url + "/health") as resp:
            health = await resp.json()
        assert health["policy"] == "rr-bar@1" and health["policy_algorithm"] == "round_robin"
        assert r.policies.control.name == "round_robin" and r.policies.revision == 1
        statuses: Counter = Counter()
        policies: list[str] = []
        stop = asyncio.Event()

        async def load(s: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                st, h, _ = await post(
                    s,
                    router.url + "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
                )
                statuses[st] += 1
                policies.append(h.get("x-kvgate-policy", ""))

        async with aiohttp.ClientSession() as s:
            runners = [asyncio.create_task(load(s)) for _ in range(4)]
            await wait_until(lambda: len(policies) > 20, what="traffic flowing")
            applied = r.policy_applied
            t0 = time.monotonic()
            # params as a bare dict (spec without name) are accepted too
            await bus.publish(
                bus.subjects.policy_updated,
                PolicyUpdated(
                    revision=2, name="least_request", version=3, spec={"max_inflight": 50}
                ),
            )
            await asyncio.wait_for(applied.wait(), 1.0)
            assert time.monotonic() - t0 < 1.0
            n = len(policies)
            await wait_until(lambda: len(policies) > n + 20, what="traffic after reload")
            # an invalid notice is rejected; the active policy stays
            await bus.publish(
                bus.subjects.policy_updated,
                PolicyUpdated(
                    revision=3,
                    name="kv_aware",
                    version=4,
                    spec={"name": "kv_aware", "params": {"decode_weight": -5}},
                ),
            )
            # a stale revision is ignored
            await bus.publish(
                bus.subjects.policy_updated,
                PolicyUpdated(revision=1, name="prefix", version=1, spec={}),
            )
            m = len(policies)
            await wait_until(lambda: len(policies) > m + 20, what="more traffic")
            stop.set()
            await asyncio.gather(*runners)
        assert set(statuses) == {200}, statuses
        assert policies[0] == "rr-bar@1" and policies[-1] == "least_request@3"
        assert (
            r.policies.control.name == "least_request"
            and r.policies.control.params["max_inflight"] == 50
        )
        assert r.policies.revision == 2
    finally:
        await router.stop()
        await beats.stop()
        for w in workers:
            await w.stop()


async def test_canary_arms_are_deterministic_and_sticky(nats_url, subjects, bus: Bus) -> None:
    workers = [await FakeWorker(f"w{i}").start(bus) for i in range(2)]
    beats = Beats(bus, workers).start()
    stream = await require_outcomes_stream(bus)
    outs: dict[str, RouterOutcome] = {}
    got = asyncio.Event()

    async def on(o: RouterOutcome, _raw) -> None:
        outs[o.request_id] = o
        got.set()

    await bus.consume(
        stream, bus.subjects.router_outcomes, "t_canary", RouterOutcome, on, deliver_new=True
    )
    router = await RouterProc(nats_url, subjects).start()
    r = router.router
    try:
        await router.wait_workers(2)
        applied = r.policy_applied
        await bus.publish(
            bus.subjects.policy_updated,
            PolicyUpdated(
                revision=5,
                name="kv_aware",
                version=7,
                spec={"name": "kv_aware", "params": {}},
                canary=CanaryAssignment(
                    canary_id="c1",
                    fraction=0.3,
                    candidate_name="least_request",
                    candidate_version=2,
                    candidate_spec={"name": "least_request", "params": {}},
                ),
            ),
        )
        await asyncio.wait_for(applied.wait(), 1.0)
        arms: Counter = Counter()
        async with aiohttp.ClientSession() as s:
            for i in range(200):
                st, h, _ = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": "p", "max_tokens": 3},
                    {"x-request-id": f"r{i}"},
                )
                assert st == 200
                arms[h["x-kvgate-arm"]] += 1
                assert h["x-kvgate-policy"] == (
                    "least_request@2" if h["x-kvgate-arm"] == "candidate" else "kv_aware@7"
                )
            assert 30 <= arms["candidate"] <= 90, arms
            # a session stays on one arm
            for sid in ("alice", "bob", "carol", "dave"):
                seen = set()
                for i in range(8):
                    _, h, _ = await post(
                        s,
                        router.url + "/v1/completions",
                        {"model": "m", "prompt": "p", "max_tokens": 3},
                        {"x-session-id": sid, "x-request-id": f"{sid}{i}"},
                    )
                    seen.add(h["x-kvgate-arm"])
                assert len(seen) == 1
        await wait_until(lambda: len(outs) >= 232, what="outcomes")
        cand = [o for o in outs.values() if o.arm == "candidate"]
        assert cand and all(
            o.canary_id == "c1" and o.policy == "least_request" and o.policy_version == 2
            for o in cand
        )
        ctl = [o for o in outs.values() if o.arm == "control"]
        assert ctl and all(
            o.canary_id == "c1" and o.policy == "kv_aware" and o.policy_version == 7 for o in ctl
        )
    finally:
        await router.stop()
        await beats.stop()
        for w in workers:
            await w.stop()


async def test_routes_while_nats_is_down_and_reconnects(embedded_nats) -> None:
    url = embedded_nats.url
    subjects = Subjects("down")
    wbus = Bus(url, "workers", subjects)
    await wbus.connect(max_wait_s=10)
    workers = [await FakeWorker(f"w{i}").start(wbus) for i in range(2)]
    beats = Beats(wbus, workers).start()
    router = await RouterProc(url, subjects, policy="round_robin", worker_timeout=1.0).start()
    r = router.router
    try:
        await router.wait_workers(2)
        embedded_nats.stop()
        await wait_until(lambda: not r.bus.is_connected, what="router saw NATS go down")
        dropped0 = r.outcomes.dropped
        async with aiohttp.ClientSession() as s:
            # longer than worker_timeout: workers must not be aged out while the bus is down
            deadline = time.monotonic() + 2.5
            n = 0
            while time.monotonic() < deadline:
                st, _, body = await post(
                    s,
                    router.url + "/v1/completions",
                    {"model": "m", "prompt": f"{n}", "max_tokens": 3},
                )
                assert st == 200, body
                n += 1
            async with s.get(router.url + "/health") as resp:
                h = await resp.json()
            assert h["workers"] == 2 and h["nats"] is False
        embedded_nats.start()
        await wait_until(lambda: r.bus.is_connected, timeout=20, what="router reconnected")
        # outcomes buffered while down are published after the reconnect (or counted as drops)
        await wait_until(
            lambda: r.outcomes.queue.empty(), timeout=20, what="outcome buffer drained"
        )
        assert r.outcomes.published + (r.outcomes.dropped - dropped0) >= n
        await wait_until(lambda: r.state.routable_count() == 2, what="heartbeats again")
    finally:
        await router.stop()
        await beats.stop()
        for w in workers:
            await w.stop()
        await wbus.close()


async def test_processes_option_runs_replicas_on_one_port(nats_url, subjects, bus: Bus) -> None:
    """``kvgate router --processes 2``: two replicas share the port and report load separately;
    each serves its own metrics on ``--operator-port`` + its index (a second process used to
    fail binding the same operator port)."""
    import os
    import subprocess
    import sys

    from services.common.embedded import free_port
    from services.common.schemas import RouterLoad

    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    ids: set[str] = set()
    both = asyncio.Event()

    async def on_load(rl: RouterLoad, _raw) -> None:
        ids.add(rl.router_id)
        if len(ids) >= 2:
            both.set()

    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, on_load)
    port = free_port()
    operator = free_port()
    while operator + 1 == port:
        operator = free_port()
    env = {**os.environ, "NO_PROXY": "127.0.0.1"}
    proc = subprocess.Popen(  # noqa: ASYNC220
        [
            sys.executable,
            "-m",
            "services.cli",
            "router",
            "--port",
            str(port),
            "--nats-url",
            nats_url,
            "--subject-prefix",
            subjects.prefix.rstrip("."),
            "--processes",
            "2",
            "--operator-port",
            str(operator),
            "--router-id",
            "rp",
            "--load-interval",
            "0.2",
            "--log-level",
            "warning",
        ],
        env=env,
    )
    try:
        await asyncio.wait_for(both.wait(), 30)
        assert ids == {"rp-0", "rp-1"}
        async with aiohttp.ClientSession() as s:
            # each replica sees the worker (its operator port's /health: the public one says
            # only its status)
            for p in (operator, operator + 1):
                deadline, workers = time.monotonic() + 20, 0
                while workers < 1 and time.monotonic() < deadline:
                    try:
                        async with s.get(f"http://127.0.0.1:{p}/health") as r:
                            workers = (await r.json())["workers"]
                    except aiohttp.ClientConnectionError:  # not listening yet
                        pass
                    if workers < 1:
                        await asyncio.sleep(0.1)
                assert workers >= 1, p
            for i in range(10):
                st, h, _ = await post(
                    s, f"http://127.0.0.1:{port}/v1/completions", {"model": "m", "prompt": f"{i}"}
                )
                assert st == 200 and h["x-kvgate-worker"] == "w0"
            served = 0
            for p in (operator, operator + 1):  # one operator port per process, both alive
                async with s.get(f"http://127.0.0.1:{p}/metrics") as r:
                    assert r.status == 200
                    text = await r.text()
                    assert "kvgate_router_requests_total" in text
                    served += sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in text.splitlines()
                        if line.startswith("kvgate_router_requests_total{")
                    )
            assert served == 10  # the two processes' counters add up to the requests sent
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 20)
        await beats.stop()
        await w.stop()


async def test_a_router_alone_publishes_its_counts_only_periodically(
    nats_url, subjects, bus: Bus
) -> None:
    """A router nobody hears from announces its counts at start and then every
    ``load_interval``, not on every change (nobody reads them; at ~200 messages a second they
    cost it CPU under load); a router heard for the first time gets its counts at once, and
    changes follow within milliseconds from then on."""
    from services.common.schemas import RouterLoad

    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    got: list[RouterLoad] = []
    arrived = asyncio.Event()

    async def on_load(rl: RouterLoad, _raw) -> None:
        if rl.router_id == "solo":
            got.append(rl)
            arrived.set()

    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, on_load)
    # an interval far beyond the test: every message seen is the start's or a change's
    r = await RouterProc(nats_url, subjects, router_id="solo", load_interval=600.0).start()
    try:
        await wait_until(lambda: len(got) >= 1, what="the start announcement")
        await r.wait_workers(1)
        async with aiohttp.ClientSession() as s:
            for i in range(5):
                st, _h, _b = await post(
                    s, r.url + "/v1/completions", {"model": "m", "prompt": f"{i}"}
                )
                assert st == 200
            # nobody else heard: no peers on /health or in the metric
            async with s.get(r.url + "/health") as resp:
                assert (await resp.json())["peer_routers"] == []
            assert M.PEER_ROUTERS.value == 0
        # another router appears: the answer is this router's counts, published after anything
        # the requests above made it publish (one connection: NATS keeps its order)
        arrived.clear()
        await bus.publish(
            bus.subjects.router_load("peer"),
            RouterLoad(router_id="peer", ts=time.time(), seq=1, inflight={"w0": 3}),
        )
        await asyncio.wait_for(arrived.wait(), 10)
        assert len(got) == 2, [m.seq for m in got]  # the announcement, then the answer
        async with aiohttp.ClientSession() as s, s.get(r.url + "/health") as resp:
            assert (await resp.json())["peer_routers"] == ["peer"]
        assert M.PEER_ROUTERS.value == 1
        # heard by another router: a change is published at once
        hold = asyncio.Event()
        w.hold = hold
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(
                post(s, r.url + "/v1/completions", {"model": "m", "prompt": "held"})
            )
            await wait_until(
                lambda: any(m.inflight.get("w0") == 1 for m in got[2:]),
                what="the held request's count published",
            )
            hold.set()
            assert (await task)[0] == 200
    finally:
        await r.stop()
        await beats.stop()
        await w.stop()
