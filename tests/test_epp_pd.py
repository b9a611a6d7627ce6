"""``kvgate epp`` with a P/D policy: a real gRPC client playing Envoy against the EPP, whose
router core follows real heartbeats (workers announcing role ``prefill`` / ``decode``) and KV
events on a real NATS. The pick is the decode worker; ``x-prefiller-host-port`` names the
prefill worker's ``ip:port`` for llm-d's routing sidecar, and is removed (a client's own
included) when the decoder prefills; a subset hint restricts the decoder; the prefill
worker's claim ends at the decoder's first token or with the stream; outcomes name the pair;
and the pairs are the router's on the same state."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import REGISTRY

from services.common.bus import Bus
from services.common.schemas import RouterOutcome
from services.epp import protocol as P
from tests.test_epp import (
    STEP_S,
    EppProc,
    body_chunk,
    endpoint_of,
    pick_once,
    picked,
    request_headers,
    response_headers,
)
from tests.test_router_support import (
    BS,
    Beats,
    FakeWorker,
    Indexer,
    RouterProc,
    post,
    shutdown,
    wait_until,
)

# disaggregate when the decoder lacks >= 64 prompt tokens (llm-d's prefix-based decider)
PD_LLMD = {"name": "pd_llmd", "params": {"non_cached_tokens": 64, "prefix_mode": "precise"}}
LONG = "Prefill here, decode there. " * 12  # 336 byte tokens, none cached: disaggregated
SHORT = "hi there"  # shorter than 64 tokens: the decoder prefills it


def prefill_of(resp: pb.ProcessingResponse) -> str | None:
    """The answer's ``x-prefiller-host-port``; None when it sets none, in which case it must
    remove the client's."""
    mutation = resp.request_headers.response.header_mutation
    sets = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
    got = sets.get(P.PREFILL_HEADER)
    if got is None:
        assert list(mutation.remove_headers) == [P.PREFILL_HEADER], mutation
    else:
        assert P.PREFILL_HEADER not in mutation.remove_headers, mutation
    return got


def pd_picks(where: str) -> float:
    return REGISTRY.get_sample_value("kvgate_epp_pd_picks_total", {"prefill": where}) or 0.0


async def pd_fleet(bus: Bus, decoders: int, prefillers: int) -> tuple[list, list]:
    ds = [await FakeWorker(f"d{i}", role="decode").start(bus) for i in range(decoders)]
    ps = [await FakeWorker(f"p{i}", role="prefill").start(bus) for i in range(prefillers)]
    return ds, ps


async def test_pd_pick_sets_the_prefiller_header(nats_url, subjects, bus: Bus) -> None:
    ds, ps = await pd_fleet(bus, 2, 1)
    beats = Beats(bus, ds + ps).start()
    outcomes: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on_outcome(o: RouterOutcome, _raw: Any) -> None:
        await outcomes.put(o)

    sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on_outcome)
    epp = await EppProc(nats_url, subjects, policy=json.dumps(PD_LLMD)).start()
    r = epp.router
    assert r is not None
    wid_at = {endpoint_of(w): w.worker_id for w in ds + ps}
    pre = endpoint_of(ps[0])
    try:
        await epp.wait_workers(3)
        remote0, local0 = pd_picks("remote"), pd_picks("decoder")
        body = json.dumps({"model": "m", "prompt": LONG, "stream": True}).encode()
        # a client's own header (somewhere else to prefill) is overwritten by the pick's
        e = epp.envoy()
        evil = {"x-request-id": "rid-pd", P.PREFILL_HEADER: "10.6.6.6:80"}
        await e.send(request_headers(extra=evil))
        await e.send(body_chunk(body, True))
        first = await e.recv()
        dec = picked(first, len(body))
        assert wid_at[dec] in ("d0", "d1") and prefill_of(first) == pre
        await e.recv()  # the body sent back
        # both claims held until the decoder's first token: then the prefill worker's ends
        assert r.state.states[wid_at[dec]].inflight == 1
        assert r.state.states["p0"].inflight == 1
        await e.send(response_headers(200, dec))
        await e.recv()
        await e.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n")))
        await e.recv()
        assert r.state.states["p0"].inflight == 0
        assert r.state.states[wid_at[dec]].inflight == 1
        done = b"data: [DONE]\n\n"
        await e.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=done, end_of_stream=True)))
        await e.recv()
        await e.close()
        o = await asyncio.wait_for(outcomes.get(), STEP_S)
        assert (o.request_id, o.worker_id, o.prefill_worker) == ("rid-pd", wid_at[dec], "p0")
        assert o.status == "ok"
        assert r.state.states[wid_at[dec]].inflight == 0
        # a stream dropped before any token: the prefill worker's claim ends with it too
        e = epp.envoy()
        await e.send(request_headers(extra={"x-request-id": "rid-dropped"}))
        await e.send(body_chunk(body, True))
        first = await e.recv()
        assert prefill_of(first) == pre
        await e.recv()
        assert r.state.states["p0"].inflight == 1
        await e.close()
        o = await asyncio.wait_for(outcomes.get(), STEP_S)
        assert (o.request_id, o.status, o.prefill_worker) == ("rid-dropped", "cancelled", "p0")
        assert all(s.inflight == 0 for s in r.state.states.values())
        # the decoder prefills a short prompt: no header, and the client's is removed
        small = {"model": "m", "prompt": SHORT, "max_tokens": 4}
        first = await pick_once(epp, small, extra={P.PREFILL_HEADER: "10.6.6.6:80"})
        assert wid_at[picked(first, len(json.dumps(small)))] in ("d0", "d1")
        assert prefill_of(first) is None
        o = await asyncio.wait_for(outcomes.get(), STEP_S)
        assert o.prefill_worker is None
        assert (pd_picks("remote"), pd_picks("decoder")) == (remote0 + 2, local0 + 1)
        assert all(s.inflight == 0 for s in r.state.states.values())
    finally:
        await sub.unsubscribe()
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        for w in ds + ps:
            await w.stop()


