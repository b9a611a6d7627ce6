"""``kvgate epp``: a real gRPC client with Envoy's generated protos plays the gateway's part
against the EPP's ext_proc server, whose router core follows real heartbeats and KV events on
a real NATS (and the real kv_indexer): picks as header + ``envoy.lb`` metadata, bodies in
chunks, headers-only requests, subset hints, empty pools, shedding, health, and the same pick
as ``kvgate router`` on the same state."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.schemas import RouterOutcome, WorkerCapacity
from services.epp import protocol as P
from services.epp.cli import settings as epp_settings
from services.epp.server import EppServer
from services.router.app import Router
from tests.test_router_support import (
    Beats,
    FakeWorker,
    Indexer,
    RouterProc,
    post,
    shutdown,
    wait_until,
)

STEP_S = 10.0  # bound on any one answer, so a silent EPP fails its test instead of hanging it


class EppProc:
    """The EPP's Router core and gRPC server in this event loop, on its own bus connection."""

    def __init__(self, nats_url: str, subjects: Any, **overrides: Any) -> None:
        self.nats_url, self.subjects, self.overrides = nats_url, subjects, overrides
        self.bus: Bus | None = None
        self.router: Router | None = None
        self.server: EppServer | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> EppProc:
        st = epp_settings(
            nats_url=self.nats_url,
            subject_prefix=self.subjects.prefix.rstrip("."),
            **{"queue_timeout": 2.0, **self.overrides},
        )
        self.bus = Bus(self.nats_url, "epp-test", self.subjects)
        await self.bus.connect(max_wait_s=10)
        self.router = Router(st, self.bus)
        await self.router.start()
        self.server = EppServer(self.router, st.max_body_bytes, st.conformance_test_epp)
        port = await self.server.start("127.0.0.1", 0)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(0.5)
        if self.router is not None:
            await self.router.stop()
        if self.bus is not None:
            await self.bus.close()

    def envoy(self) -> Envoy:
        assert self.channel is not None
        return Envoy(pb_grpc.ExternalProcessorStub(self.channel).Process())

    async def wait_workers(self, n: int) -> None:
        r = self.router
        assert r is not None
        await wait_until(lambda: r.state.routable_count() >= n, 10, f"{n} routable workers")


class Envoy:
    """One ext_proc stream, driven as Envoy's filter drives it in FULL_DUPLEX_STREAMED mode."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def send(self, req: pb.ProcessingRequest) -> None:
        await asyncio.wait_for(self.call.write(req), STEP_S)

    async def recv(self) -> pb.ProcessingResponse:
        resp = await asyncio.wait_for(self.call.read(), STEP_S)
        assert resp is not grpc.aio.EOF, "the EPP ended the stream"
        return resp

    async def close(self) -> None:
        await asyncio.wait_for(self.call.done_writing(), STEP_S)
        # the EPP ends its side once ours is done
        assert await asyncio.wait_for(self.call.read(), STEP_S) is grpc.aio.EOF


def request_headers(
    path: str = "/v1/completions",
    eos: bool = False,
    subset: list[str] | None = None,
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": path, "content-type": "application/json", **(extra or {})}
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]
            ),
            end_of_stream=eos,
        )
    )
    if subset is not None:
        hint = req.metadata_context.filter_metadata[P.SUBSET_NAMESPACE].fields[P.SUBSET_KEY]
        hint.list_value.SetInParent()  # an empty list is a hint too
        hint.list_value.values.extend(struct_pb2.Value(string_value=e) for e in subset)
    return req


def body_chunk(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def response_headers(status: int, served: str | None) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                    base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                ]
            )
        )
    )
    if served is not None:
        req.metadata_context.filter_metadata[P.LB_NAMESPACE].fields[
            P.SERVED_KEY
        ].string_value = served
    return req


def picked(resp: pb.ProcessingResponse, body_len: int | None) -> str:
    """The endpoint a request-headers answer names; header and metadata must agree."""
    assert resp.WhichOneof("response") == "request_headers", resp
    common = resp.request_headers.response
    assert common.clear_route_cache
    sets = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    endpoint = sets[P.DESTINATION_HEADER]
    md = resp.dynamic_metadata.fields[P.LB_NAMESPACE].struct_value.fields
    assert md[P.DESTINATION_HEADER].string_value == endpoint
    if body_len is None:
        assert "content-length" not in sets
    else:
        assert sets["content-length"] == str(body_len)
    return endpoint


def immediate(resp: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    ir = resp.immediate_response
    return ir.status.code, json.loads(ir.body)


def endpoint_of(w: FakeWorker) -> str:
    return f"127.0.0.1:{w.port}"


def picks(result: str) -> float:
    return REGISTRY.get_sample_value("kvgate_epp_picks_total", {"result": result}) or 0.0


async def pick_once(epp: EppProc, body: dict[str, Any], **kw: Any) -> pb.ProcessingResponse:
    """One whole request whose body comes in one chunk: the EPP's first answer."""
    e = epp.envoy()
    raw = json.dumps(body).encode()
    await e.send(request_headers(**kw))
    await e.send(body_chunk(raw, True))
    first = await e.recv()
    if first.WhichOneof("response") == "request_headers":
        assert (await e.recv()).request_body.response.body_mutation.streamed_response.body == raw
    await e.close()
    return first


