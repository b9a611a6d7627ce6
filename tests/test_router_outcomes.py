"""The router's outcome publisher over a real NATS server (services/router/outcomes.py): a
tick's outcomes as few bus messages as their size allows, never stuck while NATS is down."""

from __future__ import annotations

import asyncio

from services.common.bus import Bus
from services.common.embedded import EmbeddedNats
from services.common.schemas import RouterOutcome, decode_all, encode
from services.common.subjects import Subjects
from services.router.outcomes import OutcomePublisher


def _outcome(i: int, model: str = "m") -> RouterOutcome:
    return RouterOutcome(
        request_id=f"r{i}",
        router_id="t",
        ts=0.0,
        policy="kv_aware",
        policy_version=1,
        arm="control",
        canary_id=None,
        model=model,
        worker_id="w",
        status="ok",
        http_status=200,
        prompt_tokens=1,
        completion_tokens=1,
        predicted_cached_tokens=0,
        cached_tokens=None,
        ttft_s=0.01,
        e2e_s=0.02,
        retries=0,
        migrated=0,
        stream=False,
    )


async def test_publisher_never_spins_while_its_connection_is_down(tmp_path) -> None:
    """The server dies with outcomes queued. nats-py drops the connection before it calls the
    bus's disconnected callback, so for a moment the bus still says connected while the client
    is not: the publisher must wait without spinning (it used to loop on the set event without
    suspending, which froze the router's whole event loop for good), then publish once the
    server is back."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    bus = Bus(server.url, "outcomes-test", Subjects("outc"))
    await bus.connect(max_wait_s=10)
    pub = OutcomePublisher(bus, tick_s=0.01)
    pub.start()
    try:
        pub.submit(_outcome(0))
        await asyncio.wait_for(pub.queue.join(), 10)
        assert pub.published == 1
        server.kill()
        await asyncio.wait_for(bus.disconnected.wait(), 10)
        # back to the moment before the bus's callback ran: the client down, the bus's
        # connected event still set
        assert not bus.is_connected
        bus.connected.set()
        for i in range(1, 4):
            pub.submit(_outcome(i))
        ticks = 0
        for _ in range(20):  # the loop keeps running other tasks meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and pub.published == 1 and pub.dropped == 0
        server.start()  # back on the same port: the client reconnects, the batch goes out
        await asyncio.wait_for(pub.queue.join(), 30)
        assert pub.published == 4 and pub.dropped == 0
    finally:
        await pub.stop(0.5)
        await bus.close()
        server.stop()


async def _published(
    bus: Bus, outcomes: list[RouterOutcome], want: int, **publisher: int
) -> tuple[list[bytes], list[RouterOutcome], OutcomePublisher]:
    """Submit ``outcomes`` in one tick; the raw messages on router.outcomes until ``want``
    outcomes arrived, the outcomes in them, and the stopped publisher."""
    payloads: list[bytes] = []
    got: list[RouterOutcome] = []
    arrived = asyncio.Event()

    async def on(msg) -> None:
        payloads.append(msg.data)
        got.extend(decode_all(RouterOutcome, msg.data))
        if len(got) >= want:
            arrived.set()

    await bus.client.subscribe(bus.subjects.router_outcomes, cb=on)
    pub = OutcomePublisher(bus, tick_s=0.05, **publisher)
    pub.start()
    for o in outcomes:
        pub.submit(o)
    await asyncio.wait_for(arrived.wait(), 10)
    await asyncio.wait_for(pub.queue.join(), 10)
    await pub.stop(1.0)
    return payloads, got, pub


async def test_a_ticks_outcomes_go_out_as_one_message_cut_at_message_bytes(tmp_path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    buses = [Bus(server.url, f"outcomes-test{i}", Subjects(f"outb{i}")) for i in range(2)]
    try:
        for b in buses:
            await b.connect(max_wait_s=10)
        # the default size: a tick's 40 outcomes in one message, in order
        payloads, got, pub = await _published(buses[0], [_outcome(i) for i in range(40)], 40)
        assert [o.request_id for o in got] == [f"r{i}" for i in range(40)]
        assert len(payloads) == 1 and pub.messages == 1 and pub.published == 40

        # a small limit: several messages, none over it, each as full as it could be
        size = len(encode(_outcome(10)))  # r10..r49 all encode to this size
        limit = 7 * size + size // 2
        outs = [_outcome(i) for i in range(10, 50)]
        payloads, got, pub = await _published(buses[1], outs, 40, message_bytes=limit)
        assert [o.request_id for o in got] == [f"r{i}" for i in range(10, 50)]
        counts = [len(decode_all(RouterOutcome, p)) for p in payloads]
        assert counts == [7, 7, 7, 7, 7, 5] and pub.messages == 6
        assert all(len(p) <= limit + 16 for p in payloads)
    finally:
        for b in buses:
            await b.close()
        server.stop()


async def test_an_outcome_over_the_servers_max_payload_is_dropped_and_counted(tmp_path) -> None:
    """One outcome larger than the server takes goes alone and is counted as ``too_large``;
    the tick's other outcomes still go out."""
    from services.router.metrics import OUTCOMES_DROPPED

    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    bus = Bus(server.url, "outcomes-test", Subjects("outd"))
    try:
        await bus.connect(max_wait_s=10)
        before = OUTCOMES_DROPPED.labels("too_large").value
        huge = "x" * (bus.client.max_payload + 1)
        outs = [_outcome(0), _outcome(1, model=huge), _outcome(2)]
        _payloads, got, pub = await _published(bus, outs, 2)
        assert [o.request_id for o in got] == ["r0", "r2"]
        assert (pub.published, pub.dropped) == (2, 1)
        assert OUTCOMES_DROPPED.labels("too_large").value == before + 1
    finally:
        await bus.close()
        server.stop()
