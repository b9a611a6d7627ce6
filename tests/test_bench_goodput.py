"""``python -m bench.goodput``: the bisection, misses, the workload at a rate, the ceiling, and
the command end to end on a tiny workload (real simulator runs, no stand-ins)."""

from __future__ import annotations

import json

import pytest

from bench.goodput import evaluate_point, main
from bench.goodput_search import (
    attainment,
    bisect_rate,
    offered_rate,
    slo_ceiling,
    workload_at,
)
from bench.metrics import ERROR, OK, REJECTED, TIMEOUT, RequestResult
from bench.simcore import make_engine_config, request_keys

# conversations of a 4k-token system prompt: 2 engines keep up at x1, not at x16
TINY = ["-p", "sessions=6", "-p", "turns=2", "-p", "system_len=4096", "-p", "user_len=32"]
TINY += ["-p", "output_len=8", "-p", "rate=4", "-p", "think_s=0.2"]


def _step(threshold: float, calls: list[float]):
    def evaluate(m: float) -> float:
        calls.append(m)
        return 0.95 if m <= threshold else 0.5

    return evaluate


def test_bisection_narrows_monotonically_to_the_threshold() -> None:
    calls: list[float] = []
    s = bisect_rate(_step(1.7, calls), 0.9, 0.5, 4.0, steps=6)
    assert calls[:2] == [4.0, 0.5]  # the ends first
    assert len(calls) == 8  # two ends + the bounded steps
    assert s.outcome == "bracketed"
    lo, hi = 0.5, 4.0
    for m in calls[2:]:  # each point lies inside the bracket, which only narrows
        assert lo < m < hi
        if m <= 1.7:
            lo = m
        else:
            hi = m
    assert (s.lo, s.hi) == (lo, hi)
    assert s.goodput == lo <= 1.7 < hi
    assert hi / lo == pytest.approx((4.0 / 0.5) ** (1 / 2**6))  # geometric resolution


def test_bisection_ends_met_at_max_or_missed_at_min() -> None:
    calls: list[float] = []
    top = bisect_rate(_step(10.0, calls), 0.9, 0.5, 4.0, steps=6)
    assert (top.outcome, top.goodput, calls) == ("at-max", 4.0, [4.0])
    calls.clear()
    none = bisect_rate(_step(0.1, calls), 0.9, 0.5, 4.0, steps=6)
    assert (none.outcome, none.goodput, calls) == ("below-min", None, [4.0, 0.5])
    with pytest.raises(ValueError):
        bisect_rate(_step(1.0, []), 0.9, 2.0, 1.0, steps=3)


def test_auto_upper_end_doubles_while_met_then_bisects_the_last_doubling() -> None:
    calls: list[float] = []
    s = bisect_rate(_step(20.0, calls), 0.9, 0.5, 4.0, steps=3, grow_to=256.0)
    assert calls[:4] == [4.0, 8.0, 16.0, 32.0]  # met at 4, 8, 16; missed at 32
    assert len(calls) == 4 + 3 and all(16.0 < m < 32.0 for m in calls[4:])
    assert s.outcome == "bracketed" and s.max_rate == 32.0
    assert s.goodput == s.lo <= 20.0 < s.hi and s.hi / s.lo == pytest.approx(2 ** (1 / 8))
    # met everywhere: doubles up to the cap (the last doubling capped at it), goodput >= it
    calls.clear()
    top = bisect_rate(_step(1e9, calls), 0.9, 0.5, 4.0, steps=3, grow_to=100.0)
    assert calls == [4.0, 8.0, 16.0, 32.0, 64.0, 100.0]
    assert (top.outcome, top.goodput, top.hi) == ("at-max", 100.0, None)
    # missed at the start: the plain search below it, nothing grows
    calls.clear()
    low = bisect_rate(_step(1.0, calls), 0.9, 0.5, 4.0, steps=2, grow_to=256.0)
    assert calls[:2] == [4.0, 0.5] and len(calls) == 4 and low.max_rate == 4.0
    with pytest.raises(ValueError):
        bisect_rate(_step(1.0, []), 0.9, 0.5, 4.0, steps=3, grow_to=4.0)


