"""Engine /metrics parsing: each engine's exposition normalised into one reading."""

from __future__ import annotations

import random

import pytest

from services.telemetry.engines import carry_slow, parse_fast_vllm, parse_metrics, select_lines
from services.telemetry.targets import (
    assign_gpus,
    metrics_url,
    parse_gpu_map,
    parse_pid_map,
    parse_targets,
)
from tests.telemetry_util import sglang_text, sim_text, trtllm_text, vllm_text


def test_vllm_exposition_is_normalised() -> None:
    text = vllm_text(
        5,
        7,
        0.625,
        blocks=573,
        block_size=16,
        queries=1000,
        hits=600,
        prompt=(12000, 10),
        max_tokens=(2560, 10),
    )
    r = parse_metrics(text)
    assert r.source == "vllm"
    assert (r.running, r.waiting, r.scheduled) == (5, 7, None)
    assert r.kv_usage == pytest.approx(0.625)
    assert (r.kv_blocks_total, r.tokens_per_block, r.kv_capacity_tokens) == (573, 16, 573 * 16)
    assert r.kv_blocks_free == round(573 * 0.375)
    assert (r.prefix_cache_queries, r.prefix_cache_hits) == (1000, 600)
    assert r.prefix_caching is True
    assert (r.prompt_tokens_sum, r.prompt_tokens_count) == (12000, 10)
    assert (r.max_tokens_sum, r.max_tokens_count) == (2560, 10)
    # histogram buckets and unrelated families never reach the parser
    selected = select_lines(text)
    assert selected and not any("time_to_first_token" in line for line in selected)
    assert all(line.startswith("vllm:") for line in selected)


def test_series_are_parsed_once_and_values_every_time() -> None:
    first = parse_metrics(vllm_text(1, 2, 0.1))
    again = parse_metrics(vllm_text(7, 9, 0.8))  # same series, new values
    assert (first.running, first.waiting) == (1, 2)
    assert (again.running, again.waiting, again.kv_usage) == (7, 9, pytest.approx(0.8))
    # an optional timestamp after the value is ignored; labels with '}' inside quotes are fine
    text = (
        'vllm:num_requests_running{model_name="a}b"} 4 1700000000000\nvllm:num_requests_waiting 3\n'
    )
    r = parse_metrics(text)
    assert (r.running, r.waiting) == (4, 3)
    with pytest.raises(ValueError):
        parse_metrics('vllm:num_requests_running{model_name="x"}\n')


def test_vllm_data_parallel_ranks_are_summed_and_fractions_averaged() -> None:
    text = vllm_text(3, 1, 0.5) + vllm_text(2, 4, 0.7).replace('engine="0"', 'engine="1"')
    r = parse_metrics(text)
    assert (r.running, r.waiting) == (5, 5)
    assert r.kv_usage == pytest.approx(0.6)


def test_vllm_older_names_and_prefix_caching_off() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 2\n'
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4\n'
        'vllm:cache_config_info{block_size="32",enable_prefix_caching="False",num_gpu_blocks="100"} 1\n'
    )
    r = parse_metrics(text)
    assert r.kv_usage == pytest.approx(0.25)
    assert (r.prefix_cache_queries, r.prefix_cache_hits) == (10, 4)
    assert r.prefix_caching is False
    assert r.kv_capacity_tokens == 3200


def test_trtllm_seed_001_numbers() -> None:
    """The field report: 8 active, 1 scheduled, KV blocks nearly all used."""
    r = parse_metrics(trtllm_text(8, 1, max_batch=64, used=39, total=40, tpb=64))
    assert r.source == "trtllm"
    assert (r.running, r.scheduled, r.max_batch) == (8, 1, 64)
    assert r.waiting is None  # not exposed by this backend version: None, not 0
    assert (r.kv_blocks_total, r.kv_blocks_free, r.tokens_per_block) == (40, 1, 64)
    assert r.kv_usage == pytest.approx(39 / 40)
    assert r.kv_capacity_tokens == 40 * 64


def test_trtllm_older_statistics_family_and_waiting() -> None:
    text = (
        trtllm_text(4, 4, used=10, total=100, waiting=3)
        .replace("nv_trt_llm_request_metrics", "nv_trt_llm_request_statistics")
        .replace("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_kv_cache_block_statistics")
    )
    r = parse_metrics(text)
    assert (r.source, r.running, r.scheduled, r.waiting) == ("trtllm", 4, 4, 3)
    assert r.kv_usage == pytest.approx(0.1)


def test_sglang() -> None:
    r = parse_metrics(sglang_text(12, 3, 0.28, 0.75, 161721))
    assert r.source == "sglang"
    assert (r.running, r.waiting) == (12, 3)
    assert r.kv_usage == pytest.approx(0.28)
    assert r.cache_hit_rate == pytest.approx(0.75)
    assert r.kv_capacity_tokens == 161721
    assert r.prefix_caching is True


