"""Workload generators: determinism, shapes, trace parsing and the prefix-sharing properties the
benchmarks rely on."""

from __future__ import annotations

import json
import os

import pytest

from bench.common import parse_policies
from bench.workloads import (
    WORKLOADS,
    build_workload,
    infinite_cache_hit_rate,
    parse_params,
    poisson_arrivals,
    workload_params,
)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize(
    "name", ["shared-system-prompt", "generated-shared-prefix", "multi-turn", "tool-agent"]
)
def test_generators_are_deterministic_and_seed_dependent(name):
    small = {
        "tool-agent": {"sessions": "3", "turns": "3", "tools_len": "100", "result_len": "50"},
        "shared-system-prompt": {"num_requests": "20", "system_len": "300", "rate": "5"},
        "generated-shared-prefix": {"groups": "3", "prompts_per_group": "4", "prefix_len": "200"},
        "multi-turn": {"sessions": "3", "turns": "3", "system_len": "100"},
    }[name]
    a = build_workload(name, small)
    b = build_workload(name, small)
    c = build_workload(name, {**small, "seed": "7"})
    assert a.requests == b.requests
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times)
    for r in a.requests:
        assert r.prompt.isascii() and r.prompt_tokens == len(r.prompt.encode())
        assert r.token_ids() == list(r.prompt.encode())
    assert len({r.request_id for r in a.requests}) == len(a.requests)


def test_shared_system_prompt_shape():
    w = build_workload(
        "shared-system-prompt",
        {"num_requests": 50, "system_len": 500, "question_len": 40, "output_len": 7, "rate": 10},
    )
    assert len(w) == 50
    system = w.requests[0].prompt[:500]
    assert all(r.prompt.startswith(system) and r.prompt_tokens == 540 for r in w.requests)
    assert len({r.prompt[500:] for r in w.requests}) == 50  # unique questions
    assert all(r.max_tokens == 7 for r in w.requests)
    # one request alone at 0, the rest after the warm-up
    assert w.requests[0].arrival_s == 0.0
    assert min(r.arrival_s for r in w.requests[1:]) >= 0.5


def test_generated_shared_prefix_groups_and_defaults():
    d = workload_params("generated-shared-prefix")
    assert (d["groups"], d["prompts_per_group"]) == (64, 16)
    assert (d["prefix_len"], d["question_len"], d["output_len"]) == (2048, 128, 256)
    w = build_workload(
        "generated-shared-prefix",
        {"groups": 4, "prompts_per_group": 5, "prefix_len": 100, "question_len": 10},
    )
    assert len(w) == 20
    by_group: dict[int, list[str]] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(len(v) for v in by_group.values()) == [5, 5, 5, 5]
    for prompts in by_group.values():
        assert len({p[:100] for p in prompts}) == 1
        assert all(len(p) == 110 for p in prompts)
    assert len({v[0][:100] for v in by_group.values()}) == 4
    # shuffled: the groups are interleaved, not in blocks of 5
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)


def test_multi_turn_extends_context():
    w = build_workload("multi-turn", {"sessions": 2, "turns": 3, "system_len": 50, "think_s": 2})
    sessions: dict[str, list] = {}
    for r in w.requests:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 2
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        assert [t.turn for t in turns] == [0, 1, 2]
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.prompt.startswith(a.prompt) and len(b.prompt) > len(a.prompt)
            assert b.arrival_s == pytest.approx(a.arrival_s + 2)


def test_tool_agents_share_schemas_and_grow_their_histories():
    w = build_workload(
        "tool-agent",
        {"sessions": 6, "turns": 3, "toolsets": 2, "tools_len": 80, "task_len": 10, "think_s": 0.5},
    )
    sessions: dict[str, list] = {}
    for r in w.requests:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 6 and len(w.requests) == 18
    firsts = {}
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        assert all(t.max_tokens == 64 for t in turns)
        for a, b in zip(turns, turns[1:], strict=False):
            # the history grows by the call and the result; the next turn waits think_s
            assert b.prompt.startswith(a.prompt) and len(b.prompt) >= len(a.prompt) + 64 + 192
            assert b.arrival_s == pytest.approx(a.arrival_s + 0.5)
        firsts[turns[0].group] = firsts.get(turns[0].group, []) + [turns[0].prompt]
    # sessions of one toolset share its 80-token schema, and nothing beyond it
    for prompts in firsts.values():
        for p in prompts[1:]:
            assert 80 <= _common_prefix(p, prompts[0]) < 90  # the tasks differ
    assert len(firsts) == 2


