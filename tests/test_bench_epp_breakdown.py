"""``python -m bench.epp_breakdown``'s in-process part: its step-by-step request (the bench's
copy of ``EppStream.on`` and ``Picker._pick``) must stay the request the real stream makes, or
its split measures something else. On an EPP core that hears a worker on the real NATS: both
picks the worker, answer the same messages' worth, record one outcome each and give back
their ticket; every step is timed."""

from __future__ import annotations

from prometheus_client import REGISTRY

from bench.epp_breakdown import STAGES, Messages, staged, whole_on
from services.common.bus import Bus
from services.epp.picker import Picker
from services.epp.stream import EppStream
from tests.test_epp import EppProc
from tests.test_router_support import Beats, FakeWorker, shutdown


def _ok_outcomes() -> float:
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "kvgate_router_requests"
        for s in m.samples
        if s.name == "kvgate_router_requests_total" and s.labels.get("status") == "ok"
    )


async def test_staged_request_is_the_streams_request(nats_url, subjects, bus: Bus) -> None:
    worker = await FakeWorker("w0").start()
    beats = Beats(bus, [worker]).start()
    epp = await EppProc(nats_url, subjects).start()
    try:
        await epp.wait_workers(1)
        r = epp.router
        assert r is not None
        picker = Picker(r)
        endpoint = worker.url.removeprefix("http://")
        for mode in ("whole", "stream"):
            msgs = Messages(mode, endpoint)
            before = _ok_outcomes()
            await whole_on(EppStream, picker, msgs, 1 << 20)
            acc = dict.fromkeys(STAGES, 0)
            await staged(picker, msgs, 1 << 20, acc)
            assert _ok_outcomes() == before + 2, mode  # one "ok" outcome each
            assert all(v > 0 for v in acc.values()), acc
            assert r.state.states["w0"].inflight == 0  # both tickets released
    finally:
        await shutdown(("epp", epp.stop()), ("beats", beats.stop()), ("worker", worker.stop()))