def test_refused_shed_timed_out_and_failed_requests_are_misses() -> None:
    def done(i: int, status: str = OK, ttft: float = 0.1) -> RequestResult:
        return RequestResult(
            f"r{i}", status=status, ttft_s=ttft, e2e_s=ttft + 0.9, completion_tokens=10
        )

    rs = [done(0), done(1), done(2, REJECTED), done(3, TIMEOUT), done(4, ERROR), done(5, ttft=9)]
    # TPOT = 0.9 / 9 = 0.1 s
    assert attainment(rs, 6.25, 0.2) == pytest.approx(2 / 6)
    assert attainment(rs, 6.25, 0.05) == 0.0
    assert attainment([], 6.25, 0.05) == 0.0


def test_conversations_scale_sessions_and_rate_together() -> None:
    params = {"sessions": 10, "turns": 2, "system_len": 32, "user_len": 16, "rate": 2.0}
    one = workload_at("multi-turn", params, 1.0)
    two = workload_at("multi-turn", params, 2.0)
    assert len(two.requests) == 2 * len(one.requests)
    assert two.params["rate"] == 4.0
    gsp = {"groups": 4, "prompts_per_group": 4, "prefix_len": 32, "rate": 10.0}
    a = workload_at("generated-shared-prefix", gsp, 1.0)
    b = workload_at("generated-shared-prefix", gsp, 3.0)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert offered_rate(b.requests) == pytest.approx(3 * offered_rate(a.requests))
    with pytest.raises(ValueError, match="at once"):
        workload_at("shared-system-prompt", {}, 1.0)


def test_requests_the_engine_refuses_count_against_the_policy() -> None:
    # turn 2 of every conversation outgrows max_model_len: refused, so a miss, although every
    # completed request meets the SLO
    conf = {
        "workload": "multi-turn",
        "params": {
            "sessions": 4,
            "turns": 2,
            "system_len": 64,
            "user_len": 32,
            "output_len": 8,
            "rate": 4,
            "think_s": 0.2,
            "seed": 0,
        },
        "engine": {"max_model_len": 120},
        "workers": 2,
        "queue_timeout_s": 30.0,
        "request_timeout_s": 600.0,
        "ttft_s": 60.0,
        "tpot_s": 10.0,
    }
    p = evaluate_point(conf, {"name": "round_robin", "params": {}}, 0, 1.0)
    assert p["rejected"] == 4
    assert p["attainment"] == pytest.approx(0.5)


def test_the_ceiling_from_the_latency_bound() -> None:
    cfg = make_engine_config({})
    params = {
        "groups": 4,
        "prompts_per_group": 8,
        "prefix_len": 512,
        "question_len": 64,
        "output_len": 4,
        "rate": 50.0,
    }

    def keys(rs):
        return request_keys(rs, cfg.block_size, cfg.hash_seed)

    def ceiling(workers: int, target: float, ttft: float):
        return slo_ceiling(
            "generated-shared-prefix", params, keys, cfg, workers, target, ttft, 1.0, 0.5, 1000.0
        )

    loose = ceiling(8, 0.9, 5.0)
    assert (loose.possible_share, loose.multiplier, loose.binds) == (1.0, 1000.0, False)
    # one engine, a TTFT SLO shorter than the work: the prefill capacity binds
    tight = ceiling(1, 0.5, 0.02)
    assert tight.binds and 0.5 < tight.multiplier < 1000.0
    assert tight.possible_share == 7 / 8  # each group's first computes its prefix: too slow
    at = workload_at("generated-shared-prefix", params, tight.multiplier).requests
    span = at[-1].arrival_s - at[0].arrival_s
    assert span + 0.02 >= tight.prefill_work_s  # fits here ...
    assert span + 0.02 == pytest.approx(tight.prefill_work_s, rel=0.01)  # ... and barely
    # an SLO no request's own prefill meets: not even the lowest rate
    none = ceiling(8, 0.9, 1e-6)
    assert (none.possible_share, none.multiplier) == (0.0, 0.0)


