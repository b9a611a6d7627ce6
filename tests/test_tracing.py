"""OpenTelemetry tracing (services.common.tracing, services.router.trace): one request through
the real router and a real simulated worker on real NATS is one trace, client -> router ->
worker, each step a span with its duration; tracing off, nothing is traced and a client's
``traceparent`` reaches the engine untouched.

Spans are collected by the SDK's in-memory exporter (the production exporters ship batches
over OTLP; what is exported is the same span data).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

from services.common import tracing
from services.common.bus import Bus
from services.core.policy.base import REGISTRY as POLICIES
from services.core.policy.base import register
from services.core.policy.builtin.round_robin import RoundRobin
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import Beats, FakeWorker, RouterProc, post, shutdown, wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _traceparent(flags: str = "01") -> str:
    return f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on (every new trace sampled; a client's flag followed), spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


def _by_name(done: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in done:
        out.setdefault(s.name, []).append(s)
    return out


def _one(named: dict[str, list[ReadableSpan]], name: str) -> ReadableSpan:
    assert len(named.get(name, [])) == 1, (name, sorted(named))
    return named[name][0]


def _child_of(child: ReadableSpan, parent: ReadableSpan, within: bool = True) -> None:
    assert child.parent is not None and child.parent.span_id == parent.context.span_id, (
        child.name,
        parent.name,
    )
    assert child.context.trace_id == parent.context.trace_id
    assert child.end_time >= child.start_time, child.name
    if within:  # the same clock (one process): a child lies within its parent
        assert parent.start_time <= child.start_time, (child.name, parent.name)
        assert child.end_time <= parent.end_time, (child.name, parent.name)


async def test_one_request_router_to_sim_worker_is_one_trace(
    nats_url, subjects, bus: Bus, spans: InMemorySpanExporter
) -> None:
    sims = await SimCluster(nats_url, subjects, 1).start()
    router = await RouterProc(nats_url, subjects).start()
    try:
        await router.wait_workers(1, timeout=20)
        body = {"model": "m", "prompt": "why is the sky blue? " * 8, "max_tokens": 12}
        async with aiohttp.ClientSession() as s:
            status, _h, raw = await post(
                s,
                router.url + "/v1/completions",
                {**body, "stream": True},
                {"traceparent": _traceparent(), "tracestate": "vendor=abc"},
            )
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
        # the root ends once the outcome is recorded, the worker's span once its handler
        # returned: both just after the client has its answer
        await wait_until(
            lambda: (
                {"router.request", "worker POST /v1/completions"}
                <= {s.name for s in spans.get_finished_spans()}
            ),
            what="router and worker spans exported",
        )
    finally:
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)

    named = _by_name(list(spans.get_finished_spans()))
    root = _one(named, "router.request")
    # the client's trace continues: same trace id, the client's span the parent
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.parent.is_remote
    assert root.kind == trace.SpanKind.SERVER
    assert root.attributes["kvgate.outcome"] == "ok"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvgate.worker"] == "sim"
    assert root.attributes["kvgate.stream"] is True
    assert root.attributes["kvgate.ttft_s"] > 0
    for name in ("router.parse", "router.tokenize", "router.decide", "router.upstream"):
        _child_of(_one(named, name), root)
    decide = _one(named, "router.decide")
    assert decide.attributes["kvgate.worker"] == "sim"
    assert decide.attributes["kvgate.prompt_tokens"] > 100
    assert "sim" in decide.attributes["kvgate.decision.scores"]  # JSON: worker -> score
    assert decide.attributes["kvgate.decision.overlap_blocks_by_worker"].startswith("{")
    assert decide.attributes["kvgate.policy"]
    upstream = _one(named, "router.upstream")
    assert upstream.kind == trace.SpanKind.CLIENT
    assert upstream.attributes["kvgate.worker"] == "sim"
    connect, first, stream = (
        _one(named, n) for n in ("upstream.connect", "upstream.first_token", "upstream.stream")
    )
    for step in (connect, first, stream):
        _child_of(step, upstream)
    # the steps follow each other: sent -> head -> first token -> end of stream
    assert connect.end_time == first.start_time and first.end_time == stream.start_time
    assert stream.end_time - connect.start_time > 0
    # the worker continued the trace under the router's attempt (the traceparent it got)
    worker = _one(named, "worker POST /v1/completions")
    _child_of(worker, upstream, within=False)
    assert worker.kind == trace.SpanKind.SERVER
    assert worker.context.trace_state.get("vendor") == "abc"  # tracestate passed along
    assert worker.attributes["kvgate.worker"] == "sim"
    assert worker.attributes["kvgate.completion_tokens"] == 12
    assert upstream.start_time <= worker.start_time
    q, pf, dec = (_one(named, n) for n in ("worker.queue", "worker.prefill", "worker.decode"))
    for step in (q, pf, dec):
        _child_of(step, worker)
    assert q.end_time == pf.start_time and pf.end_time == dec.start_time
    assert pf.end_time > pf.start_time  # a prefill of > 100 tokens takes simulated time
    # one trace in all
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {root.context.trace_id}


@pytest.fixture
async def scripted_engines(nats_url, subjects, bus: Bus):
    """Two scripted HTTP engines (tests.test_router_support.FakeWorker: canned OpenAI answers
    that record the headers they got) announced by heartbeats through ``bus``, a connection to
    the real NATS server of this test run; the router under test hears them there. Nothing of
    NATS is mocked: only the GPU engine is a stand-in."""
    workers = [await FakeWorker(f"w{i}").start() for i in range(2)]
    beats = Beats(bus, workers).start()
    yield workers
    await shutdown(("beats", beats.stop()), *((w.worker_id, w.stop()) for w in workers))


async def test_tracing_off_no_spans_and_client_traceparent_untouched(
    nats_url, subjects, scripted_engines: list[FakeWorker]
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # a global provider alone does not turn kvgate's on
    tracing.uninstall()
    router = await RouterProc(nats_url, subjects, policy="round_robin").start()
    try:
        await router.wait_workers(2)
        assert router.router is not None and router.router.path.tracer is None
        body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
        sent = {"traceparent": _traceparent("00"), "tracestate": "a=1,b=2"}
        async with aiohttp.ClientSession() as s:
            st1, _h, _b = await post(s, router.url + "/v1/completions", body, sent)
            st2, _h, _b = await post(s, router.url + "/v1/completions", {**body, "stream": False})
        assert st1 == st2 == 200
    finally:
        await shutdown(("router", router.stop()))
    got = [r["headers"] for w in scripted_engines for r in w.served]
    assert len(got) == 2
    with_tp = [h for h in got if "traceparent" in h]
    assert len(with_tp) == 1  # only the request that came with one
    assert with_tp[0]["traceparent"] == sent["traceparent"]
    assert with_tp[0]["tracestate"] == sent["tracestate"]
    assert exporter.get_finished_spans() == ()


async def test_unsampled_client_trace_records_nothing_but_propagates(
    nats_url, subjects, scripted_engines: list[FakeWorker], spans: InMemorySpanExporter
) -> None:
    router = await RouterProc(nats_url, subjects, policy="round_robin").start()
    try:
        await router.wait_workers(2)
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            status, _h, _b = await post(
                s, router.url + "/v1/completions", body, {"traceparent": _traceparent("00")}
            )
            assert status == 200
            # a request without a trace context starts a sampled trace of its own
            status, _h, _b = await post(s, router.url + "/v1/completions", body)
            assert status == 200
        await wait_until(
            lambda: any(s.name == "router.request" for s in spans.get_finished_spans()),
            what="the sampled request's root span",
        )
    finally:
        await shutdown(("router", router.stop()))
    got = sorted(
        (r["headers"]["traceparent"] for w in scripted_engines for r in w.served),
        key=lambda tp: CLIENT_TRACE not in tp,
    )
    version, trace_id, span_id, flags = got[0].split("-")
    # the client's trace, a span of the router's own, not sampled: the engine is told so
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00") and span_id != CLIENT_SPAN
    # the other request's context is its router.upstream span, sampled
    _v, trace_id2, span_id2, flags2 = got[1].split("-")
    named = _by_name(list(spans.get_finished_spans()))
    assert {format(s.context.trace_id, "032x") for s in spans.get_finished_spans()} == {trace_id2}
    assert int(flags2, 16) & 1  # sampled (the SDK may also set W3C's "random" bit)
    assert format(_one(named, "router.upstream").context.span_id, "016x") == span_id2


async def test_migration_is_a_span_with_the_continuation_under_it(
    nats_url, subjects, scripted_engines: list[FakeWorker], spans: InMemorySpanExporter
) -> None:
    broken, other = scripted_engines
    broken.mode, broken.chunks, other.chunks = "crash_mid", 6, 6
    router = await RouterProc(nats_url, subjects, policy="round_robin").start()
    try:
        await router.wait_workers(2)
        body = {"model": "m", "prompt": "tell me a story", "max_tokens": 18, "stream": True}
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # round robin: one of the two starts on the broken worker
                status, _h, raw = await post(s, router.url + "/v1/completions", body)
                assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        await wait_until(
            lambda: sum(s.name == "router.request" for s in spans.get_finished_spans()) == 2,
            what="both requests' root spans",
        )
    finally:
        await shutdown(("router", router.stop()))
    done = list(spans.get_finished_spans())
    migrations = [s for s in done if s.name == "router.migrate"]
    assert migrations  # each request that started on the broken worker migrated once
    for migrate in migrations:
        root = next(s for s in done if s.context.span_id == migrate.parent.span_id)
        assert root.name == "router.request" and root.attributes["kvgate.migrations"] == 1
        assert migrate.attributes["kvgate.failed_worker"] == broken.worker_id
        assert migrate.attributes["kvgate.outcome"] == "ok"
        attempts = [
            s
            for s in done
            if s.name == "router.upstream" and s.context.trace_id == root.context.trace_id
        ]
        assert len(attempts) == 2
        first = next(a for a in attempts if a.parent.span_id == root.context.span_id)
        cont = next(a for a in attempts if a.parent.span_id == migrate.context.span_id)
        assert first.attributes["kvgate.worker"] == broken.worker_id
        assert first.attributes["kvgate.outcome"] == "broken"
        assert first.status.status_code == trace.StatusCode.ERROR
        assert cont.attributes["kvgate.worker"] == other.worker_id
        _child_of(cont, migrate)
        _child_of(migrate, root)
        assert first.end_time <= migrate.start_time
        # the continuation's worker got the continuation's context
        tps = [r["headers"].get("traceparent", "") for r in other.served]
        assert any(format(cont.context.span_id, "016x") in tp for tp in tps)


def test_structlog_lines_carry_the_current_span(spans: InMemorySpanExporter) -> None:
    tracer = tracing.tracer("kvgate.test")
    assert tracing.add_trace_ids(None, "info", {}) == {}  # no span: nothing added
    with tracer.start_as_current_span("s") as span:
        event: dict[str, Any] = tracing.add_trace_ids(None, "info", {"event": "x"})
    sc = span.get_span_context()
    assert event["trace_id"] == format(sc.trace_id, "032x")
    assert event["span_id"] == format(sc.span_id, "016x")


def test_setup_reads_the_standard_variables() -> None:
    class St:
        otel = False
        otel_sample_ratio = 0.25

    try:
        assert not tracing.wanted(St(), {})  # off by default
        assert not tracing.wanted(St(), {"OTEL_TRACES_EXPORTER": "none"})
        assert tracing.wanted(St(), {"OTEL_TRACES_EXPORTER": "console"})
        assert not tracing.wanted(
            St(), {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}
        )
        with pytest.raises(tracing.TracingError, match="unknown exporter"):
            tracing.setup("router", St(), {"OTEL_TRACES_EXPORTER": "zipkin"})
        with pytest.raises(tracing.TracingError, match="http/protobuf"):
            tracing.setup(
                "router",
                St(),
                {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            )
        assert tracing.setup("router", St(), {"OTEL_TRACES_EXPORTER": "none", "X": "1"}) is False
        St.otel = True
        assert tracing.setup("router", St(), {"OTEL_TRACES_EXPORTER": "none"}) is True
        provider = tracing._provider
        assert provider.resource.attributes["service.name"] == "kvgate-router"
        assert "0.25" in provider.sampler.get_description()  # parent-based ratio
        assert "ParentBased" in provider.sampler.get_description()
        env = {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_SERVICE_NAME": "edge-router",
            "OTEL_TRACES_SAMPLER": "always_off",
        }
        tracing.uninstall()
        import os

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the SDK reads its own variables from the environment
        try:
            assert tracing.setup("router", St(), env) is True
            provider = tracing._provider
            assert provider.resource.attributes["service.name"] == "edge-router"
            assert (
                provider.sampler is ALWAYS_OFF or "AlwaysOff" in provider.sampler.get_description()
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        tracing.uninstall()


async def test_epp_pick_is_traced_and_the_engine_gets_its_context(
    nats_url, subjects, scripted_engines: list[FakeWorker], spans: InMemorySpanExporter
) -> None:
    import json

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.test_epp import EppProc, body_chunk, request_headers, response_headers

    epp = await EppProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(2)
        body = json.dumps({"model": "m", "prompt": "hi " * 40, "stream": True}).encode()
        e = epp.envoy()
        await e.send(request_headers(extra={"traceparent": _traceparent()}))
        await e.send(body_chunk(body, True))
        answer = (await e.recv()).request_headers.response.header_mutation.set_headers
        sets = {o.header.key: o.header.raw_value.decode() for o in answer}
        await e.recv()  # the body, sent back
        await e.send(response_headers(200, None))
        await e.recv()
        for i, chunk in enumerate((b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n")):
            await e.send(
                pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=i == 1))
            )
            await e.recv()
        await e.close()
        await wait_until(
            lambda: any(s.name == "epp.request" for s in spans.get_finished_spans()),
            what="the EPP's root span",
        )
    finally:
        await shutdown(("epp", epp.stop()))
    named = _by_name(list(spans.get_finished_spans()))
    root = _one(named, "epp.request")
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.attributes["kvgate.outcome"] == "ok"
    decide = _one(named, "epp.decide")
    _child_of(decide, root)
    assert decide.attributes["kvgate.worker"] == root.attributes["kvgate.worker"]
    upstream = _one(named, "epp.upstream")
    _child_of(upstream, root)
    # the header Envoy sets on the request to the engine: the EPP's attempt span
    _v, trace_id, span_id, _f = sets["traceparent"].split("-")
    assert trace_id == CLIENT_TRACE and span_id == format(upstream.context.span_id, "016x")
    steps = {
        n: _one(named, n) for n in ("upstream.connect", "upstream.first_token", "upstream.stream")
    }
    for step in steps.values():
        _child_of(step, upstream)


async def test_indexer_batch_apply_is_a_span(
    nats_url, subjects, bus: Bus, spans: InMemorySpanExporter
) -> None:
    from services.common.streams import require_kv_events_stream
    from tests.test_kv_support import batch, chain, hb, indexer, stored

    await require_kv_events_stream(bus)
    keys = chain(4, 3)
    async with indexer(nats_url, subjects) as svc:
        await bus.publish(subjects.heartbeat("w1"), hb("w1"))
        await wait_until(lambda: "w1" in svc.core.workers, what="registration")
        await bus.js_publish(subjects.kv_events("w1"), batch("w1", 0, [stored(keys)]))
        await bus.js_publish(subjects.kv_events("w1"), b"not a batch")
        await wait_until(
            lambda: sum(s.name == "indexer.apply_batch" for s in spans.get_finished_spans()) == 2,
            what="two batch spans",
        )
    applied, bad = sorted(
        (s for s in spans.get_finished_spans() if s.name == "indexer.apply_batch"),
        key=lambda s: s.attributes["kvgate.outcome"] != "applied",
    )
    assert applied.attributes["kvgate.outcome"] == "applied"
    assert applied.attributes["kvgate.worker"] == "w1"
    assert applied.attributes["kvgate.events"] == 1
    assert applied.end_time > applied.start_time
    assert bad.attributes["kvgate.outcome"] != "applied" and "kvgate.worker" not in bad.attributes


async def test_api_handlers_are_spans(
    fresh_database_url: str,
    nats_url: str,
    subject_prefix: str,
    bus: Bus,
    spans: InMemorySpanExporter,
) -> None:
    from services.api.testing import start_api

    api = await start_api(fresh_database_url, nats_url, subject_prefix, admin_token="t" * 32)
    try:
        status, _ = await api.call(
            "GET", "/api/v1/policies", headers={"traceparent": _traceparent()}
        )
        assert status == 200
        assert (await api.call("GET", "/api/v1/policies/nope"))[0] == 404
        assert (await api.call("GET", "/api/v1/health", token=None))[0] == 200
    finally:
        await api.close()
    done = [s for s in spans.get_finished_spans() if s.name.startswith("api ")]
    names = sorted(s.name for s in done)
    assert names == ["api GET /api/v1/policies", "api GET /api/v1/policies/{name}"], names
    listed = next(s for s in done if s.name == "api GET /api/v1/policies")
    assert format(listed.context.trace_id, "032x") == CLIENT_TRACE
    assert format(listed.parent.span_id, "016x") == CLIENT_SPAN
    assert listed.attributes["http.response.status_code"] == 200
    missing = next(s for s in done if s.name != "api GET /api/v1/policies")
    assert missing.attributes["http.response.status_code"] == 404


def test_begin_decides_as_the_sdk_sampler_does() -> None:
    """The request path's sampling shortcut (services.common.tracing.begin) takes the SDK
    sampler's decisions: the same for each trace id, a sampled trace's root span keeps the id
    it was drawn with, and a client's flag is followed."""
    import random

    from opentelemetry.sdk.trace.sampling import Decision

    ratio = ParentBased(TraceIdRatioBased(0.3))
    provider = TracerProvider(sampler=ratio)
    tracing.install(provider)
    try:
        assert tracing._FAST  # the default shape takes the shortcut
        rng = random.Random(7)
        drawn = []
        for _ in range(3000):
            tid = rng.getrandbits(128)
            sdk = ratio.should_sample(None, tid, "x").decision == Decision.RECORD_AND_SAMPLE
            ours = tid & tracing._FAST["mask"] < tracing._FAST["bound"]
            assert sdk == ours
            drawn.append(ours)
        assert 0.25 < sum(drawn) / len(drawn) < 0.35
        tracer = tracing.tracer("kvgate.test")
        outcomes = [tracing.begin({}) for _ in range(400)]
        sampled = [o for o in outcomes if o[1] is None]
        assert 60 < len(sampled) < 180
        preset = tracing._IDS.preset
        assert preset  # the next root span's trace id: the one sampled
        span = tracer.start_span("root", context=None)
        assert span.get_span_context().trace_id == preset and span.is_recording()
        assert tracing._IDS.preset == 0
        for _parent, forward in outcomes:
            if forward is not None:  # a new trace, marked not sampled, for the engine
                v, tid, sid, flags = forward.split("-")
                assert (v, flags, len(tid), len(sid)) == ("00", "00", 32, 16)
        # a client's flag decides; a malformed traceparent starts a new trace
        parent, forward = tracing.begin({"traceparent": _traceparent("01")})
        assert forward is None and parent is not None
        parent, forward = tracing.begin({"traceparent": _traceparent("00")})
        assert parent is None and forward.split("-")[1] == CLIENT_TRACE
        for bad in (
            "00-xyz",
            _traceparent("01").upper(),
            "00-" + "0" * 32 + "-" + CLIENT_SPAN + "-01",
        ):
            _p, forward = tracing.begin({"traceparent": bad})
            assert forward is None or CLIENT_TRACE not in forward
    finally:
        tracing.uninstall()
        provider.shutdown()


