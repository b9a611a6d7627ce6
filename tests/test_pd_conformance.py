"""Every P/D handshake field our router sends and our simulated worker reads or writes, checked
against what the engines' own code reads and writes (vLLM 0.33.0's NIXL connector and OpenAI
protocol, SGLang 0.5.23's OpenAI protocol and server args), as recorded from their wheels by
``python -m tests.tools.pd_conformance --record`` (tests/fixtures/engine_pd/facts.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from services.router import pd as router_pd
from services.worker_sim import pd as sim_pd

FACTS = json.loads((Path(__file__).parent / "fixtures" / "engine_pd" / "facts.json").read_text())
VLLM = FACTS["vllm-0.33.0"]
SGLANG = FACTS["sglang-0.5.23"]


def test_the_prefill_answer_carries_exactly_vllms_fields_in_its_order():
    ours = sim_pd.nixl_response_params("e", "r", [1, 2], "h", 5600, 32)
    assert list(ours) == VLLM["prefill_answer_params"]
    assert ours["do_remote_prefill"] is True and ours["do_remote_decode"] is False


def test_the_router_prefill_request_asks_for_a_remote_decode_with_fields_vllm_reads():
    body = msgspec.json.decode(
        router_pd.prefill_body(
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {}, "max_tokens": 9},
            {},
            nixl=True,
        )
    )
    params = body["kv_transfer_params"]
    assert set(params) <= set(VLLM["kv_transfer_params_read"])
    assert params["do_remote_decode"] is True
    assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body
    # kv_transfer_params is a top-level member of the requests and the whole answers vLLM takes
    # and gives (the router reads it from the answer, the decoder from its request)
    for cls in ("ChatCompletionRequest", "CompletionRequest"):
        assert cls in VLLM["classes_with_kv_transfer_params"]
    for cls in ("ChatCompletionResponse", "CompletionResponse"):
        assert cls in VLLM["classes_with_kv_transfer_params"]


def test_the_decoder_reads_only_fields_vllm_reads_and_the_ones_it_requires():
    read = set(VLLM["kv_transfer_params_read"])
    assert set(sim_pd.NIXL_DECODE_REQUIRED) <= read
    assert {"do_remote_prefill", "do_remote_decode"} <= read
    # what the prefill answered, passed through unchanged, is a valid decode request
    answer = sim_pd.nixl_response_params("eng", "req-0-0", [3, 4], "10.0.0.5", 8101, 40)
    h = sim_pd.parse_handshake({"kv_transfer_params": answer}, "decode")
    assert h is not None and h.side == "decode" and h.kind == "nixl"
    assert h.key == "req-0-0" and h.engine_id == "eng"
    assert h.pull_url == "http://10.0.0.5:8101" + sim_pd.PULL_PATH


def test_the_lease_default_is_vllms_kv_lease_duration():
    assert sim_pd.PdSettings().lease_s == VLLM["kv_lease_duration_default_s"]


def test_bootstrap_fields_are_sglangs_on_both_request_kinds():
    holders = SGLANG["classes_with_bootstrap_fields"]
    assert set(holders) == set(sim_pd.BOOTSTRAP_FIELDS)
    for f in sim_pd.BOOTSTRAP_FIELDS:
        (holder,) = holders[f]
        for cls in ("ChatCompletionRequest", "CompletionRequest"):
            assert cls in SGLANG["requests_inheriting_them"][holder]
    assert router_pd.SGLANG_BOOTSTRAP_PORT == SGLANG["disaggregation_bootstrap_port_default"]
    sent = router_pd.bootstrap_fields("http://10.0.0.7:30000", 8998)
    assert tuple(sent) == sim_pd.BOOTSTRAP_FIELDS
    assert sent["bootstrap_host"] == "10.0.0.7" and 0 <= sent["bootstrap_room"] < 2**63
    h = sim_pd.parse_handshake({**sent, "prompt": "x"}, "decode")
    assert h is not None and h.pull_url == "http://10.0.0.7:8998" + sim_pd.PULL_PATH


def test_sglang_roles_map_onto_ours():
    assert set(SGLANG["disaggregation_modes"]) == {"null", "prefill", "decode"}
    assert set(sim_pd.ROLES) == {"both", "prefill", "decode"}
