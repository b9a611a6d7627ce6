"""``bench.latency_bound``: lower bounds of TTFT and e2e that no routing policy can beat, held
against the simulator's own engines (every request of real runs, several policies) and met
exactly by a request alone on an idle engine."""

from __future__ import annotations

import itertools
import json

import pytest

from bench.latency_bound import (
    burst_copies,
    latency_bound,
    main,
    pooled_srpt_mean,
    request_bounds,
    uncached_tokens,
)
from bench.metrics import OK, percentile
from bench.simcore import SimOptions, make_engine_config, request_keys, simulate
from bench.workloads import BenchRequest, build_workload

WORKLOADS = {
    "multi-turn": {
        "sessions": 12,
        "turns": 3,
        "system_len": 256,
        "user_len": 200,
        "output_len": 24,
        "think_s": 0.2,
        "rate": 20,
    },
    "generated-shared-prefix": {
        "groups": 6,
        "prompts_per_group": 5,
        "prefix_len": 512,
        "question_len": 40,
        "output_len": 12,
    },
}


def _keys(requests, cfg):
    return request_keys(requests, cfg.block_size, cfg.hash_seed)


def test_srpt_on_the_pooled_machine_by_hand():
    # speed 1: t=0 both arrive, the 1-unit job runs first (done at 1); at 1 the third arrives
    # and is shorter than the 4 left of the first: done at 2; the long one at 6
    assert pooled_srpt_mean([(0.0, 4.0), (0.0, 1.0), (1.0, 1.0)], 1.0) == pytest.approx(8 / 3)
    # preemption: a short job arriving mid-way runs at once (flows 1 and 4)
    assert pooled_srpt_mean([(0.0, 3.0), (1.0, 1.0)], 1.0) == pytest.approx(2.5)
    # twice the speed halves every work; an idle gap is skipped
    assert pooled_srpt_mean([(0.0, 2.0), (10.0, 2.0)], 2.0) == pytest.approx(1.0)


def test_uncached_counts_leading_blocks_seen_before():
    cfg = make_engine_config({})
    a = BenchRequest("a", "x" * 64 + "y" * 20, 4)
    b = BenchRequest("b", "x" * 64 + "z" * 20, 4, arrival_s=1.0)
    c = BenchRequest("c", "x" * 64, 4, arrival_s=2.0)  # its last token is always computed
    reqs = [a, b, c]
    assert uncached_tokens(reqs, _keys(reqs, cfg), cfg.block_size) == [84, 20, 16]