async def test_pick_from_chunked_body_and_streamed_response(nats_url, subjects, bus: Bus) -> None:
    w0, w1 = await FakeWorker("w0").start(bus), await FakeWorker("w1").start(bus)
    beats = Beats(bus, [w0, w1]).start()
    epp = await EppProc(nats_url, subjects).start()
    r = epp.router
    assert r is not None
    try:
        await epp.wait_workers(2)
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}], "stream": True}
        ).encode()
        e = epp.envoy()
        await e.send(request_headers("/v1/chat/completions"))
        # no answer until the body's last chunk: the prompt is read from the whole body
        await e.send(body_chunk(body[:7], False))
        await e.send(body_chunk(body[7:40], False))
        await e.send(body_chunk(body[40:], True))
        endpoint = picked(await e.recv(), len(body))
        assert endpoint in {endpoint_of(w0), endpoint_of(w1)}
        sent_back = await e.recv()
        assert sent_back.request_body.response.body_mutation.streamed_response.body == body
        assert sent_back.request_body.response.body_mutation.streamed_response.end_of_stream
        wid = "w0" if endpoint == endpoint_of(w0) else "w1"
        assert r.state.states[wid].inflight == 1  # the pick holds its ticket until the end
        # the response passes through chunk by chunk
        await e.send(response_headers(200, endpoint))
        assert (await e.recv()).WhichOneof("response") == "response_headers"
        for i, chunk in enumerate((b"data: {}\n\n", b"data: {}\n\ndata: [DONE]\n\n")):
            await e.send(
                pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=i == 1))
            )
            back = (await e.recv()).response_body.response.body_mutation.streamed_response
            assert back.body == chunk and back.end_of_stream == (i == 1)
        await e.close()
        await wait_until(lambda: r.state.states[wid].inflight == 0, 5, "ticket released")
        # a body whose end is its trailers (no end_of_stream on the last chunk)
        e = epp.envoy()
        await e.send(request_headers("/v1/chat/completions"))
        await e.send(body_chunk(body, False))
        await e.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        picked(await e.recv(), len(body))
        assert (await e.recv()).request_body.response.body_mutation.streamed_response.body == body
        assert (await e.recv()).WhichOneof("response") == "request_trailers"
        await e.close()
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()
        await w1.stop()


async def test_headers_only_request_and_bad_body(nats_url, subjects, bus: Bus) -> None:
    w0 = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w0]).start()
    epp = await EppProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(1)
        e = epp.envoy()
        await e.send(request_headers("/v1/models", eos=True))
        assert picked(await e.recv(), None) == endpoint_of(w0)
        await e.close()
        # not JSON, and JSON without a prompt: 400 in OpenAI's error shape, no pick
        bad0 = picks("400")
        e = epp.envoy()
        await e.send(request_headers())
        await e.send(body_chunk(b"{not json", True))
        status, err = immediate(await e.recv())
        assert status == 400 and "not valid JSON" in err["error"]["message"]
        first = await pick_once(epp, {"model": "m"})
        status, err = immediate(first)
        assert status == 400 and err["error"]["param"] == "prompt"
        assert picks("400") == bad0 + 2
        # a body before any headers: the stream fails with INVALID_ARGUMENT, the EPP goes on
        e = epp.envoy()
        await e.send(body_chunk(b"{}", True))
        try:
            await asyncio.wait_for(e.call.read(), STEP_S)
            raise AssertionError("the stream was not failed")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        sample = {"reason": "body_before_headers"}
        assert REGISTRY.get_sample_value("kvgate_epp_protocol_errors_total", sample) >= 1
        e = epp.envoy()
        await e.send(request_headers("/v1/models", eos=True))
        assert picked(await e.recv(), None) == endpoint_of(w0)
        await e.close()
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()