def test_sim_worker_gpu_gauges() -> None:
    text = sim_text(3, 2, 0.5, sm=71.5, mem_used=60 * 2**30, mem_total=80 * 2**30, bw=44.0)
    r = parse_metrics(text)
    assert r.source == "sim"
    assert (r.running, r.waiting) == (3, 2)
    [g] = r.gpus
    assert g.index == 0
    assert g.sm_util_pct == pytest.approx(71.5)
    assert g.mem_util_pct == pytest.approx(75.0)
    assert (g.mem_used_bytes, g.mem_total_bytes, g.mem_free_bytes) == (
        60 * 2**30,
        80 * 2**30,
        20 * 2**30,
    )
    assert g.mem_bw_util_pct == pytest.approx(44.0)


def test_engine_hint_overrides_detection() -> None:
    r = parse_metrics(vllm_text(1, 0, 0.1), engine="sim")
    assert r.source == "sim" and r.running == 1


def test_unknown_exposition_is_an_error_not_zeros() -> None:
    with pytest.raises(ValueError, match="no vLLM, SGLang"):
        parse_metrics("# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 1.0\n")


def test_target_and_map_parsing() -> None:
    t = parse_targets("a=http://10.0.0.5:8000@vllm; b=http://h:8002/metrics@trtllm ;c=http://h:9")
    assert t["a"].url == "http://10.0.0.5:8000/metrics" and t["a"].engine == "vllm"
    assert t["b"].url == "http://h:8002/metrics" and t["b"].engine == "trtllm"
    assert t["c"].engine is None and t["c"].static
    with pytest.raises(ValueError, match="unknown engine"):
        parse_targets("a=http://h:1@foo")
    with pytest.raises(ValueError, match="invalid worker id"):
        parse_targets("a.b=http://h:1")
    with pytest.raises(ValueError, match="not an http"):
        metrics_url("tcp://h:1")
    assert parse_gpu_map("a=0,1; b=2") == {"a": (0, 1), "b": (2,)}
    with pytest.raises(ValueError, match="GPU indices"):
        parse_gpu_map("a=x")
    assert parse_pid_map("a=42") == {"a": 42}
    a = assign_gpus(["a", "b", "c"], {"a": (0, 1)}, {"b": {7, 8}, "c": {99}}, {2: {8}, 3: {1}})
    assert a.gpus_of("a") == [0, 1] and a.gpus_of("b") == [2] and a.gpus_of("c") == []
    assert a.workers_of(2) == ["b"]


def _vllm_registry_answer(rng: random.Random, ranks: int, old_names: bool, drop: set[str]) -> bytes:
    """A vLLM fast-series answer as prometheus-client renders it (the name[] filter applied)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    lab = ["engine", "model_name"]
    usage = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    pre = "vllm:gpu_prefix_cache_" if old_names else "vllm:prefix_cache_"
    gauges = ["vllm:num_requests_running", "vllm:num_requests_waiting", usage]
    names = []
    for name in gauges:
        if name not in drop:
            g = Gauge(name, "g", lab, registry=reg)
            names.append(name)
            for r in range(ranks):
                g.labels(str(r), "m").set(
                    rng.choice([0, 1, 7, 250]) if "usage" not in name else rng.random()
                )
    for name in (pre + "queries", pre + "hits"):
        if name not in drop:
            c = Counter(name, "c", lab, registry=reg)
            names.append(name + "_total")
            for r in range(ranks):
                c.labels(str(r), "m").inc(rng.randint(0, 10**6))
    return generate_latest(reg.restricted_registry(names))


@pytest.mark.parametrize("seed", range(6))
def test_fast_vllm_path_equals_the_general_parse(seed: int) -> None:
    """parse_fast_vllm (the agent's shortcut for vLLM's fast answers) gives exactly what
    parse_metrics + carry_slow give, and declines (None) what it cannot read alone."""
    rng = random.Random(seed)
    full = vllm_text(3, 1, 0.5, prompt=(4096.0, 16), max_tokens=(2048.0, 16))
    base = parse_metrics(full, "vllm")  # a full answer: the slow fields to carry
    used = 0
    for _ in range(40):
        ranks = rng.choice([1, 1, 1, 2])
        drop = set(
            rng.sample(
                ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"], k=rng.randint(0, 1)
            )
        )
        body = _vllm_registry_answer(rng, ranks, rng.random() < 0.3, drop)
        general = parse_metrics(body.decode(), "vllm")
        carry_slow(general, base)
        fast = parse_fast_vllm(body, base)
        if ranks > 1:
            assert fast is None  # several label sets: summed/averaged by the general path
            continue
        assert fast == general
        used += 1
    assert used > 0
    # other families in the answer (the filter ignored, or another engine): declined
    assert parse_fast_vllm(full.encode(), base) is None
    assert parse_fast_vllm(b"# nothing here\n", base) is None
