"""``bench.slo_table``: the policies compared are named as ``kvgate simulate --policies``
names them, a variant with parameters included, and a name with no runs is said."""

from __future__ import annotations

import pytest

from bench import slo_table
from services.cli import main as kvgate

VARIANT = 'slo_aware:{"imposed_weight":0.25}'


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("slo")
    argv = ["simulate", "-w", "generated-shared-prefix", "-p", "groups=3"]
    argv += ["-p", "prompts_per_group=3", "-n", "2", "--no-plots", "--no-progress"]
    policies = f"slo_aware,{VARIANT},sglang_cache_aware,dynamo_kv"
    assert kvgate(argv + ["--policies", policies, "--out-dir", str(out), "--name", "r"]) == 0
    return out / "r"


def _versus_rows(text: str) -> list[str]:
    return [r.split("|")[1].strip() for r in text.splitlines() if "vs best peer" in r]


def test_a_variant_is_compared_by_its_policies_spelling(runs, capsys):
    slo_table.main([str(runs), "--ours", f"slo_aware,{VARIANT}"])
    out = capsys.readouterr()
    assert _versus_rows(out.out) == [
        "`slo_aware` vs best peer",
        '`slo_aware{"imposed_weight":0.25}` vs best peer',
    ]
    # peers absent from the runs (llmd_*) are said, not silently skipped
    assert "no runs labelled llmd_default, llmd_kv_util" in out.err


def test_the_default_compares_the_default_policy(runs, capsys):
    slo_table.main([str(runs), "--peers", "sglang_cache_aware,dynamo_kv"])
    out = capsys.readouterr()
    assert _versus_rows(out.out) == ["`slo_aware` vs best peer"]
    assert "no runs labelled kv_aware" in out.err


def test_bad_policy_text_is_a_usage_error(runs, capsys):
    with pytest.raises(SystemExit) as exc:
        slo_table.main([str(runs), "--ours", "slo_aware:{not json"])
    assert exc.value.code == 2
    assert "not JSON" in capsys.readouterr().err
