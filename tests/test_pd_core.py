"""Disaggregated serving in the simulator (xPyD fleets on the lifecycle core) and the role
filter; the engine's P/D hooks are in tests/test_engine_pd.py, the P/D policies' pairing
decisions in tests/test_pd_policies.py."""

from __future__ import annotations

import math

from bench.simcore import SimOptions, simulate
from bench.workloads import build_workload
from services.core.pd.transfer import LINK_PROFILES, ModelShape, transfer_seconds
from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)


def test_transfer_time_from_model_shape_and_link() -> None:
    shape = ModelShape()  # Llama-3-8B: 2 x 32 x 8 x 128 x 2 = 131072 bytes a token
    assert shape.kv_bytes_per_token == 131072
    rdma = LINK_PROFILES["rdma"]
    assert math.isclose(transfer_seconds(4096, shape, rdma), 0.002 + 4096 * 131072 / 40e9)
    assert transfer_seconds(0, shape, rdma) == 0.0


# ---------------------------------------------------------------- the role filter
CAP = Capacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=256, max_model_len=65536)


def test_colocated_policies_route_only_to_both_role_workers() -> None:
    w = {
        "p": WorkerState("p", model="m", capacity=CAP, role="prefill"),
        "d": WorkerState("d", model="m", capacity=CAP, role="decode"),
        "b": WorkerState("b", model="m", capacity=CAP, inflight=50),
    }
    r = RequestInfo("r", model="m", prompt_tokens=64, max_tokens=8)
    for name in ("round_robin", "kv_aware", "slo_aware", "dynamo_kv", "llmd_default"):
        pol = build_policy({"name": name})
        for _ in range(3):
            d = decide(pol, r, ClusterSnapshot(w), {"p": 4, "d": 4})
            assert d.worker_id == "b", name
        assert d.filtered == {"p": "role prefill", "d": "role decode"}
    only_pd = {k: v for k, v in w.items() if k != "b"}
    d = decide(build_policy({"name": "kv_aware"}), r, ClusterSnapshot(only_pd), {})
    assert d.worker_id is None and "no routable worker" in d.reason


def test_colocated_fast_path_on_a_tracked_fleet_respects_roles() -> None:
    from services.common import schemas
    from services.core.cluster import ClusterState

    st = ClusterState(worker_timeout=math.inf, telemetry_stale_s=math.inf)
    cap = schemas.WorkerCapacity(
        block_size=16, num_gpu_blocks=1000, max_num_seqs=256, max_model_len=8192
    )
    for i in range(140):  # above kv_aware's large-fleet threshold (128)
        st.on_heartbeat(
            schemas.WorkerHeartbeat(
                worker_id=f"w{i}",
                instance_id=f"w{i}",
                url=f"http://w{i}",
                model="m",
                capacity=cap,
            ),
            0.0,
        )
    for i in range(130):  # all but ten are decode engines
        st.states[f"w{i}"].role = "decode"
        for ws in st.snapshot.watchers or []:
            ws.add(f"w{i}")
    for name in ("kv_aware", "slo_aware"):
        pol = build_policy({"name": name})
        seen = set()
        for k in range(30):
            r = RequestInfo(f"r{k}", model="m", prompt_tokens=64, max_tokens=8)
            seen.add(decide(pol, r, st.snapshot, {"w3": 4}).worker_id)
        assert seen and seen <= {f"w{i}" for i in range(130, 140)}, name


# ---------------------------------------------------------------- the simulator
ENGINE = {"prefill_token_s": 1.25e-4, "num_gpu_blocks": 192000, "max_model_len": 32768}


def conversations(sessions: int = 12):
    return build_workload(
        "multi-turn",
        {
            "sessions": sessions,
            "turns": 3,
            "system_len": 1024,
            "user_len": 512,
            "output_len": 64,
            "think_s": 2,
            "rate": 2.0,
            "seed": 0,
        },
    ).requests


def test_simulated_xpyd_fleet_moves_kv_and_serves_every_request() -> None:
    reqs = conversations()
    run = simulate(
        reqs,
        {"name": "pd_round_robin"},
        SimOptions(engine=ENGINE, prefill_workers=2, decode_workers=2),
    )
    assert all(r.status == "ok" for r in run.results)
    assert run.transfers == len(reqs) and run.local_prefills == 0
    assert {r.prefill_worker for r in run.results} == {"sim-p0", "sim-p1"}
    assert {r.worker for r in run.results} == {"sim-d0", "sim-d1"}
    assert all(r.completion_tokens == q.max_tokens for r, q in zip(run.results, reqs, strict=True))
    assert run.roles == {
        "sim-p0": "prefill",
        "sim-p1": "prefill",
        "sim-d0": "decode",
        "sim-d1": "decode",
    }
    # round robin ignores caches; the prefill engines still hit on shared system prompts
    assert sum(run.cache.per_worker[w][1] for w in ("sim-p0", "sim-p1")) > 0


def test_simulated_pd_fleet_refuses_colocated_policies() -> None:
    run = simulate(
        conversations(2),
        {"name": "kv_aware"},
        SimOptions(engine=ENGINE, prefill_workers=1, decode_workers=1),
    )
    assert {r.status for r in run.results} == {"rejected"}


def prefill_hit_rate(run) -> float:
    hits = sum(h for w, (_, h) in run.cache.per_worker.items() if "-p" in w)
    return hits / sum(q for w, (q, _) in run.cache.per_worker.items() if "-p" in w)


def test_pd_slo_follows_conversations_to_the_prefiller_holding_them() -> None:
    # the index is fed by the prefill engines' KV events: later turns go where they hit
    opts = SimOptions(engine=ENGINE, prefill_workers=2, decode_workers=2)
    run = simulate(conversations(), {"name": "pd_slo"}, opts)
    assert all(r.status == "ok" for r in run.results)
    remote = [r for r in run.results if r.prefill_worker]
    assert remote and run.transfers == len(remote)
    reqs = conversations()
    last: dict[str, str] = {}
    same = moved = 0
    for q, r in zip(reqs, run.results, strict=True):
        if r.prefill_worker is None:
            continue
        prev = last.get(q.session_id)
        if prev is not None:
            same += prev == r.prefill_worker
            moved += prev != r.prefill_worker
        last[q.session_id] = r.prefill_worker
    assert same >= 3 * moved


def test_prefill_lease_running_out_fails_the_pull_and_the_decoder_recomputes() -> None:
    reqs = conversations(4)
    opts = SimOptions(engine=ENGINE, prefill_workers=1, decode_workers=1)
    ok = simulate(reqs, {"name": "pd_round_robin"}, opts)
    assert ok.hold_timeouts == 0
    short = SimOptions(engine=ENGINE, prefill_workers=1, decode_workers=1, kv_hold_s=1e-6)
    run = simulate(reqs, {"name": "pd_round_robin"}, short)
    # every lease ends before its transfer: each pull fails, each decoder prefills itself
    assert run.hold_timeouts == run.transfers == len(reqs)
    assert all(r.status == "ok" for r in run.results)
    ttft = sorted(r.ttft_s for r in run.results)
    assert ttft[len(ttft) // 2] > sorted(r.ttft_s for r in ok.results)[len(ttft) // 2]
