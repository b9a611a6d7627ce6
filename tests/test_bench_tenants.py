"""bench.bench_tenants runs end to end on a small fleet, and its figures say what flow
control is for: light tenants are not starved by a heavy one, backlogged tenants get their
weights' shares, critical requests are not refused while sheddable ones are sent."""

from __future__ import annotations

import json

import pytest

from bench import bench_tenants


def test_bench_tenants_small_fleet(tmp_path) -> None:
    out = tmp_path / "t.json"
    rc = bench_tenants.main(
        ["--seeds", "1", "--span", "8", "--workers", "1", "--max-inflight", "4",
         "--modes", "fcfs,kvgate,kvgate_sglang", "--engine-queue", "64",
         "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    heavy, fair, prio = res["heavy"][0], res["fair"][0], res["priority"][0]
    # FCFS: light requests wait behind the heavy tenant's backlog; kvgate: a fraction of that
    assert heavy["kvgate"]["light_ttft_p99_s"] < heavy["fcfs"]["light_ttft_p99_s"] / 5
    assert fair["kvgate"]["jain_min"] > 0.95 > fair["fcfs"]["jain_min"]
    assert fair["kvgate"]["max_share_deviation"] < 0.1
    assert prio["kvgate"]["critical_refused_while_sheddable_sent"] == 0
    assert prio["kvgate"]["critical_ttft_p99_2x_s"] < prio["fcfs"]["critical_ttft_p99_2x_s"]
    # the TTFT split: each part is at most the whole; FCFS's light tail is its router wait
    for mode in ("fcfs", "kvgate"):
        h = heavy[mode]
        assert 0 < h["light_engine_p99_s"] <= h["light_ttft_p99_s"]
        assert h["light_queue_wait_p99_s"] <= h["light_ttft_p99_s"]
        for load in ("1x", "2x"):
            p = prio[mode]
            assert 0 < p[f"critical_engine_p99_{load}_s"] <= p[f"critical_ttft_p99_{load}_s"]
            assert 0 <= p[f"critical_wait_p99_{load}_s"] <= p[f"critical_ttft_p99_{load}_s"]
    assert heavy["fcfs"]["light_queue_wait_p99_s"] > heavy["fcfs"]["light_engine_p99_s"]
    # the light requests over the target, by cause: the causes add up to all of them; FCFS's
    # are over for their router wait (no prefill room: none held by it)
    for mode in ("fcfs", "kvgate"):
        over = heavy[mode]["light_over_target"]
        assert set(over) == {"all", *bench_tenants.CAUSES}
        assert 0 < over["all"] <= 1
        assert abs(sum(over[c] for c in bench_tenants.CAUSES) - over["all"]) < 1e-9
        assert over["room_held"] == 0
    fcfs = heavy["fcfs"]["light_over_target"]
    assert fcfs["slot_wait"] > fcfs["all"] / 2


def test_loadgen_names_tenant_and_band_as_a_gateway_would() -> None:
    from bench.loadgen import tenant_headers
    from bench.workloads import BenchRequest

    assert tenant_headers(BenchRequest("r", "p", 1)) == {}
    assert tenant_headers(BenchRequest("r", "p", 1, tenant="a")) == {"x-kvgate-tenant": "a"}
    assert tenant_headers(BenchRequest("r", "p", 1, tenant="a", priority="critical")) == {
        "x-kvgate-tenant": "a",
        "x-kvgate-priority": "critical",
    }


def test_bench_tenants_sweeps_the_room_quantile(tmp_path) -> None:
    """``kvgate_room@Q`` runs the prefill room at quantile Q, beside plain ``kvgate_room`` (at
    ``--protect-quantile``) in the same run; a mode it cannot parse is refused."""
    out = tmp_path / "t.json"
    rc = bench_tenants.main(
        ["--scenarios", "heavy", "--seeds", "1", "--span", "8", "--workers", "2",
         "--max-inflight", "4", "--modes", "kvgate,kvgate_room,kvgate_room@0.8,kvgate_room@0.99",
         "--protect-quantile", "0.8", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    heavy = json.loads(out.read_text())["results"]["heavy"][0]
    assert heavy["kvgate_room"] == heavy["kvgate_room@0.8"]  # the same runs
    # at 0.99 the room (capped one below the 2 workers) holds the heavy tenant's prompts for
    # the light ones' sake: less heavy work than without the room, none more than at 0.8
    work = {
        m: heavy[m]["heavy_work_per_s"] for m in ("kvgate", "kvgate_room@0.8", "kvgate_room@0.99")
    }
    assert work["kvgate_room@0.99"] < work["kvgate"]
    assert work["kvgate_room@0.99"] <= work["kvgate_room@0.8"]
    for bad in ("kvgate_room@1.5", "kvgate_room@x", "kvgate@0.9", "fifo"):
        with pytest.raises(SystemExit):
            bench_tenants.main(["--modes", bad])