async def test_subset_hint_honoured_or_503(nats_url, subjects, bus: Bus) -> None:
    ws = [await FakeWorker(f"w{i}").start(bus) for i in range(3)]
    beats = Beats(bus, ws).start()
    epp = await EppProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(3)
        body = {"model": "m", "prompt": "subset " * 20, "max_tokens": 4}
        for i in range(6):
            only = [endpoint_of(ws[i % 3]), "10.9.9.9:8000"]  # one not in the pool at all
            assert picked(await pick_once(epp, body, subset=only), len(json.dumps(body))) == only[0]
        for empty in ([], ["10.9.9.9:8000"]):
            status, err = immediate(await pick_once(epp, body, subset=empty))
            assert status == 503 and err["error"]["type"] == "service_unavailable"
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        for w in ws:
            await w.stop()


async def test_no_worker_is_503_and_dead_worker_is_left(nats_url, subjects, bus: Bus) -> None:
    epp = await EppProc(nats_url, subjects, worker_timeout=1.0).start()
    w0, w1 = await FakeWorker("w0").start(bus), await FakeWorker("w1").start(bus)
    beats: Beats | None = None
    try:
        body = {"model": "m", "prompt": "nobody", "max_tokens": 4}
        status, _ = immediate(await pick_once(epp, body))
        assert status == 503
        e = epp.envoy()
        await e.send(request_headers("/v1/models", eos=True))
        assert immediate(await e.recv())[0] == 503
        beats = Beats(bus, [w0, w1]).start()
        await epp.wait_workers(2)
        beats.paused.add("w0")  # w0 dies: no more heartbeats
        r = epp.router
        assert r is not None
        await wait_until(lambda: r.state.routable_count() == 1, 10, "w0 timed out")
        for _ in range(4):
            assert picked(await pick_once(epp, body), len(json.dumps(body))) == endpoint_of(w1)
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop() if beats else asyncio.sleep(0)))
        await w0.stop()
        await w1.stop()


async def test_shed_is_429_with_llmd_slo_header(nats_url, subjects, bus: Bus) -> None:
    spec = {"name": "slo_aware", "params": {"shed": True, "prior": {"prefill_token_s": 1.0}}}
    w0 = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w0]).start()
    epp = await EppProc(nats_url, subjects, policy=json.dumps(spec)).start()
    try:
        await epp.wait_workers(1)
        body = {"model": "m", "prompt": "a" * 10, "max_tokens": 4}
        # predicted ~10 s TTFT > 100 ms: no worker meets it, the policy sheds
        status, err = immediate(await pick_once(epp, body, extra={"x-llm-d-slo-ttft-ms": "100"}))
        assert status == 429 and "SLO" in err["error"]["message"]
        first = await pick_once(epp, body, extra={"x-slo-ttft-ms": "600000"})
        assert picked(first, len(json.dumps(body))) == endpoint_of(w0)
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()


async def test_health_services(nats_url, subjects, bus: Bus) -> None:
    w0 = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w0]).start()
    epp = await EppProc(nats_url, subjects).start()
    try:
        assert epp.channel is not None
        stub = health_pb2_grpc.HealthStub(epp.channel)

        async def status(name: str) -> int:
            req = health_pb2.HealthCheckRequest(service=name)
            return (await asyncio.wait_for(stub.Check(req), STEP_S)).status

        serving = health_pb2.HealthCheckResponse.SERVING
        assert await status("liveness") == serving
        await epp.wait_workers(1)
        r = epp.router
        assert r is not None
        await wait_until(lambda: r.readiness.ready()[0], 10, "router core ready")
        assert await status("readiness") == serving
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == serving
        r.readiness.start_draining()  # stopping: no new traffic, still alive
        assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()


