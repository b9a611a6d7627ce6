"""The bridge against what the real engine publishers emitted (byte-exact fixtures recorded
from the vLLM 0.22.0 / 0.33.0 and SGLang 0.5.23 wheels' own ZmqEventPublisher by
``python -m tests.tools.engine_conformance --record``): every case -- restart with lost
first batches, idle bridge start, short replay buffer, unknown event types, salt, group_idx,
mixed block sizes, bigram pages, remote media, bind mode -- must leave the real indexer
holding exactly the engine's blocks, with what was dropped counted."""

from __future__ import annotations

import msgpack
import pytest

from services.common.bus import Bus
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.kv_indexer.bridges.engine_formats import VllmDecoder
from services.kv_indexer.bridges.zmq_bridge import parse_replay
from tests.test_kv_support import indexer
from tests.tools.engine_conformance import ENGINES, cases_for, load_fixture, run_fixture

FLAVORS = [f"{name}-{version}" for name, version, _ in ENGINES]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_fixture_is_what_the_engine_emits(flavor: str) -> None:
    fx = load_fixture(flavor)
    assert set(fx["cases"]) <= {c.name for c in cases_for(flavor)}
    assert len(fx["cases"]) >= 8
    # the replay answer the engine's ROUTER really gave, in the framing the bridge parses
    seq, payload = parse_replay(fx["replay_sample"])  # type: ignore[misc]
    assert seq == 0 and VllmDecoder().decode(payload).events
    assert (len(fx["replay_sample"]) == 4) == fx["replay_topic_frame"]
    for rec in fx["cases"].values():
        for p in rec["payloads"]:
            assert isinstance(msgpack.unpackb(p, raw=False), list)  # EventBatch: an array


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_recorded_engine_output_through_bridge_and_indexer(
    bus: Bus, nats_url: str, subjects: Subjects, flavor: str
) -> None:
    await require_kv_events_stream(bus)
    async with indexer(nats_url, subjects) as svc:
        results = await run_fixture(flavor, bus, svc)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, failed
    assert len(results) >= 8
