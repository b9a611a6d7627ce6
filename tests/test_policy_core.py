"""The pure policy core: filters, admission, built-ins, validation, determinism."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.core.keys import blocks_needed
from services.core.policy import (
    POLICY_SCHEMAS,
    Capacity,
    ClusterSnapshot,
    PolicyError,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
    policy_names,
    validate_policy_spec,
)

BUILTINS = {
    "round_robin",
    "random",
    "least_request",
    "power_of_two",
    "prefix",
    "kv_load",
    "gpu_aware",
    "kv_aware",
}


def workers(n: int = 4, model: str = "m", **kw) -> dict[str, WorkerState]:
    return {f"w{i}": WorkerState(f"w{i}", model=model, **kw) for i in range(n)}


def req(prompt: int = 100, max_tokens: int = 16, model: str = "m", rid: str = "r") -> RequestInfo:
    return RequestInfo(rid, model=model, prompt_tokens=prompt, max_tokens=max_tokens)


def test_builtins_registered_with_valid_json_schemas() -> None:
    assert BUILTINS <= set(policy_names())
    for name, schema in POLICY_SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        # defaults in the schema validate against the schema itself
        filled = validate_policy_spec(name, {})
        jsonschema.validate(filled, schema)
        json.dumps(schema)


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("nope", {}, "name"),
        ("kv_aware", {"decode_weight": -1}, "params.decode_weight"),
        ("kv_aware", {"decode_weight": "x"}, "params.decode_weight"),
        ("kv_aware", {"unknown_knob": 1}, "params.unknown_knob"),
        ("kv_aware", {"spread_credit": 1.5}, "params.spread_credit"),
        ("kv_aware", {"max_inflight": 0}, "params.max_inflight"),
        ("kv_aware", {"hot_min_blocks": True}, "params.hot_min_blocks"),
        ("weighted", {"weights": {"bogus": 1}}, "params.weights.bogus"),
        ("random", [], "params"),
    ],
)
def test_validation_names_the_field(name: str, params, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        validate_policy_spec(name, params)
    assert err.value.field == field
    assert field in str(err.value)


def test_build_policy_rejects_bad_spec_shape() -> None:
    with pytest.raises(PolicyError) as err:
        build_policy({"name": "kv_aware", "parms": {}})
    assert err.value.field == "parms"
    p = build_policy({"name": "kv_aware", "params": {"decode_weight": 8, "max_inflight": None}})
    assert p.params["decode_weight"] == 8 and p.params["spread_margin"] >= 1


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_filters_exclude_unroutable_and_other_models(name: str) -> None:
    ws = workers(6)
    ws["w0"].healthy = False
    ws["w1"].cordoned = True
    ws["w2"].draining = True
    ws["w3"].circuit_open = True
    ws["w4"].model = "other"
    p = build_policy({"name": name, "params": {}})
    for i in range(20):
        d = decide(p, req(rid=f"r{i}"), ClusterSnapshot(ws), {"w0": 5, "w1": 5})
        assert d.worker_id == "w5", (d.worker_id, d.filtered)
    assert set(d.filtered) == {"w0", "w1", "w2", "w3", "w4"}
    none = decide(p, req(model="absent"), ClusterSnapshot(ws), {})
    assert none.worker_id is None and not none.wait and none.never_fits is None


def test_never_fits_reports_the_numbers() -> None:
    cap = Capacity(block_size=16, num_gpu_blocks=100, max_num_seqs=8, max_model_len=100_000)
    ws = workers(2, capacity=cap)
    d = decide(build_policy({"name": "kv_aware"}), req(1590, 20), ClusterSnapshot(ws), {})
    assert d.worker_id is None and not d.wait
    need = blocks_needed(1590, 20, 16)
    assert need == 101
    assert d.never_fits and "101 KV blocks" in d.never_fits and "100 blocks" in d.never_fits
    ok = decide(build_policy({"name": "kv_aware"}), req(1580, 20), ClusterSnapshot(ws), {})
    assert ok.worker_id is not None
    cap2 = Capacity(block_size=16, num_gpu_blocks=10_000, max_num_seqs=8, max_model_len=1024)
    d2 = decide(
        build_policy({"name": "round_robin"}),
        req(1000, 100),
        ClusterSnapshot(workers(1, capacity=cap2)),
        {},
    )
    assert d2.never_fits and "max_model_len 1024" in d2.never_fits


def test_admission_waits_when_no_worker_can_take_it_now() -> None:
    cap = Capacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=4, max_model_len=8192)
    ws = workers(2, capacity=cap)
    ws["w0"].inflight = 4  # at max_num_seqs
    ws["w1"].kv_blocks_free = 10  # needs ceil(200/16)=13 blocks
    p = build_policy({"name": "least_request"})
    d = decide(p, req(184, 16), ClusterSnapshot(ws), {})
    assert d.worker_id is None and d.wait
    assert "at cap" in d.filtered["w0"] and "KV full" in d.filtered["w1"]
    # a prefix it already holds needs no new blocks: 13 - 4 held = 9 <= 10 free
    d = decide(p, req(184, 16), ClusterSnapshot(ws), {"w1": 4})
    assert d.worker_id == "w1"
    # a policy cap lower than max_num_seqs
    ws["w1"].kv_blocks_free = None
    ws["w1"].inflight = 2
    capped = build_policy({"name": "least_request", "params": {"max_inflight": 2}})
    assert decide(capped, req(), ClusterSnapshot(ws), {}).wait


def test_round_robin_cycles_and_random_is_seeded() -> None:
    ws = workers(4)
    rr = build_policy({"name": "round_robin"})
    picks = [decide(rr, req(), ClusterSnapshot(ws), {}).worker_id for _ in range(8)]
    assert picks == ["w0", "w1", "w2", "w3"] * 2

    def seq(seed: int) -> list[str | None]:
        p = build_policy({"name": "random", "params": {"seed": seed}})
        return [decide(p, req(), ClusterSnapshot(ws), {}).worker_id for _ in range(40)]

    assert seq(1) == seq(1)
    assert seq(1) != seq(2)
    assert set(seq(3)) == set(ws)


def test_least_request_and_power_of_two_prefer_idle() -> None:
    ws = workers(4)
    for i, w in enumerate(ws.values()):
        w.inflight = 10 - i
    assert (
        decide(build_policy({"name": "least_request"}), req(), ClusterSnapshot(ws), {}).worker_id
        == "w3"
    )
    p2 = build_policy({"name": "power_of_two", "params": {"seed": 7}})
    for _ in range(30):
        d = decide(p2, req(), ClusterSnapshot(ws), {})
        assert len(d.scores) == 2
        assert d.worker_id == min(d.scores, key=lambda w: ws[w].inflight)
        assert d.worker_id != "w0"  # the most loaded never wins a pair


def test_kv_load_ignores_prefix_and_gpu_aware_reads_pressure() -> None:
    ws = workers(3)
    ws["w0"].kv_usage, ws["w1"].kv_usage, ws["w2"].kv_usage = 0.9, 0.2, 0.5
    d = decide(build_policy({"name": "kv_load"}), req(), ClusterSnapshot(ws), {"w0": 6})
    assert d.worker_id == "w1"
    g = workers(3)
    g["w0"].gpu_sm_util, g["w0"].gpu_mem_used, g["w0"].gpu_bw_util = 0.95, 0.9, 0.9
    g["w1"].gpu_sm_util, g["w1"].gpu_mem_used, g["w1"].gpu_bw_util = 0.1, 0.3, 0.1
    g["w2"].telemetry_stale = True  # neutral 0.5 everywhere, must lose to w1
    g["w2"].gpu_sm_util = 0.0
    d = decide(build_policy({"name": "gpu_aware"}), req(), ClusterSnapshot(g), {})
    assert d.worker_id == "w1"
    assert d.scores["w2"] > d.scores["w1"] and d.scores["w0"] > d.scores["w2"]


def test_kv_aware_credits_overlap_against_load() -> None:
    ws = workers(2)
    p = build_policy({"name": "kv_aware"})
    # w0 holds 50 of 64 blocks of a 1024-token prompt: wins while idle
    d = decide(p, req(1024), ClusterSnapshot(ws), {"w0": 50})
    assert d.worker_id == "w0" and d.cached_tokens == 800 and d.overlap_blocks == 50
    # the saved prefill counts uncached_weight times (leaving a holder costs the copy too)
    uw = p.params["uncached_weight"]
    assert d.scores["w1"] - d.scores["w0"] == pytest.approx(800 * uw)
    # ...but not once it has much more prefill queued than the prefix saves
    ws["w0"].pending_prefill_tokens = int(800 * uw) + 200
    d = decide(p, req(1024), ClusterSnapshot(ws), {"w0": 50})
    assert d.worker_id == "w1"


def test_weighted_policy_from_configuration() -> None:
    ws = workers(2)
    ws["w0"].inflight = 3
    only_prefix = build_policy({"name": "weighted", "params": {"weights": {"prefix": 1.0}}})
    assert decide(only_prefix, req(320), ClusterSnapshot(ws), {"w0": 10}).worker_id == "w0"
    only_load = build_policy({"name": "weighted", "params": {"weights": {"inflight": 1.0}}})
    assert decide(only_load, req(320), ClusterSnapshot(ws), {"w0": 10}).worker_id == "w1"


def test_session_scorer_keeps_a_session_on_one_worker() -> None:
    ws = workers(8)
    p = build_policy({"name": "weighted", "params": {"weights": {"session": 1.0}}})
    for sid in ("alice", "bob", "carol"):
        picks = {
            decide(
                p, RequestInfo(f"{sid}{i}", "m", 10, 10, session_id=sid), ClusterSnapshot(ws), {}
            ).worker_id
            for i in range(5)
        }
        assert len(picks) == 1