def _mooncake_file(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 4]},
        {"timestamp": 3000, "input_length": 400, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 4000, "input_length": 1024, "output_length": 3, "hash_ids": [2, 3]},
    ]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_mooncake_hash_ids_become_shared_prefixes(tmp_path):
    path = _mooncake_file(tmp_path)
    w = build_workload("mooncake", {"path": str(path)})
    a, b, c, d = w.requests
    assert [r.prompt_tokens for r in w.requests] == [1500, 1100, 400, 1024]
    assert [r.max_tokens for r in w.requests] == [5, 9, 2, 3]
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 2.0, 3.0]
    # equal leading hash ids -> equal leading 2 x 512 tokens; then they differ
    assert _common_prefix(a.prompt, b.prompt) >= 1024
    assert a.prompt[1024:1100] != b.prompt[1024:1100]
    # a hash id is the same text wherever it appears (block 2 and 3 in d = blocks 2..3 of a)
    assert d.prompt[:988] == a.prompt[512:1500]
    assert _common_prefix(a.prompt, c.prompt) < 512
    # time scaling, count limit, proportional shrinking keep the structure
    w2 = build_workload(
        "mooncake", {"path": str(path), "time_scale": 0.5, "max_requests": 2, "block_tokens": 64}
    )
    assert len(w2) == 2
    assert [r.arrival_s for r in w2.requests] == [0.0, 0.25]
    assert [r.prompt_tokens for r in w2.requests] == [188, 138]
    assert _common_prefix(*(r.prompt for r in w2.requests)) >= 128


def test_mooncake_bad_record_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        build_workload("mooncake", {"path": str(p)})


def test_azure_trace(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,480,10\n"
        "2023-11-16 18:17:04.4799600,100,8\n"
        "2023-11-16 18:17:06.0000000,30,1\n"
    )
    w = build_workload("azure", {"path": str(p), "time_scale": 2.0})
    assert [r.prompt_tokens for r in w.requests] == [480, 100, 30]
    assert [r.max_tokens for r in w.requests] == [10, 8, 1]
    assert [round(r.arrival_s, 6) for r in w.requests] == [0.0, 1.0, 4.04008]
    w2 = build_workload("azure", {"path": str(p), "token_scale": 0.5, "max_requests": 1})
    assert [(r.prompt_tokens, r.max_tokens) for r in w2.requests] == [(240, 5)]
    # a window of the trace: from 0.4 s on, arrivals counted from there
    w3 = build_workload("azure", {"path": str(p), "start_s": 0.4})
    assert [r.prompt_tokens for r in w3.requests] == [100, 30]
    assert [round(r.arrival_s, 6) for r in w3.requests] == [0.1, 1.62004]
    bad = tmp_path / "bad.csv"
    bad.write_text("when,ContextTokens\n1,2\n")
    with pytest.raises(ValueError, match="missing CSV columns"):
        build_workload("azure", {"path": str(bad)})


def test_real_traces_parse_when_present():
    """CI has ../shared beside the clone; the real traces must keep parsing."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces")
    mc = os.path.join(root, "synthetic_trace.jsonl")
    az = os.path.join(root, "AzureLLMInferenceTrace_code.csv")
    found = [p for p in (mc, az) if os.path.exists(p)]
    for p in found:
        kind = "mooncake" if p.endswith(".jsonl") else "azure"
        w = build_workload(kind, {"path": p, "max_requests": 50})
        assert len(w) == 50 and all(r.prompt_tokens > 0 for r in w.requests)


def test_infinite_cache_bound():
    w = build_workload(
        "shared-system-prompt",
        {"num_requests": 10, "system_len": 160, "question_len": 16, "output_len": 1},
    )
    # first request: nothing cached; the other 9 hit the 10 full system blocks (160 tokens)
    assert infinite_cache_hit_rate(w.requests, 16) == pytest.approx(9 * 160 / (10 * 176))
    g = build_workload(
        "generated-shared-prefix",
        {"groups": 2, "prompts_per_group": 3, "prefix_len": 64, "question_len": 16},
    )
    assert infinite_cache_hit_rate(g.requests, 16) == pytest.approx(4 * 64 / (6 * 80))


def test_parameters_are_checked():
    assert set(WORKLOADS) == {
        "shared-system-prompt",
        "generated-shared-prefix",
        "multi-turn",
        "tool-agent",
        "mooncake",
        "azure",
    }
    with pytest.raises(ValueError, match="no parameter 'bogus'"):
        build_workload("multi-turn", {"bogus": "1"})
    with pytest.raises(ValueError, match="expected int"):
        build_workload("multi-turn", {"sessions": "many"})
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(ValueError, match="needs path"):
        build_workload("mooncake")
    assert parse_params(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError):
        parse_params(["novalue"])


def test_poisson_arrivals_rate():
    import random

    xs = poisson_arrivals(random.Random(1), 4000, 50.0)
    assert xs == sorted(xs)
    assert 4000 / xs[-1] == pytest.approx(50.0, rel=0.08)
    assert poisson_arrivals(random.Random(1), 3, 0.0) == [0.0, 0.0, 0.0]


def test_policy_list_parsing():
    got = parse_policies('round_robin, kv_aware:{"max_inflight": 8, "seed": 1},kv_aware')
    assert got[0] == ("round_robin", {"name": "round_robin", "params": {}})
    assert got[1] == (
        'kv_aware{"max_inflight":8,"seed":1}',
        {"name": "kv_aware", "params": {"max_inflight": 8, "seed": 1}},
    )
    assert got[2] == ("kv_aware", {"name": "kv_aware", "params": {}})
    with pytest.raises(ValueError, match="twice"):
        parse_policies("prefix,prefix")
    with pytest.raises(ValueError, match="not JSON"):
        parse_policies("kv_aware:{oops}")
