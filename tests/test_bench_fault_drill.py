"""The fault drill (``python -m bench.fault_drill``) keeps working: its figures from known
outcomes, and one cheap scenario run end to end against a real ``kvgate up`` (embedded NATS
and Postgres, auth on, simulated workers, real client load) with tiny durations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.drill_load import CUT, FAILED, OK, REFUSED, Outcome, judge
from bench.drill_report import in_flight_at, markdown, recovery_s, summarize
from bench.drill_stack import counter_delta, sum_counter
from tests.up_stack import processes_mentioning, up_env


def _o(sent: float, kind: str, status: int = 200, stream: bool = False) -> Outcome:
    return Outcome(sent, sent + 0.1, stream, status, kind)


def test_outcomes_are_judged_without_smoothing() -> None:
    assert judge(200, False, stream=True, complete=True) == OK
    assert judge(200, False, stream=True, complete=False) == CUT  # no [DONE]
    assert judge(200, False, stream=False, complete=False) == FAILED  # a truncated answer
    assert judge(503, True, stream=False, complete=False) == REFUSED  # 503 + Retry-After
    assert judge(503, False, stream=True, complete=False) == FAILED
    assert judge(404, False, stream=False, complete=False) == FAILED
    assert judge(-1, False, stream=True, complete=False) == FAILED  # connection refused


def test_time_to_recover_is_the_first_whole_second_of_successes_after_the_fault() -> None:
    end = 100.0
    outcomes = [
        _o(99.5, FAILED),  # before the fault ended: not part of the recovery
        _o(100.2, OK),
        _o(100.7, FAILED, status=-1),  # second 0 had a failure
        _o(101.4, REFUSED, status=503),  # second 1 a refusal
        _o(103.1, OK),  # second 2 sent nothing; second 3 all ok
        _o(103.9, OK),
        _o(104.5, FAILED),  # a later failure does not move the recovery back
    ]
    assert recovery_s(outcomes, end, until=110.0) == 3.0
    assert recovery_s([_o(100.1, OK)], end, until=110.0) == 0.0
    assert recovery_s([_o(100.1, CUT, stream=True)], end, until=110.0) is None
    row = summarize("s", "a fault", 5.0, outcomes, end, 110.0)
    assert row.requests == row.ok + row.failed + row.refused + row.cut == 7
    assert (row.failed, row.refused, row.cut) == (3, 1, 0)
    streams = [Outcome(99.0, 101.0, True, 200, OK, worker="sim-1"), _o(99.0, OK), _o(100.5, OK)]
    assert in_flight_at(streams, 100.0) == {"sim-1": 1}  # the one the fault struck mid-stream
    table = markdown([row]).splitlines()
    assert len(table) == 3 and table[0].count("|") == table[1].count("|") == table[2].count("|")


def test_a_counter_of_a_restarted_process_counts_from_zero() -> None:
    page = (
        "# TYPE kvgate_index_verify_repairs_total counter\n"
        'kvgate_index_verify_repairs_total{worker="sim-0",reason="divergent"} 2.0\n'
        'kvgate_index_verify_repairs_total{worker="sim-1",reason="divergent"} 1.0\n'
    )
    assert sum_counter(page, "kvgate_index_verify_repairs_total") == 3.0
    # indexer-1 grew by 2; indexer-2 was restarted (3 -> 1: one repair since); indexer-3 new
    before = {"indexer-1": 1.0, "indexer-2": 3.0}
    assert counter_delta(before, {"indexer-1": 3.0, "indexer-2": 1.0, "indexer-3": 4.0}) == 7.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_drill_runs_a_worker_crash_against_kvgate_up(tmp_path: Path) -> None:
    out = tmp_path / "results"
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "bench.fault_drill", "--scenarios", "worker-crash"]
    argv += ["--workers", "2", "--indexers", "1", "--clients", "3"]
    argv += ["--before-s", "2", "--after-s", "3", "--hold-s", "2"]
    argv += ["--out", str(out), "--state-dir", str(state)]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env=up_env(), cwd=Path.cwd()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a line per phase, then the table with the scenario's row
    for phase in ("starting kvgate up", "worker-crash: inject", "worker-crash: clear"):
        assert phase in proc.stdout, proc.stdout
    assert "| worker-crash | sim-1 crashes mid-stream" in proc.stdout
    (saved,) = out.glob("fault-drill-*.json")
    result = json.loads(saved.read_text())
    assert result["errors"] == {}
    (row,) = result["rows"]
    assert row["requests"] == row["ok"] + row["failed"] + row["refused"] + row["cut"]
    assert row["requests"] >= 10, row
    assert row["ok"] > 0 and row["recover_s"] is not None, row
    assert row["router_rss_mib"] and row["router_rss_mib"] > 10, row
    assert row["left_behind"] == [], row  # the worker came back, the router knows it again
    assert isinstance(row["alerts"], dict) and isinstance(row["repairs"], float)
    timeline = result["details"]["worker-crash"]["timeline"]
    assert {s["t"] < 0 for s in timeline} == {True, False}  # load before and after the fault
    # a clean run leaves nothing behind: no stack process, no stack state (the folder given
    # with --state-dir is the user's: it stays)
    assert processes_mentioning(str(state)) == []
    assert list(state.iterdir()) == []
