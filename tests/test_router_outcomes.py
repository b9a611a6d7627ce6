"""The router's outcome publisher over a real NATS server (services/router/outcomes.py)."""

from __future__ import annotations

import asyncio

from services.common.bus import Bus
from services.common.embedded import EmbeddedNats
from services.common.schemas import RouterOutcome
from services.common.subjects import Subjects
from services.router.outcomes import OutcomePublisher


def _outcome(i: int) -> RouterOutcome:
    return RouterOutcome(
        request_id=f"r{i}",
        router_id="t",
        ts=0.0,
        policy="kv_aware",
        policy_version=1,
        arm="control",
        canary_id=None,
        model="m",
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