def test_the_command_prints_the_table_and_writes_its_files(tmp_path, capsys) -> None:
    argv = [
        "-w",
        "multi-turn",
        *TINY,
        "--profile",
        "default",
        "-n",
        "2",
        "--seeds",
        "0,1",
        "--steps",
        "2",
        "--policies",
        "round_robin,kv_aware",
        "--peers",
        "round_robin",
        "--min-rate",
        "0.25",
        "--max-rate",
        "16",
        "--ttft",
        "0.5",
        "--tpot",
        "0.05",
        "-j",
        "1",
        "--out-dir",
        str(tmp_path),
        "--name",
        "gp",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| `round_robin` (peer) |" in out and "| `kv_aware` |" in out
    assert "| ceiling (latency bound, any policy) |" in out
    assert "at x16 at most 100.0 % of the requests can meet the SLO" in out
    doc = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    assert len(doc["searches"]) == 4 and len(doc["ceiling"]) == 2
    for s in doc["searches"]:
        assert [p["multiplier"] for p in s["points"]][:2] == [16.0, 0.25]
        assert s["outcome"] == "bracketed" and len(s["points"]) == 4  # the ends + 2 steps
        lo, hi = s["bracket"]
        assert lo == s["goodput_multiplier"] and hi / lo == pytest.approx(64**0.25)
    csv = (tmp_path / "gp" / "attainment.csv").read_text().splitlines()
    assert csv[0].startswith("policy,seed,multiplier")
    assert len(csv) == 1 + sum(len(s["points"]) for s in doc["searches"])
    assert (tmp_path / "gp" / "attainment.png").stat().st_size > 0


def test_max_rate_auto_brackets_every_policy_above_the_start(tmp_path, capsys) -> None:
    # the tiny conversations at an eighth of the rate: both policies meet at x4, miss by x64
    tiny = [x if x != "rate=4" else "rate=0.5" for x in TINY]
    argv = ["-w", "multi-turn", *tiny, "--profile", "default", "-n", "2", "--seeds", "0"]
    argv += ["--steps", "1", "--policies", "round_robin,kv_aware", "--peers", "round_robin"]
    argv += ["--min-rate", "0.25", "--max-rate", "auto", "--auto-max", "64", "--ttft", "0.5"]
    argv += ["-j", "1", "--out-dir", str(tmp_path), "--name", "gp", "--no-progress"]
    argv += ["--no-plots"]
    assert main(argv) == 0
    assert "(auto: an upper end met doubles, up to x64;" in capsys.readouterr().out
    doc = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    assert doc["config"]["max_rate"] == 4.0 and doc["config"]["grow_to"] == 64.0
    for s in doc["searches"]:
        ms = [p["multiplier"] for p in s["points"]]
        grown = ms[:-1]  # 4, 8, ... up to the first miss, then the one bisection step
        assert grown == [4.0 * 2**k for k in range(len(grown))] and len(grown) >= 2
        assert s["points"][-2]["attainment"] < 0.9 <= s["points"][-3]["attainment"]
        assert s["outcome"] == "bracketed" and grown[-2] < ms[-1] < grown[-1]
        lo, hi = s["bracket"]
        assert lo == s["goodput_multiplier"] > 4.0 and hi / lo == pytest.approx(2**0.5)
    assert doc["config"]["searched_max"] == max(
        p["multiplier"] for s in doc["searches"] for p in s["points"]
    )


def test_bad_input_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["-w", "shared-system-prompt", "--out-dir", str(tmp_path)]) == 2
    assert "sends everything at once" in capsys.readouterr().err
    assert main(["--min-rate", "2", "--max-rate", "1", "--out-dir", str(tmp_path)]) == 2
    assert "--min-rate" in capsys.readouterr().err
    assert main(["--max-rate", "fast", "--out-dir", str(tmp_path)]) == 2
    assert "a number or 'auto'" in capsys.readouterr().err
    assert main(["--max-rate", "auto", "--auto-max", "3", "--out-dir", str(tmp_path)]) == 2
    assert "--auto-max must be above 4" in capsys.readouterr().err