async def test_same_pick_as_the_router(nats_url, subjects, bus: Bus) -> None:
    """One trace of prompts, each cached on one of three workers, decided by the EPP and
    explained by the router's /debug/route on the same state: the same worker each time."""
    indexer = await Indexer(nats_url, subjects).start()
    ws = [await FakeWorker(f"w{i}").start(bus) for i in range(3)]
    beats = Beats(bus, ws).start()
    epp = await EppProc(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(3)
        await router.wait_workers(3)
        prompts = [f"document {i} " * 30 for i in range(6)]
        for i, p in enumerate(prompts):
            await ws[i % 3].publish_kv(p)
        assert epp.router is not None and router.router is not None
        replicas = (epp.router.index_source.index, router.router.index_source.index)
        blocks = len(prompts[0]) // 16  # whole blocks per prompt (byte-level tokens)
        await wait_until(
            lambda: all(ix.blocks_of(w.worker_id) >= 2 * blocks for ix in replicas for w in ws),
            10,
            "both index replicas hold every worker's blocks",
        )
        by_endpoint = {endpoint_of(w): w.worker_id for w in ws}
        chosen = []
        async with aiohttp.ClientSession() as s:
            # prompts cached somewhere only: between idle workers with no prefix the pick
            # also depends on what the live policy remembers of its own past picks, which
            # /debug/route (deciding on a copy) has not made
            for p in prompts + [prompts[0], prompts[4]]:
                body = {"model": "m", "prompt": p, "max_tokens": 8}
                st, _, raw = await post(s, router.url + "/debug/route", body)
                assert st == 200, raw
                want = json.loads(raw)["worker"]
                got = picked(await pick_once(epp, body), len(json.dumps(body)))
                assert by_endpoint[got] == want, (p[:20], got, want)
                chosen.append(want)
        assert chosen[:6] == [f"w{i % 3}" for i in range(6)]  # the KV-aware picks, not one worker
    finally:
        await shutdown(
            ("router", router.stop()),
            ("epp", epp.stop()),
            ("beats", beats.stop()),
            ("indexer", indexer.stop()),
        )
        for w in ws:
            await w.stop()


async def test_outcomes_name_the_served_endpoint(nats_url, subjects, bus: Bus) -> None:
    """Outcomes as the router's: one per request, naming the worker the data plane says
    served it (x-gateway-destination-endpoint-served), cancelled when the stream drops."""
    w0, w1 = await FakeWorker("w0").start(bus), await FakeWorker("w1").start(bus)
    beats = Beats(bus, [w0, w1]).start()
    outcomes: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on_outcome(o: RouterOutcome, _raw: Any) -> None:
        await outcomes.put(o)

    sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on_outcome)
    epp = await EppProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(2)
        other = {endpoint_of(w0): endpoint_of(w1), endpoint_of(w1): endpoint_of(w0)}
        wid_at = {endpoint_of(w0): "w0", endpoint_of(w1): "w1"}
        body = json.dumps({"model": "m", "prompt": "served " * 30, "stream": True}).encode()
        for served_elsewhere in (False, True):
            e = epp.envoy()
            await e.send(request_headers(extra={"x-request-id": f"rid-{served_elsewhere}"}))
            await e.send(body_chunk(body, True))
            endpoint = picked(await e.recv(), len(body))
            await e.recv()  # the body sent back
            served = other[endpoint] if served_elsewhere else endpoint
            await e.send(response_headers(200, served))
            await e.recv()
            chunk = b'data: {"choices":[{"text":"x"}]}\n\n'
            await e.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
            await e.recv()
            # the usage chunk split across two body messages: read once whole
            usage = (
                b'data: {"choices":[],"usage":{"prompt_tokens":210,"completion_tokens":7,'
                b'"prompt_tokens_details":{"cached_tokens":16}}}\n\ndata: [DONE]\n\n'
            )
            for part, end in ((usage[:30], False), (usage[30:], True)):
                await e.send(
                    pb.ProcessingRequest(response_body=pb.HttpBody(body=part, end_of_stream=end))
                )
                await e.recv()
            await e.close()
            o = await asyncio.wait_for(outcomes.get(), STEP_S)
            assert o.request_id == f"rid-{served_elsewhere}"
            assert (o.worker_id, o.status, o.http_status) == (wid_at[served], "ok", 200)
            assert o.ttft_s is not None and o.ttft_s > 0
            assert (o.completion_tokens, o.cached_tokens, o.stream) == (7, 16, True)
        # response_body_mode NONE: the response headers, then the data plane closes its side
        # (the request is over); a body that stops half way and a closed side: the client left
        for rid, chunks, want in (
            ("rid-nobody", [], ("ok", 200)),
            ("rid-half-body", [b'data: {"choices":[{"text":"x"}]}\n\n'], ("cancelled", 499)),
        ):
            e = epp.envoy()
            await e.send(request_headers(extra={"x-request-id": rid}))
            await e.send(body_chunk(body, True))
            endpoint = picked(await e.recv(), len(body))
            await e.recv()
            await e.send(response_headers(200, endpoint))
            await e.recv()
            for chunk in chunks:
                await e.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
                await e.recv()
            await e.close()
            o = await asyncio.wait_for(outcomes.get(), STEP_S)
            assert (o.request_id, o.status, o.http_status) == (rid, *want)
        # the data plane drops the stream after the pick: the request was cancelled
        e = epp.envoy()
        await e.send(request_headers(extra={"x-request-id": "rid-dropped"}))
        await e.send(body_chunk(body, True))
        picked(await e.recv(), len(body))
        await e.recv()
        e.call.cancel()
        o = await asyncio.wait_for(outcomes.get(), STEP_S)
        assert (o.request_id, o.status, o.http_status) == ("rid-dropped", "cancelled", 499)
        r = epp.router
        assert r is not None
        await wait_until(
            lambda: all(s.inflight == 0 for s in r.state.states.values()), 5, "tickets released"
        )
    finally:
        await sub.unsubscribe()
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()
        await w1.stop()