def test_dropped_span_warnings_are_held_to_one_a_minute() -> None:
    import logging

    f = tracing._OncePerMinute()

    def rec() -> logging.LogRecord:
        return logging.LogRecord(
            "x", logging.WARNING, "f", 1, "Queue full, dropping %s.", ("span",), None
        )

    assert f.filter(rec())
    assert not any(f.filter(rec()) for _ in range(500))
    f.limiter._last.clear()  # a minute later
    again = rec()
    assert f.filter(again) and "500 more" in again.getMessage()


async def test_disaggregated_request_traces_its_prefill_and_decode_workers(
    nats_url, subjects, bus: Bus, spans: InMemorySpanExporter
) -> None:
    """P/D (services/router/pd.py): the prefill request and the decode request both carry the
    attempt's context, so both engines' spans hang under the router's attempt."""
    from tests.test_router_pd import PROMPT, PdFleet, install_pairing

    fleet = await PdFleet(nats_url, subjects, prefill=1, decode=1).start()
    router = await RouterProc(nats_url, subjects, policy="round_robin", pd_handshake="nixl").start()
    try:
        await router.wait_workers(2, timeout=20)
        install_pairing(router)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "stream": True}
        async with aiohttp.ClientSession() as s:
            status, headers, raw = await post(s, router.url + "/v1/completions", body)
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        assert headers["x-kvgate-prefill-worker"].startswith("pre")
        await wait_until(
            lambda: (
                sum(s.name == "worker POST /v1/completions" for s in spans.get_finished_spans())
                == 2
                and any(s.name == "router.request" for s in spans.get_finished_spans())
            ),
            what="both workers' spans and the root",
        )
    finally:
        await shutdown(("router", router.stop()), ("fleet", fleet.stop()), each_s=10)
    named = _by_name(list(spans.get_finished_spans()))
    upstream = _one(named, "router.upstream")
    _child_of(upstream, _one(named, "router.request"))
    served = {s.attributes["kvgate.worker"]: s for s in named["worker POST /v1/completions"]}
    assert sorted(w.split("-")[0] for w in served) == ["dec", "pre"]
    for span in served.values():
        _child_of(span, upstream, within=False)


