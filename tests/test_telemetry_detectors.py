"""Detector rules over replayed windows of samples (pure: no I/O, no clock)."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from services.common.schemas import GpuSample
from services.telemetry.detectors import (
    AlertBook,
    DetectorSet,
    Finding,
    GpuMemory,
    KvCapacityConfig,
    KvStarved,
    NoKvEvents,
    Observation,
    Overload,
    StaleTelemetry,
    XidErrors,
    build_rules,
)

T0 = 1_000_000.0


def window(seconds: float, hz: float = 10.0, **fields) -> list[Observation]:
    n = int(seconds * hz)
    return [Observation(ts=T0 + i / hz, **fields) for i in range(n)]


def end(w: list[Observation]) -> float:
    return w[-1].ts


# ----------------------------------------------------------------- kv_starved (seed 001)


def test_trtllm_seed_001_starved_batch_fires_with_trt_remedy() -> None:
    w = window(
        6,
        source="trtllm",
        running=8,
        scheduled=1,
        max_batch=64,
        kv_usage=0.98,
        kv_capacity_tokens=2560,
        tokens_per_block=64,
    )
    f = KvStarved().check("trt-0", w, end(w))
    assert f is not None
    assert "8 active but only 1 scheduled" in f.summary
    assert "max_tokens_in_paged_kv_cache" in f.remedy
    assert "kv_cache_free_gpu_mem_fraction" in f.remedy
    assert "2560 tokens = 40 blocks x 64" in f.remedy
    # 1 running request holds the whole cache: 8 such requests need 8 x 2560 tokens
    assert f.details["needed_tokens"] == 8 * 2560
    assert f.details["active"] == 8 and f.details["scheduled"] == 1


def test_vllm_starved_uses_running_vs_waiting_and_names_vllm_knobs() -> None:
    w = window(
        6,
        source="vllm",
        running=2,
        waiting=30,
        max_batch=64,
        kv_usage=0.97,
        kv_capacity_tokens=2560,
        typical_prompt_tokens=1000,
        typical_new_tokens=256,
    )
    f = KvStarved().check("w", w, end(w))
    assert f is not None
    assert "32 active but only 2 scheduled" in f.summary
    assert "gpu_memory_utilization" in f.remedy and "max_num_seqs to 2" in f.remedy
    assert f.details["needed_tokens"] == 32 * 1256


@pytest.mark.parametrize(
    "change",
    [
        {"kv_usage": 0.5},  # cache has room: not starved by KV
        {"running": 60, "waiting": 30},  # batch nearly full: the batch limit holds it back
        {"waiting": 1},  # nothing piles up
        {"kv_usage": None},  # unknown usage never satisfies a threshold
    ],
)
def test_starved_does_not_fire_when_a_condition_is_missing(change: dict) -> None:
    base = dict(source="vllm", running=2, waiting=30, max_batch=64, kv_usage=0.97)
    w = window(6, **{**base, **change})
    assert KvStarved().check("w", w, end(w)) is None


def test_starved_needs_a_sustained_window() -> None:
    starving = dict(source="trtllm", running=8, scheduled=1, max_batch=64, kv_usage=0.98)
    short = window(2, **starving)
    assert KvStarved(window_s=5).check("w", short, end(short)) is None  # not enough history
    healthy = window(6, source="trtllm", running=8, scheduled=8, max_batch=64, kv_usage=0.98)
    # a brief blip (3 of 50 samples) inside a healthy window does not fire
    mixed = healthy[:-3] + [replace(o, scheduled=1) for o in healthy[-3:]]
    assert KvStarved().check("w", mixed, end(mixed)) is None
    # stale samples carry no values and are ignored, not counted as healthy
    stale = window(6, stale=True)
    starving_w = window(6, **starving)
    both = sorted(stale + starving_w, key=lambda o: o.ts)
    assert KvStarved().check("w", both, end(both)) is not None


# ----------------------------------------------------------------- kv_capacity_config (seed 003)


def test_capacity_config_below_batch_gives_minimum_that_fits() -> None:
    w = window(
        1,
        source="vllm",
        kv_capacity_tokens=2560,
        tokens_per_block=16,
        max_batch=64,
        typical_prompt_tokens=1000.0,
        typical_new_tokens=256.0,
    )
    f = KvCapacityConfig().check("w", w, end(w))
    assert f is not None
    need = 64 * (1000 + 256)
    assert f.details["required_tokens"] == need
    assert f.details["minimum_tokens"] == -(-need // 16) * 16
    assert f.details["batch_that_fits"] == 2560 // 1256
    assert str(f.details["minimum_tokens"]) in f.remedy and "max_num_seqs to 2" in f.remedy


def test_capacity_config_ktransformers_example_holds() -> None:
    """Seed 003's example: batch 4 x 16224 new tokens needs > 64896; 129792 is fine."""
    ok = window(
        1,
        source="trtllm",
        kv_capacity_tokens=129_792,
        max_batch=4,
        typical_prompt_tokens=0.0,
        typical_new_tokens=16_224.0,
    )
    assert KvCapacityConfig().check("w", ok, end(ok)) is None
    low = [replace(o, kv_capacity_tokens=60_000) for o in ok]
    f = KvCapacityConfig().check("w", low, end(low))
    assert f is not None and f.details["required_tokens"] == 64_896
    assert "max_tokens_in_paged_kv_cache" in f.remedy and "max_batch_size to 3" in f.remedy