async def test_kvgate_epp_process(nats_url, subjects, bus: Bus) -> None:
    """``kvgate epp`` as its own process: ready once it knows the cluster (health Watch),
    picks over ext_proc, exits 0 on SIGTERM."""
    w0 = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w0]).start()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "epp",
        "--port",
        str(port),
        "--nats-url",
        nats_url,
        "--subject-prefix",
        subjects.prefix.rstrip("."),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)

        async def ready() -> None:
            watch = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            async for resp in watch:  # each change of the readiness status, as it happens
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    watch.cancel()
                    return

        await asyncio.wait_for(channel.channel_ready(), 30)
        await asyncio.wait_for(ready(), 30)
        e = Envoy(pb_grpc.ExternalProcessorStub(channel).Process())
        body = json.dumps({"model": "m", "prompt": "from a process", "max_tokens": 2}).encode()
        await e.send(request_headers())
        await e.send(body_chunk(body, True))
        assert picked(await e.recv(), len(body)) == endpoint_of(w0)
        await e.recv()
        await e.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await channel.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await beats.stop()
        await w0.stop()


async def test_fallback_endpoints_follow_the_pick(nats_url, subjects, bus: Bus) -> None:
    ws = [await FakeWorker(f"w{i}").start(bus) for i in range(3)]
    beats = Beats(bus, ws).start()
    epp = await EppProc(nats_url, subjects, fallback_endpoints=2).start()
    try:
        await epp.wait_workers(3)
        body = {"model": "m", "prompt": "fallbacks " * 20, "max_tokens": 4}
        n = len(json.dumps(body))
        listed = picked(await pick_once(epp, body), n).split(",")
        assert sorted(listed) == sorted(endpoint_of(w) for w in ws)
        two = [endpoint_of(ws[0]), endpoint_of(ws[2])]
        listed = picked(await pick_once(epp, body, subset=two), n).split(",")
        assert sorted(listed) == sorted(two)  # fallbacks stay inside the subset too
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        for w in ws:
            await w.stop()


async def test_queued_request_dropped_by_the_data_plane(nats_url, subjects, bus: Bus) -> None:
    """Every worker busy: the request waits in the router core's queue; the data plane drops
    the stream meanwhile: it leaves the queue and its outcome says cancelled."""
    w0 = await FakeWorker(
        "w0",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=1000, max_num_seqs=1, max_model_len=8192
        ),
    ).start(bus)
    beats = Beats(bus, [w0]).start()
    outcomes: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on_outcome(o: RouterOutcome, _raw: Any) -> None:
        await outcomes.put(o)

    sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on_outcome)
    epp = await EppProc(nats_url, subjects, queue_timeout=30.0).start()
    r = epp.router
    assert r is not None
    try:
        await epp.wait_workers(1)
        body = json.dumps({"model": "m", "prompt": "busy", "max_tokens": 4}).encode()
        first = epp.envoy()
        await first.send(request_headers())
        await first.send(body_chunk(body, True))
        picked(await first.recv(), len(body))  # holds w0's only slot until it ends
        await first.recv()
        second = epp.envoy()
        await second.send(request_headers(extra={"x-request-id": "rid-queued"}))
        await second.send(body_chunk(body, True))
        await wait_until(lambda: r.queue_len == 1, 5, "the second request queued")
        second.call.cancel()
        o = await asyncio.wait_for(outcomes.get(), STEP_S)
        assert (o.request_id, o.status, o.http_status) == ("rid-queued", "cancelled", 499)
        assert r.queue_len == 0
        await first.close()
        await wait_until(lambda: r.state.states["w0"].inflight == 0, 5, "ticket released")
    finally:
        await sub.unsubscribe()
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()


