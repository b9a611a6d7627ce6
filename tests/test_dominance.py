"""``bench.dominance``: per configuration of a sweep, on how many figures a policy is better
and worse than each peer rule."""

from __future__ import annotations

import pytest

from bench import dominance
from bench.slo_table import FIGURES, collect
from services.cli import main as kvgate


def test_compare_counts_figures_each_way():
    base = {"ttft_mean": 1.0, "ttft_p99": 2.0, "itl_p99": 30.0, "e2e_mean": 5.0}
    base |= {"hit": 50.0, "slo": 90.0}
    assert set(base) == set(FIGURES)
    # lower is better for latencies, higher for hit rate and SLO attainment; equal is neither
    ours = base | {"ttft_mean": 0.5, "hit": 40.0, "slo": 95.0}
    assert dominance.compare(ours, base) == (2, 1)
    assert dominance.compare(base, base) == (0, 0)
    # with a tolerance, within 2 % (latencies) or 0.5 points (percentages) is equal
    near = base | {"ttft_mean": 1.019, "itl_p99": 29.5, "hit": 49.6, "slo": 90.5}
    assert dominance.compare(near, base) == (2, 2)
    assert dominance.compare(near, base, rel=0.02, pt=0.5) == (0, 0)
    assert dominance.compare(ours, base, rel=0.02, pt=0.5) == (2, 1)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    shape = ["-w", "generated-shared-prefix", "-p", "groups=3", "-p", "prompts_per_group=3"]
    for seed in ("0", "1"):
        name = f"gsp-default-n2-s{seed}"
        argv = ["simulate", *shape, "--seed", seed, "-n", "2", "--no-plots", "--no-progress"]
        argv += ["--policies", "slo_aware,dynamo_kv,round_robin", "--out-dir", str(root)]
        assert kvgate(argv + ["--name", name]) == 0
    (root / "not-a-run").mkdir()  # other directories are not runs
    return root


def test_a_sweep_is_tallied_per_configuration(sweep, capsys):
    assert dominance.main([str(sweep), "--peers", "dynamo_kv,round_robin,llmd_default"]) == 0
    out = capsys.readouterr().out
    row = next(r for r in out.splitlines() if r.startswith("| gsp-default-n2 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "2"  # seeds
    assert cells[4] == "–"  # llmd_default did not run
    # the counts are those of the seeds' mean figures
    per = collect(sorted(sweep.glob("gsp-*")), 2.0, 0.05)
    mean = {p: {k: sum(r[k] for r in rs) / len(rs) for k in FIGURES} for p, rs in per.items()}
    for cell, peer in zip(cells[2:4], ("dynamo_kv", "round_robin"), strict=True):
        better, worse = dominance.compare(mean["slo_aware"], mean[peer])
        assert cell.startswith(f"+{better} / -{worse}")
    assert "figures better / worse" in out


def test_bad_input_is_said(sweep, tmp_path, capsys):
    assert dominance.main([str(tmp_path)]) == 2
    assert "no sweep runs" in capsys.readouterr().err
    assert dominance.main([str(sweep), "--ours", "kv_aware"]) == 2
    assert "no runs of kv_aware" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dominance.main([str(sweep), "--ours", "slo_aware,kv_aware"])
