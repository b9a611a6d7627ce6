"""The simulated engine core, driven directly on a virtual clock (no I/O)."""

from __future__ import annotations

import pytest

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored
from services.core.engine import AdmissionError, Engine, EngineConfig, SimRequest
from services.core.keys import block_keys, block_seed, blocks_needed

BS = 16


def prompt(tag: int, n: int) -> list[int]:
    return [(tag * 131 + i * 7) % 251 + 1 for i in range(n)]


def run(engine: Engine, now: float = 0.0, max_steps: int = 100_000):
    """Step until idle; returns (now, outputs)."""
    outs = []
    for _ in range(max_steps):
        out = engine.step(now)
        if out is None:
            return now, outs
        outs.append(out)
        now += out.duration_s
    raise AssertionError("engine did not go idle")


def finished_of(outs):
    return {f.request_id: f for o in outs for f in o.finished}


def events_of(outs):
    return [e for o in outs for e in o.kv_events]


def small(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048)
    base.update(kw)
    return EngineConfig(**base)


def test_prefix_reuse_reports_cached_tokens_and_counts_like_vllm():
    e = Engine(small())
    p = prompt(1, 70)  # 4 full blocks + 6 tokens
    e.add_request(SimRequest("a", p, 4))
    now, outs = run(e)
    assert finished_of(outs)["a"].cached_tokens == 0
    e.add_request(SimRequest("b", p + [9, 9, 9], 4), now)
    now, outs2 = run(e, now)
    fin = finished_of(outs2)["b"]
    assert fin.cached_tokens == 64 and fin.prompt_tokens == 73 and fin.completion_tokens == 4
    assert e.prefix_cache_queries == 70 + 73
    assert e.prefix_cache_hits == 64
    # a prompt that is exactly cached still computes its last token (like vLLM)
    e.add_request(SimRequest("c", p[:64], 2), now)
    _, outs3 = run(e, now)
    assert finished_of(outs3)["c"].cached_tokens == 48


def test_stored_events_carry_canonical_chained_keys_for_prompt_and_generated_blocks():
    cfg = small(hash_seed=7)
    e = Engine(cfg)
    p = prompt(2, 40)
    e.add_request(SimRequest("a", p, 30, lora="ad1"))
    toks: list[int] = []
    _, outs = run(e)
    for o in outs:
        toks.extend(o.tokens.get("a", []))
    assert len(toks) == 30
    stored = [ev for ev in events_of(outs) if isinstance(ev, BlockStored)]
    keys = [k for ev in stored for k in ev.keys]
    # KV exists for the prompt and all generated tokens but the last: 69 tokens -> 4 blocks
    expect = block_keys(p + toks[:-1], BS, block_seed(7, "ad1"))
    assert keys == expect and len(keys) == 4
    assert stored[0].parent_key is None
    for prev, ev in zip(stored, stored[1:], strict=False):
        assert ev.parent_key == prev.keys[-1]
    # the same prompt without the LoRA shares nothing
    assert block_keys(p, BS, block_seed(7))[0] != expect[0]


def test_lru_evicts_least_recently_used_leaves_first_only_when_needed():
    # 12 blocks; each request needs ceil((48 + 16) / 16) = 4 blocks and leaves 3 keyed blocks
    # (KV exists for 48 + 15 tokens; the partial 4th block goes back as an empty block)
    e = Engine(small(num_gpu_blocks=12))
    now = 0.0
    keys = {}
    for tag in ("A", "B", "C"):
        p = prompt(ord(tag), 48)
        keys[tag] = block_keys(p, BS, 0)
        e.add_request(SimRequest(tag, p, 16), now)
        now, outs = run(e, now)
        assert not any(isinstance(ev, BlockRemoved) for ev in events_of(outs))
    assert e.num_cached_blocks == 9 and e.num_free_blocks == 12 and e.kv_usage == 0.0
    # touch A again so B becomes the least recently used
    e.add_request(SimRequest("A2", prompt(ord("A"), 48) + [1], 1), now)
    now, outs = run(e, now)
    assert finished_of(outs)["A2"].cached_tokens == 48
    # D needs 6 blocks: the 3 empty ones, then B's three are evicted, leaf first
    e.add_request(SimRequest("D", prompt(ord("D"), 80), 16), now)
    now, outs = run(e, now)
    removed = [k for ev in events_of(outs) if isinstance(ev, BlockRemoved) for k in ev.keys]
    assert removed == list(reversed(keys["B"]))
    assert set(removed).isdisjoint(keys["A"] + keys["C"])
    # A and C still hit, B does not
    for tag, hit in (("A", 48), ("C", 48), ("B", 0)):
        rid = tag + "-again"
        e.add_request(SimRequest(rid, prompt(ord(tag), 48) + [2], 1), now)
        now, outs = run(e, now)
        assert finished_of(outs)[rid].cached_tokens == hit, tag