def test_suite_scales_configurations_and_summarises_trace_windows(tmp_path) -> None:
    import argparse

    from bench import goodput_suite as suite

    a = argparse.Namespace(
        traces="/t", min_rate=0.5, max_rate=4.0, steps=3, policies="p", peers="q", jobs=1
    )
    # 32 workers: 4 x the conversations at 4 x the rate, the conversations' own multipliers
    argv = suite.config_args("mt", "prefill-bound", 32, a, "0,1,2")
    assert argv[argv.index("--min-rate") + 1 : argv.index("--min-rate") + 4] == [
        "1.5",
        "--max-rate",
        "3.0",
    ]
    assert "sessions=800" in argv and "rate=6.0" in argv
    # a trace's window s starts WINDOW_S x s later, replayed 4 x faster on 32 workers
    argv = suite.config_args("az", "default", 32, a, "0", window=2)
    assert f"start_s={600 + 2 * suite.WINDOW_S['az']}" in argv and "time_scale=0.125" in argv
    assert "max_requests=1200" in argv and argv[argv.index("--ttft") + 1] == "2.0"

    def run(name: str, goodputs: dict[str, tuple[float, float]]) -> None:
        d = tmp_path / name
        d.mkdir()
        searches = [
            {"label": k, "goodput_req_s": g, "goodput_multiplier": m}
            for k, (g, m) in goodputs.items()
        ]
        conf = {"peers": ["peer_a", "peer_b"], "ttft_s": 2.0, "tpot_s": 0.05}
        (d / "goodput.json").write_text(json.dumps({"config": conf, "searches": searches}))

    # three windows of one configuration are its seeds: medians 13 (default) and 10 (peer_b)
    run("az-default-n8-w0", {"slo_aware": (12.0, 1.2), "peer_a": (8.0, 0.8), "peer_b": (10.0, 1)})
    run("az-default-n8-w1", {"slo_aware": (13.0, 1.3), "peer_a": (9.0, 0.9), "peer_b": (10.0, 1)})
    run("az-default-n8-w2", {"slo_aware": (20.0, 2.0), "peer_a": (1.0, 0.1), "peer_b": (11.0, 1)})
    run("mt-prefill-bound-n8", {"slo_aware": (0.0, 0.0), "peer_a": (4.0, 1.0), "peer_b": (1, 1)})
    rows = suite.summary(tmp_path, "slo_aware").splitlines()[2:]
    assert len(rows) == 2
    az = next(r for r in rows if r.startswith("| az-default-n8 "))
    assert "`peer_b`" in az and "1.30x" in az and "| >= 1x | yes |" in az
    mt = next(r for r in rows if r.startswith("| mt-prefill-bound-n8 "))
    assert "`peer_a`" in mt and "0.00x" in mt and "MISSED" in mt


def test_scale_count_keeps_a_bursts_window_and_multiplies_its_requests() -> None:
    params = {"num_requests": 100, "rate": 200.0, "warmup_s": 0.1, "seed": 0}
    base = workload_at("shared-system-prompt", params, 1.0).requests
    # the rate alone: the same 100 requests in a quarter of the window
    fast = workload_at("shared-system-prompt", params, 4.0).requests
    assert len(fast) == 100 and fast[-1].arrival_s < 0.5 * base[-1].arrival_s
    # with the count: 400 requests in about the same window
    more = workload_at("shared-system-prompt", params, 4.0, scale_count=True).requests
    assert len(more) == 400
    assert more[-1].arrival_s == pytest.approx(base[-1].arrival_s, rel=0.3)
    gsp = {"groups": 8, "prompts_per_group": 4, "rate": 100.0, "seed": 0}
    assert len(workload_at("generated-shared-prefix", gsp, 2.0, scale_count=True).requests) == 64
    with pytest.raises(ValueError, match="no request count"):
        workload_at("azure", {"path": "/nonexistent", "time_scale": 1.0}, 2.0, scale_count=True)
