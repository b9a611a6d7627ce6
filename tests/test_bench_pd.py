"""The P/D benches: ``kvgate simulate --pd``, ``bench.goodput --pd`` (colocated and P/D fleets
of one engine count side by side) and ``bench.pd_split`` (the split from the engine model,
worked out by hand, and its exhaustive check), on tiny workloads with real simulator runs."""

from __future__ import annotations

import json
import math

import pytest

from bench import goodput, pd_split
from bench.simcore import SimOptions, for_policy, parse_split
from bench.workloads import BenchRequest
from services.core.engine import EngineConfig

TINY = ["-p", "sessions=6", "-p", "turns=2", "-p", "system_len=4096", "-p", "user_len=32"]
TINY += ["-p", "output_len=8", "-p", "rate=4", "-p", "think_s=0.2"]


def test_one_comparison_puts_every_policy_on_the_same_engine_count() -> None:
    pd = SimOptions(prefill_workers=3, decode_workers=5)
    assert for_policy(pd, {"name": "pd_slo"}) is pd
    colo = for_policy(pd, {"name": "kv_aware"})
    assert (colo.num_workers, colo.prefill_workers, colo.decode_workers) == (8, 0, 0)
    assert [r for _, r in colo.fleet()] == ["both"] * 8
    assert [r for _, r in pd.fleet()] == ["prefill"] * 3 + ["decode"] * 5
    assert parse_split("0:8") == (0, 8)
    for bad in ("8", "a:b", "2:0", "-1:3"):
        with pytest.raises(ValueError):
            parse_split(bad)


def test_goodput_table_compares_colocated_and_pd_fleets(tmp_path, capsys) -> None:
    argv = ["-w", "multi-turn", *TINY, "--profile", "default", "--pd", "1:1"]
    argv += ["--seeds", "0", "--steps", "1", "--policies", "kv_aware,pd_slo,pd_round_robin"]
    argv += ["--min-rate", "0.5", "--max-rate", "8", "--ttft", "0.5", "-j", "1"]
    argv += ["--out-dir", str(tmp_path), "--name", "gp", "--no-progress", "--no-plots"]
    assert goodput.main(argv) == 0
    out = capsys.readouterr().out
    assert "| `kv_aware` | 2 colocated |" in out and "| `pd_slo` | 1P1D |" in out
    assert "best colocated: kv_aware; best P/D peer: pd_round_robin" in out
    # every search evaluated the two ends: ITL and attainment side by side there
    assert "| x0.5 |" in out and "| x8 |" in out
    doc = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    assert doc["config"]["pd"] == [1, 1] and doc["config"]["workers"] == 2
    points = [p for s in doc["searches"] for p in s["points"]]
    assert all(p["itl_p99_s"] is None or p["itl_p99_s"] > 0 for p in points)


def _req(i: int, prompt: int, out: int) -> BenchRequest:
    return BenchRequest(f"r{i}", "x" * prompt, max_tokens=out, arrival_s=float(i))


def test_split_balances_the_pools_work_worked_out_by_hand() -> None:
    cfg = EngineConfig(max_model_len=32768)
    # two requests, 1600-token prompts with nothing shared, 100 output tokens each
    reqs = [_req(i, 1600, 100) for i in range(2)]
    keys = [tuple(range(i * 1000, i * 1000 + 100)) for i in range(2)]
    d = pd_split.demand(reqs, keys, cfg, tpot_s=0.05, max_util=0.8)
    # prefill: 6.5 ms x 1600 / 8192 (its share of a step) + 40e-6 x 1600 + 2.5e-9 x 1600 x
    # 800 = 68.47 ms, / 0.8 busy = 85.59 ms
    assert d.prefill_s == pytest.approx((0.0065 * 1600 / 8192 + 0.064 + 0.0032) / 0.8)
    # decode: context 1650; a sequence costs 30e-6 + 55e-9 x 1650 = 120.75 us a step; the
    # largest batch within 50 ms: (0.05 - 0.0065) / 120.75e-6 = 360, max_num_seqs 256, the KV
    # cache (432,000 tokens / 1700 a sequence) 254: 254; step 6.5 ms + 254 x 120.75 us =
    # 37.17 ms; 100 tokens / 254 x that = 14.6 ms a request
    assert d.decode_batch == 254
    assert d.decode_s == pytest.approx(100 * (0.0065 + 254 * 120.75e-6) / 254)
    # prefill share 85.6 / (85.6 + 14.6) = 85 %: of 8 engines 6.8 -> 6P2D or 7P1D, whichever
    # carries more: min(6 / .0856, 2 / .0146) = 70 req/s against min(7 / .0856, 1 / .0146) = 68
    rec = pd_split.recommend(d, 8)
    assert (rec.prefill, rec.decode) == (6, 2)
    assert rec.share == pytest.approx(d.prefill_s / (d.prefill_s + d.decode_s))
    assert pd_split.carried(d, 8, 6) == pytest.approx(6 / d.prefill_s)
    assert pd_split.carried(d, 8, 7) == pytest.approx(1 / d.decode_s)
    assert pd_split.carried(d, 8, 0) == pytest.approx(8 / (d.prefill_s + d.decode_s))


def test_short_prompts_stay_colocated_long_ones_split() -> None:
    cfg = EngineConfig()
    short = [_req(i, 128, 128) for i in range(2)]
    d = pd_split.demand(short, [(i, i) for i in range(2)], cfg, tpot_s=0.05, max_util=0.9)
    # a decode step carrying the 128-token prompt: 6.5 ms + 256 x (30e-6 + 55e-9 x 192) +
    # 40e-6 x 128 + ... = 21.9 ms, within 50 ms: sharing engines costs no TPOT, and the whole
    # fleet time-shared carries more than any split of it
    assert d.mixed_step_s < 0.05
    assert pd_split.recommend(d, 8).prefill == 0
    assert math.isclose(pd_split.carried(d, 8, 0), 8 / (d.prefill_s + d.decode_s))
    # 4096-token prompts: a step carrying one 4096-token chunk takes > 0.2 s: split the fleet
    long = [_req(i, 4096, 128) for i in range(2)]
    keys = [tuple(range(i * 1000, i * 1000 + 256)) for i in range(2)]
    d = pd_split.demand(long, keys, cfg, tpot_s=0.05, max_util=0.9)
    assert d.mixed_step_s > 0.2 and pd_split.recommend(d, 8).prefill > 0


def test_split_command_checks_the_recommendation_against_every_split(tmp_path, capsys) -> None:
    argv = ["-w", "multi-turn", *TINY, "--profile", "default", "-n", "3", "--exhaustive"]
    argv += ["--steps", "1", "--min-rate", "0.5", "--max-rate", "8", "--ttft", "0.5"]
    argv += ["-j", "1", "--out-dir", str(tmp_path), "--name", "sp", "--no-progress"]
    assert pd_split.main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended split for 3 engines:" in out
    doc = json.loads((tmp_path / "sp" / "pd_split.json").read_text())
    rows = doc["sweep"]["rows"]
    assert [r["prefill"] for r in rows] == [0, 1, 2]
    best = max(r["goodput_req_s"] for r in rows)
    rec = next(r for r in rows if r["prefill"] == doc["recommended"]["prefill"])
    assert doc["sweep"]["recommended_share_of_best"] == pytest.approx(rec["goodput_req_s"] / best)
    assert (tmp_path / "sp" / "split_goodput.png").stat().st_size > 0
    assert pd_split.main(["-n", "1", "--out-dir", str(tmp_path)]) == 2