def test_seed_001_long_requests_run_one_at_a_time():
    """KV capacity 2560 tokens, batch limit 64: 8 requests of 1024 + 1024 tokens each need 128
    of the 160 blocks, so one runs and seven wait, for the whole run."""
    cfg = EngineConfig(num_gpu_blocks=2560 // BS, max_num_seqs=64, max_model_len=4096)
    e = Engine(cfg)
    for i in range(8):
        e.add_request(SimRequest(f"r{i}", prompt(100 + i, 1024), 1024))
    out = e.step(0.0)
    assert (e.num_running, e.num_waiting) == (1, 7)
    assert blocks_needed(1024, 1024, BS) * 2 > cfg.num_gpu_blocks
    now = out.duration_s
    max_running = 1
    order = []
    while e.has_work:
        out = e.step(now)
        now += out.duration_s
        max_running = max(max_running, e.num_running)
        order += [f.request_id for f in out.finished]
    assert max_running == 1
    assert order == [f"r{i}" for i in range(8)]  # FCFS


def test_capacity_admission_waits_for_blocks_and_batch_slots():
    e = Engine(small(num_gpu_blocks=64, max_num_seqs=4))
    for i in range(10):
        e.add_request(SimRequest(f"s{i}", prompt(i, 20), 8))  # 2 blocks each
    e.step(0.0)
    assert (e.num_running, e.num_waiting) == (4, 6)
    e2 = Engine(small(num_gpu_blocks=10, max_num_seqs=64))
    for i in range(10):
        e2.add_request(SimRequest(f"s{i}", prompt(i, 40), 8))  # 3 blocks each
    e2.step(0.0)
    assert (e2.num_running, e2.num_waiting) == (3, 7)
    assert e2.num_free_blocks == 1
    assert e2.kv_usage == pytest.approx(0.9)


def test_requests_that_can_never_fit_are_refused():
    e = Engine(small(num_gpu_blocks=8, max_model_len=512))
    with pytest.raises(AdmissionError, match="maximum context length is 512"):
        e.add_request(SimRequest("x", prompt(1, 500), 100))
    with pytest.raises(AdmissionError, match="KV blocks"):
        e.add_request(SimRequest("y", prompt(1, 120), 20))  # 9 blocks > 8
    with pytest.raises(AdmissionError):
        e.add_request(SimRequest("z", prompt(1, 10), 0))
    e.add_request(SimRequest("ok", prompt(1, 100), 28))  # 8 blocks exactly
    with pytest.raises(AdmissionError, match="duplicate"):
        e.add_request(SimRequest("ok", prompt(1, 10), 1))
    assert not any(isinstance(ev, BlockRemoved) for ev in events_of(run(e)[1]))


def test_chunked_prefill_and_step_time_model():
    cfg = small(max_num_batched_tokens=256, num_gpu_blocks=256)
    e = Engine(cfg)
    p = prompt(5, 700)
    e.add_request(SimRequest("long", p, 3))
    outs = []
    now = 0.0
    while e.has_work:
        o = e.step(now)
        outs.append(o)
        now += o.duration_s
    first = next(i for i, o in enumerate(outs) if "long" in o.tokens)
    assert first == 2  # 256 + 256 + 188 prompt tokens
    assert [o.num_prefill_tokens for o in outs[:3]] == [256, 256, 188]
    # each step's duration is the model's formula
    o = outs[0]
    expect = cfg.step_overhead_s + cfg.prefill_token_s * 256 + cfg.prefill_attn_s * (256 * 257 // 2)
    assert o.duration_s == pytest.approx(expect)
    d = outs[-1]
    assert d.num_decode_seqs == 1 and d.kv_tokens_read == 702
    assert d.duration_s == pytest.approx(
        cfg.step_overhead_s + cfg.decode_seq_s + cfg.decode_kv_token_s * 702
    )
    # a cached prompt reaches its first token sooner
    fin = finished_of(outs)["long"]
    e.add_request(SimRequest("again", p, 3), now)
    _, outs2 = run(e, now)
    fin2 = finished_of(outs2)["again"]
    assert fin2.cached_tokens == 688
    assert fin2.first_token_time - fin2.arrival_time < 0.5 * (
        fin.first_token_time - fin.arrival_time
    )


def test_deterministic_given_seed():
    def trace(seed: int):
        e = Engine(small(seed=seed, num_gpu_blocks=20))
        for i in range(6):
            e.add_request(SimRequest(f"q{i}", prompt(i % 3, 50 + i), 10 + i))
        _, outs = run(e)
        return [
            (o.duration_s, o.tokens, o.kv_events, [f.request_id for f in o.finished]) for o in outs
        ]

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_dump_cache_matches_the_event_stream_and_orders_parents_first():
    e = Engine(small(num_gpu_blocks=16))
    now = 0.0
    held: set[int] = set()
    for i in range(6):
        e.add_request(SimRequest(f"d{i}", prompt(i % 4, 40 + 3 * i), 12), now)
        now, outs = run(e, now)
        for ev in events_of(outs):
            if isinstance(ev, BlockStored):
                held.update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(ev.keys)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
    dump = e.dump_cache()
    seen: set[int] = set()
    for ev in dump:
        if ev.parent_key is not None and ev.parent_key in held:
            assert ev.parent_key in seen
        seen.update(ev.keys)
    assert seen == held and len(held) == e.num_cached_blocks
    cleared = e.reset_prefix_cache()
    assert isinstance(cleared[0], AllBlocksCleared) and e.dump_cache() == []


def test_abort_frees_blocks_and_reports_abort():
    e = Engine(small(num_gpu_blocks=32))
    e.add_request(SimRequest("x", prompt(3, 100), 50))
    e.add_request(SimRequest("y", prompt(4, 100), 50))
    e.step(0.0)
    assert e.num_free_blocks < 32
    assert e.abort("x") and e.abort("y") and not e.abort("nope")
    out = e.step(1.0)
    assert {f.request_id: f.finish_reason for f in out.finished} == {"x": "abort", "y": "abort"}
    assert e.num_running == 0 and e.kv_usage == 0.0 and not e.has_work


def test_vllm_admission_allocates_on_demand_and_preempts_like_vllm():
    """admission="vllm": seed 001's eight long requests run two at a time, decode blocks are
    allocated as tokens are generated, and a pool that runs out preempts the most recently
    admitted request, which is recomputed later and still yields the same tokens."""
    cfg = EngineConfig(
        num_gpu_blocks=2560 // BS, max_num_seqs=64, max_model_len=4096, admission="vllm"
    )
    e = Engine(cfg)
    for i in range(8):
        e.add_request(SimRequest(f"r{i}", prompt(100 + i, 1024), 1024))
    out = e.step(0.0)
    assert (e.num_running, e.num_waiting) == (2, 6)
    assert e.num_free_blocks == 160 - 2 * 64  # prompts only, no reservation for decode
    now = out.duration_s
    tokens: dict[str, list[int]] = {rid: list(t) for rid, t in out.tokens.items()}
    held: set[int] = {k for ev in out.kv_events if isinstance(ev, BlockStored) for k in ev.keys}
    finished = {}
    max_running = 2
    while e.has_work:
        out = e.step(now)
        now += out.duration_s
        max_running = max(max_running, e.num_running)
        assert 0.0 <= e.kv_usage <= 1.0
        for rid, toks in out.tokens.items():
            tokens.setdefault(rid, []).extend(toks)
        for ev in out.kv_events:
            if isinstance(ev, BlockStored):
                held.update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(ev.keys)
        finished.update({f.request_id: f for f in out.finished})
    assert e.num_preemptions > 0 and max_running == 2
    assert all(
        f.completion_tokens == 1024 and f.finish_reason == "length" for f in finished.values()
    )
    assert all(len(t) == 1024 for t in tokens.values())
    assert {k for ev in e.dump_cache() for k in ev.keys} == held
    assert e.prefix_cache_queries == 8 * 1024  # counted once per request
    # the same requests without pressure generate the same tokens (position-determined)
    roomy = Engine(EngineConfig(num_gpu_blocks=4096, max_model_len=4096, admission="vllm"))
    roomy.add_request(SimRequest("r7", prompt(107, 1024), 1024))
    _, outs = run(roomy)
    assert [t for o in outs for t in o.tokens.get("r7", [])] == tokens["r7"]
    assert roomy.num_preemptions == 0


def test_vllm_admission_kv_usage_grows_with_decode():
    e = Engine(small(num_gpu_blocks=64, admission="vllm"))
    e.add_request(SimRequest("g", prompt(9, 100), 200))
    e.step(0.0)
    assert 64 - e.num_free_blocks == 7  # ceil(100 / 16): prompt blocks only
    _, outs = run(e, 1.0)
    used_max = 0
    e.add_request(SimRequest("g2", prompt(10, 100), 200))
    now = 2.0
    while e.has_work:
        o = e.step(now)
        now += o.duration_s
        used_max = max(used_max, 64 - e.num_free_blocks)
    assert used_max == blocks_needed(100, 199, BS)  # the last token's KV is never computed


def test_admission_mode_is_validated():
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission="greedy")