def test_capacity_config_needs_all_inputs() -> None:
    w = window(1, kv_capacity_tokens=100, max_batch=64, typical_prompt_tokens=1000.0)
    assert KvCapacityConfig().check("w", w, end(w)) is None  # max new tokens unknown


# ----------------------------------------------------------------- overload, gpu, stale, xid


def test_overload_on_growing_queue_with_full_kv() -> None:
    w = [
        Observation(ts=T0 + i / 10, running=64, waiting=i, max_batch=64, kv_usage=0.99)
        for i in range(110)
    ]
    f = Overload().check("w", w, end(w))
    assert f is not None and f.details["waiting_to"] == 109
    flat = [replace(o, waiting=50) for o in w]
    assert Overload().check("w", flat, end(flat)) is None
    roomy = [replace(o, kv_usage=0.3, running=10) for o in w]
    assert Overload().check("w", roomy, end(roomy)) is None


def test_gpu_memory_near_saturation() -> None:
    full = GpuSample(index=1, mem_used_bytes=79 * 2**30, mem_total_bytes=80 * 2**30)
    fine = GpuSample(index=0, mem_used_bytes=40 * 2**30, mem_total_bytes=80 * 2**30)
    w = window(4, gpus=(fine, full))
    f = GpuMemory(threshold=0.97).check("w", w, end(w))
    assert f is not None and f.details["gpus"] == [1]
    assert GpuMemory(threshold=0.995).check("w", w, end(w)) is None


def test_stale_telemetry_after_threshold() -> None:
    fresh = window(1, running=1)
    stale = [
        Observation(ts=end(fresh) + 0.1 * (i + 1), stale=True, error="cannot connect")
        for i in range(30)
    ]
    w = fresh + stale
    assert (
        StaleTelemetry(after_s=2.0).check("w", w[: len(fresh) + 10], w[len(fresh) + 9].ts) is None
    )
    f = StaleTelemetry(after_s=2.0).check("w", w, end(w))
    assert f is not None and "cannot connect" in f.summary
    assert StaleTelemetry().check("w", fresh, end(fresh)) is None


def test_xid_fires_on_new_errors_and_holds() -> None:
    rule = XidErrors(hold_s=10)
    g0 = GpuSample(index=0, xid_errors=0)
    assert rule.check("w", [Observation(ts=T0, gpus=(g0,))], T0) is None
    g1 = GpuSample(index=0, xid_errors=1, last_xid=79)
    f = rule.check("w", [Observation(ts=T0 + 1, gpus=(g1,))], T0 + 1)
    assert f is not None and "last XID 79" in f.summary
    assert rule.check("w", [Observation(ts=T0 + 5, gpus=(g1,))], T0 + 5) is not None
    assert rule.check("w", [Observation(ts=T0 + 12, gpus=(g1,))], T0 + 12) is None
    # uncorrected ECC: the first count is a baseline, a rise is critical
    e = XidErrors(hold_s=10)
    base = GpuSample(index=2, ecc_errors=3)
    assert e.check("w", [Observation(ts=T0, gpus=(base,))], T0) is None
    rose = GpuSample(index=2, ecc_errors=4)
    f = e.check("w", [Observation(ts=T0 + 1, gpus=(rose,))], T0 + 1)
    assert f is not None and "uncorrected ECC errors rose to 4" in f.summary


