"""Engine wire formats and re-keying (pure): every documented vLLM / SGLang / TRT-LLM form."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored
from services.core.index import PrefixIndex
from services.core.keys import block_keys, block_seed
from services.kv_indexer.bridges.engine_formats import (
    EngineFormatError,
    VllmDecoder,
    decode_trtllm,
    medium_tier,
)
from services.kv_indexer.bridges.rekey import Rekeyer
from services.kv_indexer.bridges.runtime import parse_vllm_capacity

TOKENS = list(range(1000, 1000 + 16 * 6))


def ehash(i: int, mode: str) -> int | bytes:
    """Engine-style hashes unlike kvgate's keys: unsigned, signed or 32 bytes."""
    raw = hashlib.sha256(f"blk{i}".encode()).digest()
    if mode == "bytes32":
        return raw
    u = int.from_bytes(raw[:8], "big")
    if mode == "int64":
        return u - (1 << 64) if u >= 1 << 63 else u
    return u


def stored_ev(form: str, hashes, parent, tokens, medium="GPU", lora=None):
    if form == "map":
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 16,
            "lora_id": None,
            "medium": medium,
            "lora_name": lora,
            "extra_keys": None,  # newer field: ignored
            "group_idx": 0,
        }
    return ["BlockStored", hashes, parent, tokens, 16, None, medium, lora, None, 0]


def removed_ev(form: str, hashes, medium="GPU"):
    if form == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def cleared_ev(form: str):
    return {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("mode", ["uint64", "int64", "bytes32"])
@pytest.mark.parametrize("batch_form", ["array", "map"])
def test_vllm_forms_rekey_to_canonical_keys(form: str, mode: str, batch_form: str) -> None:
    h = [ehash(i, mode) for i in range(6)]
    events = [
        stored_ev(form, h[:2], None, TOKENS[:32]),
        stored_ev(form, h[2:6], h[1], TOKENS[32:], medium="CPU"),
        removed_ev(form, h[4:], medium="CPU"),
    ]
    body = [1.5, events, 0] if batch_form == "array" else {"ts": 1.5, "events": events}
    payload = msgpack.packb(body, use_bin_type=True)
    batch = VllmDecoder().decode(payload)
    rk = Rekeyer(hash_seed=7)
    out = rk.vllm_events(batch.events)
    keys = block_keys(TOKENS, 16, block_seed(7))
    assert out[0] == BlockStored(keys=keys[:2], parent_key=None, block_size=16, tier="gpu")
    assert out[1] == BlockStored(keys=keys[2:], parent_key=keys[1], block_size=16, tier="cpu")
    assert out[2] == BlockRemoved(keys=keys[4:], tier="cpu")
    assert rk.counts == {}
    idx = PrefixIndex()
    for ev in rk.dump()[1:]:
        idx.apply_stored("w", ev.keys, ev.tier)
    assert idx.find_matches(keys) == {"w": 4}
    assert idx.tier_of("w", keys[3]) == "cpu"


def test_rekeyer_refuses_what_it_cannot_key() -> None:
    rk = Rekeyer(block_size=16)
    keys = block_keys(TOKENS, 16)
    assert rk.stored([1, 2], 999, TOKENS[:32], 16) is None  # parent never seen
    assert rk.counts["unknown_parent"] == 1
    assert rk.stored([1, 2], None, TOKENS[:31], 16) is None  # too few tokens
    assert rk.counts["token_count_mismatch"] == 1
    assert rk.stored([1], None, TOKENS[:32], 32) is None
    assert rk.counts["block_size_mismatch"] == 1
    assert rk.stored([1], None, [2**40] * 16, 16) is None
    assert rk.counts["invalid_schema"] == 1
    ok = rk.stored([1, 2], None, TOKENS[:32], 16)
    assert ok is not None and ok.keys == keys[:2]
    assert rk.removed([2, 77], None) == [BlockRemoved(keys=[keys[1]], tier="gpu")]
    assert rk.counts["unknown_block"] == 1
    assert isinstance(rk.cleared(), AllBlocksCleared) and not rk.key_of
    # a LoRA adapter keys its own space
    lo = rk.stored([5], None, TOKENS[:16], 16, lora="ad1")
    assert lo is not None and lo.keys == block_keys(TOKENS[:16], 16, block_seed(0, "ad1"))


def test_bad_vllm_payloads_are_classified() -> None:
    dec = VllmDecoder()
    with pytest.raises(EngineFormatError) as e1:
        dec.decode(b"\xc1\x00")
    assert e1.value.reason == "malformed_msgpack"
    bad_hash = msgpack.packb([0.0, [stored_ev("map", [1.5], None, TOKENS[:16])], 0])
    with pytest.raises(EngineFormatError) as e2:
        dec.decode(bad_hash)
    assert e2.value.reason == "wrong_hash_type"
    with pytest.raises(EngineFormatError) as e3:
        dec.decode(msgpack.packb([0.0, [{"type": "Nope"}], 0]))
    assert e3.value.reason == "invalid_schema"
    assert medium_tier(None) == "gpu" and medium_tier("CPU_PINNED") == "cpu"
    assert medium_tier("DISK") == "disk"


def _trt_block(h: int, toks: list[int], level: int = 0) -> dict:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
        "cache_level": level,
        "priority": 35,
    }


def test_trtllm_events_rekey() -> None:
    import json

    keys = block_keys(TOKENS, 16)
    events = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [900, 100]}},
        {
            "event_id": 1,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [_trt_block(100 + i, TOKENS[16 * i : 16 * i + 16]) for i in range(4)],
            },
            "window_size": 4096,
        },
        {
            "event_id": 2,
            "data": {
                "type": "updated",
                "block_hash": 103,
                "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                "priority": None,
            },
        },
        {"event_id": 3, "data": {"type": "removed", "block_hashes": [102]}},
        {"event_id": 4, "data": {"type": "stored", "parent_hash": "x", "blocks": []}},
    ]
    parsed, bad = decode_trtllm(json.dumps(events).encode())
    assert [e.event_id for e in parsed] == [0, 1, 2, 3] and bad[0][0] == "wrong_hash_type"
    rk = Rekeyer()
    out = rk.trtllm_events(parsed)
    assert rk.num_gpu_blocks == 900
    assert out[0] == BlockStored(keys=keys[:4], parent_key=None, block_size=16, tier="gpu")
    assert out[1].tier == "cpu" and out[1].keys == [keys[3]]
    assert out[2] == BlockRemoved(keys=[keys[3]], tier="gpu")
    assert out[3] == BlockRemoved(keys=[keys[2]], tier="gpu")
    assert decode_trtllm(b"{not json")[1][0][0] == "malformed_json"


def test_capacity_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",num_gpu_blocks="2048",'
        'num_cpu_blocks="0",enable_prefix_caching="True"} 1.0\n'
    )
    caps = parse_vllm_capacity(text)
    assert caps["block_size"] == 32 and caps["num_gpu_blocks"] == 2048


def test_lora_adapters_from_the_engines_model_list() -> None:
    from services.kv_indexer.bridges.runtime import lora_names

    # vLLM's /v1/models: the base model, then each adapter with the base as its parent
    models = {
        "object": "list",
        "data": [
            {"id": "llama", "root": "/models/llama", "parent": None},
            {"id": "sql-lora", "root": "/loras/sql", "parent": "llama"},
            {"id": "chat-lora", "root": "/loras/chat", "parent": "llama"},
        ],
    }
    assert lora_names(models) == ("chat-lora", "sql-lora")
    for bad in (None, [], {"data": "x"}, {"data": [1, {"parent": "llama"}]}):
        assert lora_names(bad) == ()