@pytest.mark.parametrize("prompt,max_tokens", [(700, 9), (20_000, 3), (5, 1)])
def test_a_request_alone_meets_its_bound_exactly(prompt, max_tokens):
    # one request on an idle engine: nothing else in its steps, so the bound is its latency
    # (20,000 tokens: prefill in three chunks of the 8,192-token budget)
    req = BenchRequest("only", "ab" * (prompt // 2) + "a" * (prompt % 2), max_tokens)
    cfg = make_engine_config({"max_model_len": 32_768})
    run = simulate(
        [req],
        {"name": "round_robin", "params": {}},
        SimOptions(num_workers=2, engine={"max_model_len": 32_768}),
    )
    (res,) = run.results
    assert res.status == OK
    ((ttft, e2e, _work),) = request_bounds([req], _keys([req], cfg), cfg)
    assert res.ttft_s == pytest.approx(ttft, rel=1e-9)
    assert res.e2e_s == pytest.approx(e2e, rel=1e-9)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("policy", ["slo_aware", "round_robin", "sglang_cache_aware"])
def test_no_policy_beats_the_bound(name, policy):
    wl = build_workload(name, WORKLOADS[name])
    cfg = make_engine_config({})
    keys = _keys(wl.requests, cfg)
    run = simulate(wl.requests, {"name": policy, "params": {}}, SimOptions(num_workers=3))
    by_id = {r.request_id: r for r in run.results}
    per = request_bounds(wl.requests, keys, cfg)
    ttfts = []
    for req, (ttft, e2e, _work) in zip(wl.requests, per, strict=True):
        res = by_id[req.request_id]
        assert res.status == OK
        assert res.ttft_s >= ttft * (1 - 1e-9), req.request_id
        assert res.e2e_s >= e2e * (1 - 1e-9), req.request_id
        ttfts.append(res.ttft_s)
    b = latency_bound(wl.requests, keys, cfg, 3)
    assert sum(ttfts) / len(ttfts) >= b.ttft_mean
    assert percentile(ttfts, 99) >= b.ttft_p99
    assert b.ttft_mean == max(b.own_ttft_mean, b.queue_ttft_mean)
    if name == "multi-turn":
        # arrivals spread out: each turn's own prefill is most of its TTFT (a burst's bound
        # is loose: it lets followers hit prefixes still being computed)
        assert b.ttft_mean > 0.5 * sum(ttfts) / len(ttfts)


def test_a_burst_is_bounded_by_its_queue():
    wl = build_workload("generated-shared-prefix", WORKLOADS["generated-shared-prefix"])
    cfg = make_engine_config({})
    b = latency_bound(wl.requests, _keys(wl.requests, cfg), cfg, 1)
    # everything at once on one engine: the wait dominates each prefill alone
    assert b.queue_ttft_mean > 3 * b.own_ttft_mean
    assert latency_bound(wl.requests, _keys(wl.requests, cfg), cfg, 4).queue_ttft_mean < (
        b.queue_ttft_mean
    )


def test_cli_writes_the_bounds(tmp_path, capsys):
    out = tmp_path / "b" / "bound.json"
    rc = main(
        ["-w", "generated-shared-prefix", "-p", "groups=4", "-p", "prompts_per_group=3"]
        + ["-n", "2", "-e", "prefill_token_s=1e-4", "--out", str(out)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 12 and doc["workers"] == 2
    assert doc["ttft_mean"] >= doc["own_ttft_mean"] > 0
    assert "TTFT mean >=" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-n", "0"], "--workers"),
        (["-e", "no_such_knob=1"], "unknown engine setting"),
        (["-w", "multi-turn", "-p", "nope=1"], "nope"),
        (["--concurrency", "4"], "open-loop"),
    ],
)
def test_cli_refuses_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_slo_table_prints_the_bound_beside_the_best_peer(tmp_path, capsys):
    from bench import slo_table
    from services.cli import main as kvgate

    shape = ["-w", "multi-turn"] + [
        a for k, v in WORKLOADS["multi-turn"].items() for a in ("-p", f"{k}={v}")
    ]
    dirs = []
    for seed in ("0", "1"):
        name = f"mt-s{seed}"
        argv = shape + ["--seed", seed, "-n", "3"]
        assert (
            kvgate(
                ["simulate", *argv, "--policies", "slo_aware,sglang_cache_aware,dynamo_kv"]
                + ["--no-plots", "--no-progress", "--out-dir", str(tmp_path), "--name", name]
            )
            == 0
        )
        dirs.append(tmp_path / name)
    capsys.readouterr()
    slo_table.main([str(d) for d in dirs] + ["--ours", "slo_aware"])
    without = capsys.readouterr().out
    assert "bound" not in without  # not every run has one yet
    for seed, d in zip(("0", "1"), dirs, strict=True):
        assert main(shape + ["--seed", seed, "-n", "3", "--out", str(d / "bound.json")]) == 0
    capsys.readouterr()
    slo_table.main([str(d) for d in dirs] + ["--ours", "slo_aware"])
    rows = {
        r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
        for r in capsys.readouterr().out.splitlines()
        if r.startswith("| ")
    }
    results = [json.loads((d / "results.json").read_text()) for d in dirs]
    bounds = [json.loads((d / "bound.json").read_text()) for d in dirs]
    peers = {
        p: sum(
            run["summary"]["ttft_s"]["mean"]
            for doc in results
            for run in doc["runs"]
            if run["label"] == p
        )
        / 2
        for p in ("sglang_cache_aware", "dynamo_kv")
    }
    bound_mean = (bounds[0]["ttft_mean"] + bounds[1]["ttft_mean"]) / 2
    assert rows["bound (any policy)"][1] == f"{bound_mean:.3f}"
    ratio = bound_mean / min(peers.values())
    verdict = "reachable" if ratio <= 0.8 else "**unreachable**"
    assert rows["bound vs best peer"][1] == f"{ratio:.2f}x {verdict}"
    hit = sum(doc["workload"]["infinite_cache_hit_rate"] for doc in results) / 2
    assert rows["bound (any policy)"][5] == f"{100 * hit:.1f}"
    assert rows["bound vs best peer"][3] == "–"  # ITL p99: not bounded


def test_burst_copies_by_hand():
    # one request at t=0 holds a 2-block prefix; three arrive together at t=1, each with 16
    # tokens of its own. Per-slot bounds: a + the work done by then; on a copy the prefix too.
    cfg = make_engine_config({})
    prefix = "p" * 32
    reqs = [BenchRequest("w", prefix + "a" * 16, 2)] + [
        BenchRequest(f"b{i}", prefix + c * 16, 2, arrival_s=1.0) for i, c in enumerate("xyz")
    ]
    rows = burst_copies(reqs, _keys(reqs, cfg), cfg, 2)
    a, pt, pa = cfg.step_overhead_s, cfg.prefill_token_s, cfg.prefill_attn_s
    own = 16 * pt + pa * sum(range(33, 49))  # 16 tokens after the prefix: 33..48 positions
    pre = 32 * pt + pa * sum(range(1, 33))
    warm = a + 48 * pt + pa * sum(range(1, 49))  # the first request alone
    assert [r.copies for r in rows] == [0, 1]
    # no copy: the holder serves all three in turn
    assert rows[0].ttft_mean_min == pytest.approx((warm + 3 * a + 6 * own) / 4)
    # one copy: the holder's first two slots (a + own, a + 2 own) and the copy's first
    # (a + pre + own), whichever are the three smallest
    slots = sorted([a + own, a + 2 * own, a + 3 * own, a + pre + own, a + pre + 2 * own])
    assert rows[1].ttft_mean_min == pytest.approx((warm + sum(slots[:3])) / 4)
    # hits: the burst's prefix once per request with no copy; a copy computes it once
    total = 4 * 48
    assert rows[0].hit_rate_max == pytest.approx(3 * 32 / total)
    assert rows[1].hit_rate_max == pytest.approx(2 * 32 / total)


def test_burst_copies_needs_one_shared_prefix():
    cfg = make_engine_config({})
    spread = [BenchRequest("a", "x" * 40, 2), BenchRequest("b", "y" * 40, 2, arrival_s=1.0)]
    assert burst_copies(spread, _keys(spread, cfg), cfg, 2) == []  # a burst of one
    groups = build_workload("generated-shared-prefix", WORKLOADS["generated-shared-prefix"])
    assert burst_copies(groups.requests, _keys(groups.requests, cfg), cfg, 4) == []
    # one shared prefix and nobody holding it: the first worker to serve it is a copy
    alone = [BenchRequest(f"r{i}", "p" * 32 + c * 8, 2) for i, c in enumerate("xyz")]
    rows = burst_copies(alone, _keys(alone, cfg), cfg, 3)
    assert [r.copies for r in rows] == [1, 2, 3]
    assert rows[0].hit_rate_max == pytest.approx(2 * 32 / (3 * 40))


@pytest.mark.parametrize(
    "policy", ["slo_aware", "kv_aware", "llmd_default", "sglang_cache_aware", "round_robin"]
)
def test_no_policy_beats_the_burst_trade(policy):
    # the shared system prompt: one request at t=0, the rest together; a run that computed
    # the prompt on C more workers has at most row C's hit rate and at least its TTFT mean
    wl = build_workload("shared-system-prompt", {"num_requests": 48, "system_len": 512})
    cfg = make_engine_config({})
    rows = burst_copies(wl.requests, _keys(wl.requests, cfg), cfg, 4)
    assert [r.copies for r in rows] == [0, 1, 2, 3]
    assert all(x.ttft_mean_min > y.ttft_mean_min for x, y in itertools.pairwise(rows))
    run = simulate(wl.requests, {"name": policy, "params": {}}, SimOptions(num_workers=4))
    assert all(r.status == OK for r in run.results)
    first = next(r for r in run.results if r.request_id == wl.requests[0].request_id)
    served = {r.worker for r in run.results if r.request_id != first.request_id}
    row = rows[len(served - {first.worker})]
    ttft = sum(r.ttft_s for r in run.results) / len(run.results)
    hit = sum(r.cached_tokens for r in run.results) / sum(r.prompt_tokens for r in run.results)
    assert ttft >= row.ttft_mean_min
    assert hit <= row.hit_rate_max + 1e-12