class _ReplicateToOthers(RoundRobin):
    """Round robin whose every decision also replicates the prompt to the other workers
    (kv_aware's hot-prefix rule, made unconditional for the test)."""

    name = "test_replicate_to_others"

    def costs(self, req: Any, cands: list[Any], overlaps: Any, state: Any) -> dict[str, float]:
        costs = super().costs(req, cands, overlaps, state)
        state.replicate_to = tuple(w.worker_id for w in cands)  # the pick's own is dropped
        return costs


@pytest.fixture
def replicating_policy() -> Iterator[str]:
    register(_ReplicateToOthers)
    yield _ReplicateToOthers.name
    del POLICIES[_ReplicateToOthers.name]


async def test_hot_prefix_replica_is_a_span_and_its_engine_continues_the_trace(
    nats_url,
    subjects,
    scripted_engines: list[FakeWorker],
    spans: InMemorySpanExporter,
    replicating_policy: str,
) -> None:
    router = await RouterProc(nats_url, subjects, policy=replicating_policy).start()
    try:
        await router.wait_workers(2)
        body = {"model": "m", "prompt": "a hot system prompt " * 4, "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            status, headers, _b = await post(s, router.url + "/v1/completions", body)
            assert status == 200
            # a client's unsampled trace: the replica's engine is told it is not sampled
            sent = {"traceparent": _traceparent("00")}
            status2, headers2, _b = await post(s, router.url + "/v1/completions", body, sent)
            assert status2 == 200
        await wait_until(
            lambda: (
                sum(len(w.served) for w in scripted_engines) == 4
                and any(s.name == "router.replicate" for s in spans.get_finished_spans())
            ),
            what="both replicas answered and the sampled one's span ended",
        )
    finally:
        await shutdown(("router", router.stop()))
    served = {w.worker_id: w.served for w in scripted_engines}
    copies = [
        (wid, {k.lower(): v for k, v in r["headers"].items()})
        for wid, rs in served.items()
        for r in rs
        if r["body"]["max_tokens"] == 1
    ]
    assert len(copies) == 2 and all(
        r["body"]["stream"] is False
        for rs in served.values()
        for r in rs
        if r["body"]["max_tokens"] == 1
    )
    named = _by_name(list(spans.get_finished_spans()))
    root, upstream, rep = (
        _one(named, n) for n in ("router.request", "router.upstream", "router.replicate")
    )
    # the sampled request's replica: a client span under its request, on the other worker
    _child_of(rep, root, within=False)  # it may end after the request
    assert rep.kind == trace.SpanKind.CLIENT
    picked = headers["x-kvgate-worker"]
    other = next(w for w in served if w != picked)
    assert rep.attributes["kvgate.worker"] == other
    assert rep.attributes["kvgate.outcome"] == "ok"
    first_copy = next(
        h for wid, h in copies if wid == other and CLIENT_TRACE not in h["traceparent"]
    )
    assert first_copy["x-request-id"] == rep.attributes["kvgate.request_id"]
    _v, trace_id, span_id, flags = first_copy["traceparent"].split("-")
    assert int(trace_id, 16) == root.context.trace_id and int(flags, 16) & 1
    assert int(span_id, 16) == rep.context.span_id != upstream.context.span_id
    # the unsampled request: no span of it; its replica in the client's trace, not sampled
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {root.context.trace_id}
    picked2 = headers2["x-kvgate-worker"]
    unsampled = [
        h["traceparent"] for wid, h in copies if wid != picked2 and CLIENT_TRACE in h["traceparent"]
    ]
    assert len(unsampled) == 1
    version, trace_id2, _s, flags2 = unsampled[0].split("-")
    assert (version, trace_id2, flags2) == ("00", CLIENT_TRACE, "00")
