"""`kvgate bridge` learns its engine's disaggregated-serving role: from the engines' own words
given as flags (vLLM's kv_role, its --kv-transfer-config, SGLang's --disaggregation-mode; the
values recorded from their wheels in tests/fixtures/engine_pd/facts.json), or from SGLang's
/server_info; and announces it (and a prefill engine's bootstrap port) in its heartbeats on
the real bus."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.schemas import WorkerHeartbeat
from services.common.subjects import Subjects
from services.kv_indexer.bridges.pd_role import (
    SGLANG_MODES,
    VLLM_KV_ROLES,
    role_from_flags,
    role_from_server_info,
)
from services.kv_indexer.bridges.runtime import BridgeRuntime
from tests.test_kv_support import connected
from tests.tools.engine_http import HttpEngine

FACTS = json.loads((Path(__file__).parent / "fixtures" / "engine_pd" / "facts.json").read_text())


def test_every_engine_role_word_maps_to_ours():
    assert set(VLLM_KV_ROLES) == set(FACTS["vllm-0.33.0"]["kv_roles"])
    assert set(SGLANG_MODES) == set(FACTS["sglang-0.5.23"]["disaggregation_modes"])
    assert role_from_flags("kv_producer", "") == "prefill"
    assert role_from_flags("kv_consumer", "") == "decode"
    assert role_from_flags("null", "") == "both"
    assert role_from_flags("decode", '{"kv_role":"kv_producer"}') == "decode"  # --role wins
    cfg = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
    assert role_from_flags("auto", cfg) == "decode"
    assert role_from_flags("auto", "") is None  # ask the engine
    with pytest.raises(ValueError, match="kv_role"):
        role_from_flags("auto", '{"kv_connector":"NixlConnector"}')
    with pytest.raises(ValueError, match="not JSON"):
        role_from_flags("auto", "{kv_role")
    assert role_from_server_info({"disaggregation_mode": "null"}) == ("both", 0)
    assert role_from_server_info({"page_size": 1}) is None


async def _heartbeat(bus, rt: BridgeRuntime, worker: str) -> WorkerHeartbeat:
    """Run the bridge ``rt`` (heartbeats every 50 ms) until it announces ``worker`` once."""
    got: asyncio.Queue[WorkerHeartbeat] = asyncio.Queue()

    async def on(hb: WorkerHeartbeat, _msg) -> None:
        got.put_nowait(hb)

    rt.heartbeat_s = 0.05
    await rt.start()
    try:
        sub = await bus.subscribe(bus.subjects.heartbeat(worker), WorkerHeartbeat, on)
        try:
            return await asyncio.wait_for(got.get(), 10)
        finally:
            await sub.unsubscribe()
    finally:
        await rt.stop()


async def test_sglang_prefill_role_and_bootstrap_port_from_server_info(
    nats_url: str, subjects: Subjects
) -> None:
    info = {
        "page_size": 16,
        "max_total_num_tokens": 4096,
        "disaggregation_mode": "prefill",
        "disaggregation_bootstrap_port": 9001,
    }
    async with (
        HttpEngine(page_size=16, server_info=info) as http,
        connected(nats_url, subjects, "bridge") as b,
    ):
        rt = BridgeRuntime(b, "sg-p", engine="sglang", model="m", engine_url=http.url)
        hb = await _heartbeat(b, rt, "sg-p")
    assert (hb.role, hb.bootstrap_port) == ("prefill", 9001)
    assert hb.url == http.url.rstrip("/")  # no --worker-url: the engine's own


async def test_worker_url_is_announced_and_the_engine_probed_behind_it(
    nats_url: str, subjects: Subjects
) -> None:
    """A decode pod behind llm-d's routing sidecar: heartbeats name the sidecar's address
    (--worker-url), the engine is still read at --engine-url (its role from /server_info)."""
    info = {"page_size": 16, "max_total_num_tokens": 4096, "disaggregation_mode": "decode"}
    sidecar = "http://10.1.2.3:8000"
    async with (
        HttpEngine(page_size=16, server_info=info) as http,
        connected(nats_url, subjects, "bridge") as b,
    ):
        rt = BridgeRuntime(
            b, "sg-d", engine="sglang", model="m", engine_url=http.url, worker_url=sidecar
        )
        hb = await _heartbeat(b, rt, "sg-d")
    assert (hb.url, hb.role) == (sidecar, "decode")


async def test_vllm_decode_role_from_the_kv_transfer_config(
    nats_url: str, subjects: Subjects
) -> None:
    role = role_from_flags("auto", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}')
    async with connected(nats_url, subjects, "bridge") as b:
        rt = BridgeRuntime(b, "vl-d", engine="vllm", model="m", block_size=16, role=role)
        hb = await _heartbeat(b, rt, "vl-d")
    assert (hb.role, hb.bootstrap_port) == ("decode", 0)