def test_no_kv_events_when_serving_with_prefix_caching() -> None:
    w = [
        Observation(
            ts=T0 + i / 10,
            running=3,
            prefix_caching=True,
            prefix_cache_queries=100.0 * i,
            kv_events=0,
        )
        for i in range(310)
    ]
    f = NoKvEvents().check("w", w, end(w))
    assert f is not None and "--kv-events-config" in f.remedy
    events = [replace(o, kv_events=i) for i, o in enumerate(w)]
    assert NoKvEvents().check("w", events, end(events)) is None
    off = [replace(o, prefix_caching=False) for o in w]
    assert NoKvEvents().check("w", off, end(off)) is None
    idle = [replace(o, running=0, prefix_cache_queries=5.0) for o in w]
    assert NoKvEvents().check("w", idle, end(idle)) is None


# ----------------------------------------------------------------- alert book, config


def test_alert_book_deduplicates_and_resolves_after_clear_time() -> None:
    book = AlertBook(clear_s=5)
    f = Finding(summary="s", remedy="r", details={"x": 1})
    a = book.update("w", "kv_starved", "warning", f, T0)
    assert a is not None and a.state == "firing" and a.fingerprint == "kv_starved:w"
    assert a.source == "telemetry" and a.remedy == "r" and a.worker_id == "w"
    assert book.update("w", "kv_starved", "warning", f, T0 + 1) is None  # held: no repeat
    assert book.update("w", "kv_starved", "warning", None, T0 + 3) is None  # not clear long enough
    r = book.update("w", "kv_starved", "warning", None, T0 + 6.5)
    assert r is not None and r.state == "resolved" and r.fingerprint == "kv_starved:w"
    assert book.update("w", "kv_starved", "warning", None, T0 + 7) is None
    assert book.update("w", "kv_starved", "warning", f, T0 + 8).state == "firing"
    gone = book.forget("w", T0 + 9)
    assert [x.state for x in gone] == ["resolved"] and not book.firing


def test_detector_set_runs_every_rule() -> None:
    ds = DetectorSet(build_rules({"no_kv_events": {"enabled": False}}), clear_s=1)
    assert "no_kv_events" not in {r.kind for r in ds.rules}
    w = window(
        6,
        source="trtllm",
        running=8,
        scheduled=1,
        max_batch=64,
        kv_usage=0.98,
        kv_capacity_tokens=2560,
        tokens_per_block=64,
        typical_prompt_tokens=1000.0,
        typical_new_tokens=500.0,
    )
    kinds = {a.kind for a in ds.evaluate("w", w, end(w))}
    assert kinds == {"kv_starved", "kv_capacity_config"}
    assert ds.evaluate("w", w, end(w) + 0.1) == []


def test_build_rules_rejects_unknown_names_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown detector"):
        build_rules({"nope": {}})
    with pytest.raises(ValueError, match="unknown setting"):
        build_rules({"kv_starved": {"windw_s": 3}})
    [starved] = [r for r in build_rules({"kv_starved": {"window_s": 3}}) if r.kind == "kv_starved"]
    assert starved.window_s == 3


def test_no_kv_events_quiet_for_a_worker_whose_requests_all_hit_its_cache() -> None:
    # busy, prefix caching on, 100 prompt tokens looked up per sample and every one found
    # cached: the worker stores no new blocks, so no events is right, not a fault
    w = [
        Observation(
            ts=T0 + i / 10,
            running=3,
            prefix_caching=True,
            prefix_cache_queries=100.0 * i,
            prefix_cache_hits=100.0 * i,
            tokens_per_block=16,
            kv_events=0,
        )
        for i in range(310)
    ]
    assert NoKvEvents().check("w", w, end(w)) is None
    # the same worker missing its cache on a tenth of those tokens computes new blocks
    missing = [replace(o, prefix_cache_hits=90.0 * i) for i, o in enumerate(w)]
    f = NoKvEvents().check("w", missing, end(missing))
    assert f is not None and "new blocks" in f.summary
    # a handful of uncached tokens (less than min_new_blocks blocks) is not evidence
    few = [replace(o, prefix_cache_hits=100.0 * i - min(i, 40)) for i, o in enumerate(w)]
    assert NoKvEvents().check("w", few, end(few)) is None