async def test_pd_subset_hint_restricts_the_decoder(nats_url, subjects, bus: Bus) -> None:
    """The hint names the destination: the decoder is one it names, the prefill worker any
    (a prefill-only worker is never the destination), and a hint naming no decoder is 503."""
    ds, ps = await pd_fleet(bus, 3, 1)
    beats = Beats(bus, ds + ps).start()
    epp = await EppProc(nats_url, subjects, policy=json.dumps(PD_LLMD)).start()
    try:
        await epp.wait_workers(4)
        body = {"model": "m", "prompt": LONG, "max_tokens": 4}
        n = len(json.dumps(body))
        for i in range(6):
            only = [endpoint_of(ds[i % 3])]
            if i % 2:
                only.append(endpoint_of(ps[0]))
            first = await pick_once(epp, body, subset=only)
            assert picked(first, n) == only[0]
            assert prefill_of(first) == endpoint_of(ps[0])
        first = await pick_once(epp, body, subset=[endpoint_of(ps[0])])
        assert first.immediate_response.status.code == 503
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        for w in ds + ps:
            await w.stop()


async def test_prefill_worker_without_endpoint_is_decided_without(
    nats_url, subjects, bus: Bus
) -> None:
    """A prefill worker whose URL names no ip:port the sidecar could be given: the decision
    is made again without it (here: the other prefill worker)."""
    ds, ps = await pd_fleet(bus, 1, 2)
    beats = Beats(bus, ds + ps).start()
    rr = json.dumps({"name": "pd_round_robin"})
    epp = await EppProc(nats_url, subjects, policy=rr).start()
    r = epp.router
    assert r is not None
    try:
        await epp.wait_workers(3)
        # p0's URL as the EPP holds it: a unix socket, no host:port
        r.state.states["p0"].url = "http+unix://%2Frun%2Fp0.sock"
        body = {"model": "m", "prompt": LONG, "max_tokens": 4}
        for _ in range(3):  # round robin would name p0 every other request
            first = await pick_once(epp, body)
            assert picked(first, len(json.dumps(body))) == endpoint_of(ds[0])
            assert prefill_of(first) == endpoint_of(ps[1])
        assert all(s.inflight == 0 for s in r.state.states.values())
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        for w in ds + ps:
            await w.stop()


async def test_same_pd_pairs_as_the_router(nats_url, subjects, bus: Bus) -> None:
    """Prompts cached in part on a decoder and whole on a prefill worker (disaggregated:
    the decoder lacks >= 64 tokens) or whole on a decoder (it prefills): the EPP's
    (decoder, prefill header) is the pair the router's /debug/route explains on the same
    state."""
    indexer = await Indexer(nats_url, subjects).start()
    ds, ps = await pd_fleet(bus, 2, 2)
    beats = Beats(bus, ds + ps).start()
    spec = json.dumps(PD_LLMD)
    epp = await EppProc(nats_url, subjects, policy=spec).start()
    router = await RouterProc(nats_url, subjects, policy=spec).start()
    try:
        await epp.wait_workers(4)
        await router.wait_workers(4)
        split = [f"split document {i} " * 24 for i in range(2)]  # 408+ tokens each
        whole = [f"whole document {i} " * 24 for i in range(2)]
        blocks: dict[str, int] = {}
        for i in range(2):
            head = split[i][: len(split[i]) * 4 // 5]  # the decoder lacks a fifth of it
            await ds[i].publish_kv(head)
            await ps[1 - i].publish_kv(split[i])
            await ds[i].publish_kv(whole[i])
            blocks[f"d{i}"] = len(head) // BS + len(whole[i]) // BS
            blocks[f"p{1 - i}"] = len(split[i]) // BS
        assert epp.router is not None and router.router is not None
        replicas = (epp.router.index_source.index, router.router.index_source.index)
        await wait_until(
            lambda: all(ix.blocks_of(w) >= n for ix in replicas for w, n in blocks.items()),
            10,
            "both index replicas hold every worker's blocks",
        )
        wid_at = {endpoint_of(w): w.worker_id for w in ds + ps}
        want = [("d0", "p1"), ("d1", "p0"), ("d0", None), ("d1", None)]
        got = []
        async with aiohttp.ClientSession() as s:
            for p in split + whole + split:
                body = {"model": "m", "prompt": p, "max_tokens": 8}
                st, _, raw = await post(s, router.url + "/debug/route", body)
                assert st == 200, raw
                explained = json.loads(raw)
                first = await pick_once(epp, body)
                pair = (wid_at[picked(first, len(json.dumps(body)))], prefill_of(first))
                pair = (pair[0], None if pair[1] is None else wid_at[pair[1]])
                assert pair == (explained["worker"], explained["prefill_worker"]), (p[:20], pair)
                got.append(pair)
        assert got == want + want[:2]
    finally:
        await shutdown(
            ("router", router.stop()),
            ("epp", epp.stop()),
            ("beats", beats.stop()),
            ("indexer", indexer.stop()),
        )
        for w in ds + ps:
            await w.stop()
