"""The bus against a real NATS server: typed pub/sub, drops, request/reply, JetStream
durability across a consumer restart, idempotent stream setup, reconnect after a restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.bus import BUS_DROPPED, BUS_REPLY_FAILED, Bus, RemoteError
from services.common.schemas import (
    KvDumpRequest,
    RouterLoad,
    RouterOutcome,
    WorkerControl,
    encode,
    encode_batch,
)
from services.common.subjects import Subjects


async def test_publish_subscribe_typed(bus: Bus) -> None:
    got: asyncio.Queue[RouterLoad] = asyncio.Queue()

    async def handler(msg: RouterLoad, _raw) -> None:
        await got.put(msg)

    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, handler)
    sent = RouterLoad(router_id="r1", ts=1.0, inflight={"w": 2})
    await bus.publish(bus.subjects.router_load("r1"), sent)
    assert await asyncio.wait_for(got.get(), 5) == sent


async def test_invalid_message_is_counted_and_subscription_survives(bus: Bus) -> None:
    got: asyncio.Queue[RouterLoad] = asyncio.Queue()

    async def handler(msg: RouterLoad, _raw) -> None:
        await got.put(msg)

    before = BUS_DROPPED.labels("RouterLoad", "invalid")._value.get()
    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, handler)
    await bus.publish_raw(bus.subjects.router_load("r1"), b"\xc1 not msgpack")
    good = RouterLoad(router_id="r1", ts=2.0)
    await bus.publish(bus.subjects.router_load("r1"), good)
    assert await asyncio.wait_for(got.get(), 5) == good  # delivered in order after the bad one
    assert BUS_DROPPED.labels("RouterLoad", "invalid")._value.get() == before + 1


async def test_a_batched_type_arrives_one_by_one_in_either_form(bus: Bus) -> None:
    """``router.outcomes`` carries one RouterOutcome or an array of them (a router's tick):
    the handler sees each, in order; an array with one bad element is dropped whole and
    counted; an array of a type that is not batched is invalid."""
    got: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def handler(msg: RouterOutcome, _raw) -> None:
        await got.put(msg)

    def out(i: int) -> RouterOutcome:
        return RouterOutcome(request_id=f"r{i}", router_id="t", ts=float(i), policy="p")

    invalid = BUS_DROPPED.labels("RouterOutcome", "invalid")._value.get()
    await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, handler)
    subj = bus.subjects.router_outcomes
    await bus.publish_raw(subj, encode_batch([encode(out(i)) for i in range(3)]))
    await bus.publish_raw(subj, encode_batch([encode(out(9)), b"\xc0"]))  # nil: not an outcome
    await bus.publish(subj, out(3))
    assert [(await asyncio.wait_for(got.get(), 5)).request_id for _ in range(4)] == [
        "r0",
        "r1",
        "r2",
        "r3",
    ]
    assert got.empty()
    assert BUS_DROPPED.labels("RouterOutcome", "invalid")._value.get() == invalid + 1

    loads: asyncio.Queue[RouterLoad] = asyncio.Queue()

    async def on_load(msg: RouterLoad, _raw) -> None:
        await loads.put(msg)

    before = BUS_DROPPED.labels("RouterLoad", "invalid")._value.get()
    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, on_load)
    one = RouterLoad(router_id="r1", ts=1.0)
    await bus.publish_raw(bus.subjects.router_load("r1"), encode_batch([encode(one)]))
    await bus.publish(bus.subjects.router_load("r1"), one)
    assert await asyncio.wait_for(loads.get(), 5) == one
    assert BUS_DROPPED.labels("RouterLoad", "invalid")._value.get() == before + 1


async def test_handler_error_is_counted_not_fatal(bus: Bus) -> None:
    got: asyncio.Queue[int] = asyncio.Queue()

    async def handler(msg: RouterLoad, _raw) -> None:
        if msg.seq == 0:
            raise RuntimeError("boom")
        await got.put(msg.seq)

    before = BUS_DROPPED.labels("RouterLoad", "handler_error")._value.get()
    await bus.subscribe(bus.subjects.router_load_all, RouterLoad, handler)
    await bus.publish(bus.subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=0))
    await bus.publish(bus.subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=1))
    assert await asyncio.wait_for(got.get(), 5) == 1
    assert BUS_DROPPED.labels("RouterLoad", "handler_error")._value.get() == before + 1


async def test_request_reply(bus: Bus) -> None:
    async def responder(req: KvDumpRequest) -> WorkerControl:
        return WorkerControl(worker_id=req.worker_id, action="cordon")

    await bus.serve(bus.subjects.kv_dump("w1"), KvDumpRequest, responder)
    reply = await bus.request(
        bus.subjects.kv_dump("w1"), KvDumpRequest(worker_id="w1"), WorkerControl, timeout=5
    )
    assert reply.worker_id == "w1" and reply.action == "cordon"


async def test_reply_over_max_payload_is_an_explicit_error(bus: Bus) -> None:
    """A reply bigger than the server's max_payload used to vanish inside serve (the requester
    only saw its timeout); now the requester gets the reason at once and it is counted."""
    limit = bus.client.max_payload

    async def responder(req: KvDumpRequest) -> bytes:
        return b"x" * (limit + 1)

    before = BUS_REPLY_FAILED.labels("KvDumpRequest", "max_payload")._value.get()
    await bus.serve(bus.subjects.kv_dump("big"), KvDumpRequest, responder)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="max_payload"):
        await bus.request(
            bus.subjects.kv_dump("big"), KvDumpRequest(worker_id="big"), WorkerControl, timeout=10
        )
    assert time.monotonic() - t0 < 5  # the error reply, not the timeout
    assert BUS_REPLY_FAILED.labels("KvDumpRequest", "max_payload")._value.get() == before + 1


async def test_responder_error_and_bad_request_get_error_replies(bus: Bus) -> None:
    async def responder(req: KvDumpRequest) -> WorkerControl:
        if req.reason == "boom":
            raise ValueError("no such dump")
        return WorkerControl(worker_id=req.worker_id, action="drain")

    failed = BUS_REPLY_FAILED.labels("KvDumpRequest", "responder_error")._value.get()
    invalid = BUS_REPLY_FAILED.labels("KvDumpRequest", "invalid_request")._value.get()
    subject = bus.subjects.kv_dump("w2")
    await bus.serve(subject, KvDumpRequest, responder)
    with pytest.raises(RemoteError, match="no such dump"):
        await bus.request(subject, KvDumpRequest(worker_id="w2", reason="boom"), WorkerControl)
    reply = await bus.client.request(subject, encode(RouterLoad(router_id="r", ts=0)), timeout=5)
    assert "KvDumpRequest" in reply.headers["Kvgate-Error"]  # names what failed to decode
    # the subscription keeps serving
    ok = await bus.request(subject, KvDumpRequest(worker_id="w2"), WorkerControl, timeout=5)
    assert ok.action == "drain"
    assert BUS_REPLY_FAILED.labels("KvDumpRequest", "responder_error")._value.get() == failed + 1
    assert BUS_REPLY_FAILED.labels("KvDumpRequest", "invalid_request")._value.get() == invalid + 1


async def test_request_without_responder_times_out(bus: Bus) -> None:
    try:
        await bus.request(
            bus.subjects.kv_dump("nobody"),
            KvDumpRequest(worker_id="nobody"),
            WorkerControl,
            timeout=0.5,
        )
    except TimeoutError as exc:
        assert "nobody" in str(exc)
    else:
        raise AssertionError("expected TimeoutError")


async def test_durable_consumer_resumes_after_restart(
    nats_url: str, bus: Bus, subjects: Subjects
) -> None:
    stream = subjects.outcomes_stream
    await bus.js.add_stream(name=stream, subjects=[subjects.router_load_all], max_bytes=1 << 20)
    durable = subjects.durable("test_consumer")

    async def run_consumer(expect: int) -> list[int]:
        got: list[int] = []
        done = asyncio.Event()
        consumer_bus = Bus(nats_url, "consumer", subjects)
        await consumer_bus.connect(max_wait_s=5)

        async def handler(msg: RouterLoad, _raw) -> None:
            got.append(msg.seq)
            if len(got) >= expect:
                done.set()

        await consumer_bus.consume(
            stream, subjects.router_load_all, durable, RouterLoad, handler, batch=10
        )
        await asyncio.wait_for(done.wait(), 10)
        await consumer_bus.close()
        return got

    for i in range(5):
        await bus.js_publish(subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=i))
    assert await run_consumer(5) == [0, 1, 2, 3, 4]
    # published while no consumer runs: the durable consumer gets exactly these, nothing twice
    for i in range(5, 8):
        await bus.js_publish(subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=i))
    assert await run_consumer(3) == [5, 6, 7]


async def test_reconnects_after_server_restart(embedded_nats, subjects: Subjects) -> None:
    b = Bus(embedded_nats.url, "restart-test", subjects)
    await b.connect(max_wait_s=5)
    got: asyncio.Queue[int] = asyncio.Queue()

    async def handler(msg: RouterLoad, _raw) -> None:
        await got.put(msg.seq)

    await b.subscribe(subjects.router_load_all, RouterLoad, handler)
    await b.publish(subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=1))
    assert await asyncio.wait_for(got.get(), 5) == 1

    embedded_nats.stop()
    await asyncio.wait_for(b.disconnected.wait(), 10)
    embedded_nats.start()
    await asyncio.wait_for(b.connected.wait(), 20)  # nats-py reconnected by itself
    await b.publish(subjects.router_load("r"), RouterLoad(router_id="r", ts=0, seq=2))
    assert await asyncio.wait_for(got.get(), 5) == 2  # the subscription was restored
    await b.close()


async def test_connect_retries_until_server_appears(tmp_path, subjects: Subjects) -> None:
    from services.common.embedded import EmbeddedNats

    server = EmbeddedNats(tmp_path / "late")
    b = Bus(server.url, "late", subjects)
    task = asyncio.create_task(b.connect(max_wait_s=20))
    await asyncio.sleep(0.3)  # the client is retrying now; then the server comes up
    assert not task.done()
    await asyncio.to_thread(server.start)
    try:
        await asyncio.wait_for(task, 20)
        assert b.is_connected
    finally:
        await b.close()
        server.stop()
