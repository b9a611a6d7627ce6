"""The in-process routing-work bench runs the router's own request path for each policy."""

from __future__ import annotations

import pytest

from bench.routing_work import STEPS, main, run_once


@pytest.mark.parametrize("policy", ["kv_aware", "slo_aware", "round_robin"])
def test_every_step_is_timed_and_the_steps_fit_in_the_loop(policy: str) -> None:
    out = run_once(policy, workers=2, inflight=8, requests=300)
    assert set(out) == {*STEPS, "total"}
    assert all(out[s] > 0 for s in STEPS)
    # the steps are timed inside the loop: together they cannot exceed its wall time
    assert sum(out[s] for s in STEPS) <= out["total"]


def test_cli_prints_each_policy_and_the_floor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policies", "kv_aware,round_robin", "--requests", "200", "--runs", "1"]) == 0
    text = capsys.readouterr().out
    assert "kv_aware" in text and "round_robin" in text
    assert "over round_robin: kv_aware" in text