def set_headers(resp: pb.ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(resp, phase).response
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


async def test_conformance_test_epp(nats_url, subjects, bus: Bus) -> None:
    """``--conformance-test-epp``: what the Gateway API Inference Extension conformance suite
    expects of its test EPP (v1.6.0, pkg/lwepp/handlers): the test-epp-endpoint-selection
    header chooses among the endpoints it names (before a subset hint; a bare address names
    every port of it; none served: 503), the pick is echoed for the suite's echo server, and
    the response carries the served endpoint the data plane reports. Without the flag the
    header chooses nothing."""
    ws = [await FakeWorker(f"w{i}").start(bus) for i in range(3)]
    beats = Beats(bus, ws).start()
    epp = await EppProc(nats_url, subjects, conformance_test_epp=True).start()
    plain = await EppProc(nats_url, subjects).start()
    sel = P.TEST_SELECTION_HEADER
    eps = [endpoint_of(w) for w in ws]
    body = {"model": "m", "prompt": "conformance " * 20, "max_tokens": 4}
    n = len(json.dumps(body))
    try:
        await epp.wait_workers(3)
        await plain.wait_workers(3)
        for ep in eps:  # every one of them, twice: the header decides, not the policy
            for _ in range(2):
                first = await pick_once(epp, body, extra={sel: ep})
                assert picked(first, n) == ep
                echo = set_headers(first, "request_headers")[P.ECHO_SET_HEADER]
                assert echo == f"{P.CONFORMANCE_SERVED_HEADER}:{ep}"
        both = f"{eps[0]}, {eps[2]}"
        assert picked(await pick_once(epp, body, extra={sel: both}), n) in {eps[0], eps[2]}
        # the header before the subset hint, as the lightweight EPP reads them
        first = await pick_once(epp, body, subset=[eps[0]], extra={sel: eps[1]})
        assert picked(first, n) == eps[1]
        assert picked(await pick_once(epp, body, extra={sel: "127.0.0.1"}), n) in eps
        for nobody in ("10.255.0.1", "127.0.0.1:1"):
            status, err = immediate(await pick_once(epp, body, extra={sel: nobody}))
            assert status == 503, err
        # the served endpoint, echoed on the response (or the suite's "fail: ..." text)
        raw = json.dumps(body).encode()
        for served, want in ((eps[2], eps[2]), (None, "fail: missing envoy lb metadata")):
            e = epp.envoy()
            await e.send(request_headers(extra={sel: eps[1]}))
            await e.send(body_chunk(raw, True))
            assert picked(await e.recv(), len(raw)) == eps[1]
            await e.recv()
            await e.send(response_headers(200, served))
            got = await e.recv()
            assert set_headers(got, "response_headers")[P.CONFORMANCE_SERVED_HEADER] == want
            await e.close()
        # without the flag: no echo, no answer on the response, and the header chooses nothing
        # (an endpoint nobody serves is not a 503)
        first = await pick_once(plain, body, extra={sel: "10.255.0.1"})
        assert picked(first, n) in eps
        assert P.ECHO_SET_HEADER not in set_headers(first, "request_headers")
        e = plain.envoy()
        await e.send(request_headers(extra={sel: eps[1]}))
        await e.send(body_chunk(raw, True))
        picked(await e.recv(), len(raw))
        await e.recv()
        await e.send(response_headers(200, eps[1]))
        assert set_headers(await e.recv(), "response_headers") == {}
        await e.close()
    finally:
        await shutdown(("epp", epp.stop()), ("plain", plain.stop()), ("beats", beats.stop()))
        for w in ws:
            await w.stop()
