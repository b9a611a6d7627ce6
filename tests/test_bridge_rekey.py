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
    assert rk.stored([1], None, TOKENS[:24], 24) is None  # not a multiple of 16
    assert rk.counts["block_size_mismatch"] == 1
    assert rk.stored([1], None, [2**40] * 16, 16) is None
    assert rk.counts["invalid_schema"] == 1
    ok = rk.stored([1, 2], None, TOKENS[:32], 16)
    assert ok is not None and ok.keys == keys[:2]
    assert rk.removed([2, 77], None) == [BlockRemoved(keys=[keys[1]], tier="gpu")]
    assert rk.counts["unknown_block"] == 1
    assert isinstance(rk.cleared(), AllBlocksCleared) and not rk.held and not rk.refs
    # a LoRA adapter keys its own space
    lo = rk.stored([5], None, TOKENS[:16], 16, lora="ad1")
    assert lo is not None and lo.keys == block_keys(TOKENS[:16], 16, block_seed(0, "ad1"))


def test_bad_vllm_payloads_are_classified() -> None:
    dec = VllmDecoder()
    with pytest.raises(EngineFormatError) as e1:
        dec.decode(b"\xc1\x00")
    assert e1.value.reason == "malformed_msgpack"
    with pytest.raises(EngineFormatError) as e0:
        dec.decode(msgpack.packb("not a batch"))
    assert e0.value.reason == "invalid_schema"
    # bad events are reported one by one; the good ones of the same batch are kept
    good = stored_ev("map", [1], None, TOKENS[:16])
    batch = dec.decode(
        msgpack.packb(
            [0.0, [stored_ev("map", [1.5], None, TOKENS[:16]), {"type": "Nope"}, good, 7], 0]
        )
    )
    assert [r for r, _ in batch.bad] == ["wrong_hash_type", "unknown_event_type", "invalid_schema"]
    assert len(batch.events) == 1 and batch.events[0].block_hashes == [1]
    assert medium_tier(None) == "gpu" and medium_tier("CPU_PINNED") == "cpu"
    assert medium_tier("DISK") == "disk" and medium_tier("STORAGE") == "disk"
    assert medium_tier("EXTERNAL") is None and medium_tier("GPU", "REMOTE") is None


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


# ---------------------------------------------------------------- keys the engine would reuse


def vllm_stored(hashes, parent, tokens, bs=16, **fields) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **fields,
    }


def run(rk: Rekeyer, events: list) -> list:
    batch = VllmDecoder().decode(msgpack.packb([0.0, events, 0], use_bin_type=True))
    for reason, detail in batch.bad:
        rk.bad(reason, detail)
    return rk.vllm_events(batch.events)


def held_keys(rk: Rekeyer, tier: str = "gpu") -> set[int]:
    return {k for ev in rk.dump()[1:] if ev.tier == tier for k in ev.keys}


def test_cache_salt_keys_a_disjoint_space_like_the_router() -> None:
    """A salted prompt must not match unsalted blocks (nor another salt's): the bridge
    starts the chain at block_seed(seed, lora, salt), exactly as the router keys a request's
    ``cache_salt``."""
    plain = block_keys(TOKENS[:32], 16, block_seed(3))
    salted = block_keys(TOKENS[:32], 16, block_seed(3, salt="tenant-a"))
    lora_salted = block_keys(TOKENS[:32], 16, block_seed(3, "ad1", "tenant-a"))
    # SGLang: cache_salt field
    rk = Rekeyer(hash_seed=3, block_size=16)
    out = run(rk, [vllm_stored([1, 2], None, TOKENS[:32], cache_salt="tenant-a")])
    assert out[0].keys == salted
    # vLLM: the salt is the first block's extra_keys string (after the LoRA name)
    rk = Rekeyer(hash_seed=3, block_size=16)
    out = run(rk, [vllm_stored([1, 2], None, TOKENS[:32], extra_keys=[["tenant-a"], None])])
    assert out[0].keys == salted and out[0].keys != plain
    rk = Rekeyer(hash_seed=3, block_size=16)
    ev = vllm_stored(
        [1, 2], None, TOKENS[:32], lora_name="ad1", extra_keys=[["ad1", "tenant-a"], ["ad1"]]
    )
    assert run(rk, [ev])[0].keys == lora_salted
    # the continuation of a salted chain stays in the salted space through its parent
    out = run(rk, [vllm_stored([3], 2, TOKENS[32:48], lora_name="ad1", extra_keys=[["ad1"]])])
    assert out[0].keys == block_keys(TOKENS[:48], 16, block_seed(3, "ad1", "tenant-a"))[2:]


def test_multimodal_extra_keys_never_match_text_blocks() -> None:
    text = block_keys(TOKENS[:32], 16)
    a, b = Rekeyer(block_size=16), Rekeyer(block_size=16)
    img = [[["mmhash-cat", 0]], [["mmhash-cat", -16]]]
    ka = run(a, [vllm_stored([1, 2], None, TOKENS[:32], extra_keys=img)])[0].keys
    kb = run(b, [vllm_stored([7, 8], None, TOKENS[:32], extra_keys=img)])[0].keys
    assert ka == kb  # same image, same placeholder tokens: the engine reuses the cache
    assert not set(ka) & set(text)
    other = [[["mmhash-dog", 0]], [["mmhash-dog", -16]]]
    kc = run(Rekeyer(block_size=16), [vllm_stored([1, 2], None, TOKENS[:32], extra_keys=other)])
    assert not set(kc[0].keys) & set(ka)
    # an image only in the second block: the first block is plain text and matches
    mixed = run(
        Rekeyer(block_size=16),
        [vllm_stored([1, 2], None, TOKENS[:32], extra_keys=[None, [["mmhash-cat", 3]]])],
    )
    assert mixed[0].keys[0] == text[0] and mixed[0].keys[1] != text[1]


def test_hybrid_groups_sliding_window_eviction_keeps_full_attention_blocks() -> None:
    keys = block_keys(TOKENS[:48], 16)
    rk = Rekeyer(block_size=16)
    out = run(
        rk,
        [
            vllm_stored([1, 2, 3], None, TOKENS[:48], group_idx=0),
            vllm_stored([1, 2, 3], None, TOKENS[:48], group_idx=1),
        ],
    )
    assert [e.keys for e in out] == [keys]  # the second group adds no new canonical block
    # the sliding-window group frees the blocks outside its window
    assert (
        run(rk, [{"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "group_idx": 1}])
        == []
    )
    assert held_keys(rk) == set(keys)
    out = run(
        rk, [{"type": "BlockRemoved", "block_hashes": [1, 2, 3], "medium": "GPU", "group_idx": 0}]
    )
    assert out == [BlockRemoved(keys=keys[:2], tier="gpu")] and held_keys(rk) == {keys[2]}
    # with kinds published (vLLM 0.33), a sliding-window / mamba group is not indexed at all
    rk = Rekeyer(block_size=16)
    run(
        rk,
        [
            vllm_stored(
                [1, 2], None, TOKENS[:32], group_idx=0, kv_cache_spec_kind="full_attention"
            ),
            vllm_stored(
                [1, 2], None, TOKENS[:32], group_idx=1, kv_cache_spec_kind="sliding_window"
            ),
            vllm_stored([9], None, TOKENS[:64], 64, group_idx=2, kv_cache_spec_kind="mamba"),
        ],
    )
    assert held_keys(rk) == set(keys[:2]) and rk.skipped["non_prefix_group"] == 2
    assert rk.counts == {}


def test_block_sizes_that_are_multiples_are_split_not_dropped() -> None:
    keys = block_keys(TOKENS, 16)
    rk = Rekeyer(block_size=16)
    out = run(
        rk,
        [
            vllm_stored([1], None, TOKENS[:16]),
            vllm_stored(
                [2, 3], 1, TOKENS[16:80], 32, group_idx=1
            ),  # another group, 32-token blocks
            vllm_stored([4], 3, TOKENS[80:88], 8),  # a partial block: cannot be keyed at 16
        ],
    )
    assert [e.keys for e in out] == [keys[:1], keys[1:5]] and out[1].parent_key == keys[0]
    assert rk.counts == {"block_size_mismatch": 1}
    out = run(rk, [{"type": "BlockRemoved", "block_hashes": [3], "group_idx": 1, "medium": "GPU"}])
    assert out == [BlockRemoved(keys=keys[3:5], tier="gpu")]


def test_remote_blocks_are_not_this_workers_cache() -> None:
    rk = Rekeyer(block_size=16)
    out = run(
        rk,
        [
            vllm_stored([1], None, TOKENS[:16], locality="REMOTE"),
            vllm_stored([2], None, TOKENS[16:32], medium="EXTERNAL"),
            vllm_stored([3], None, TOKENS[32:48], locality="LOCAL"),
        ],
    )
    assert [e.keys for e in out] == [block_keys(TOKENS[32:48], 16)]
    assert rk.skipped["remote_medium"] == 2 and rk.counts == {}


def test_unknown_event_types_and_bigram_pages_cost_only_themselves() -> None:
    keys = block_keys(TOKENS[:32], 16)
    pairs = [[t, t + 1] for t in TOKENS[:16]]  # SGLang EAGLE bigram page
    rk = Rekeyer(block_size=16)
    out = run(
        rk,
        [
            {
                "type": "BlockStored",
                "block_hashes": [9],
                "parent_block_hash": None,
                "token_ids": pairs,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
            },
            {"type": "KvCacheMetrics", "usage": 0.5},
            vllm_stored([1, 2], None, TOKENS[:32]),
            ["SomeFutureEvent", 1, 2],
        ],
    )
    assert [e.keys for e in out] == [keys]
    assert rk.counts == {"bigram_page": 1, "unknown_event_type": 2}


def test_trtllm_window_sizes_are_groups() -> None:
    """Variable sliding-window attention: the small window's eviction leaves the blocks the
    full window still holds."""
    import json

    keys = block_keys(TOKENS[:32], 16)

    def stored(eid: int, window: int) -> dict:
        blocks = [_trt_block(100 + i, TOKENS[16 * i : 16 * i + 16]) for i in range(2)]
        data = {"type": "stored", "parent_hash": None, "blocks": blocks}
        return {"event_id": eid, "data": data, "window_size": window}

    events = [
        stored(0, 4096),
        stored(1, 512),
        {
            "event_id": 2,
            "data": {"type": "removed", "block_hashes": [100, 101]},
            "window_size": 512,
        },
    ]
    parsed, bad = decode_trtllm(json.dumps(events).encode())
    rk = Rekeyer()
    out = rk.trtllm_events(parsed)
    assert bad == [] and out == [BlockStored(keys=keys, parent_key=None, block_size=16, tier="gpu")]
    assert {k for ev in rk.dump()[1:] for k in ev.keys} == set(keys)
    rm = rk.trtllm_events(
        decode_trtllm(
            json.dumps(
                [
                    {
                        "event_id": 3,
                        "data": {"type": "removed", "block_hashes": [100, 101]},
                        "window_size": 4096,
                    }
                ]
            ).encode()
        )[0]
    )
    assert rm == [BlockRemoved(keys=keys, tier="gpu")] and rk.counts == {}


async def test_router_keys_a_salted_lora_request_like_the_bridge_keys_its_blocks() -> None:
    """The request a client sends (OpenAI body with vLLM's ``cache_salt``, a LoRA model) and
    the blocks the engine reports for it (vLLM extra_keys) land on the same keys; the same
    prompt without the salt does not."""
    from services.common.tokenizer import ByteTokenizer
    from services.router.tokenize import RequestParser

    parser = RequestParser(ByteTokenizer(), hash_seed=5, is_lora=lambda m: m == "sql-lora")
    body = {"model": "sql-lora", "prompt": "z" * 64, "cache_salt": "tenant-a"}
    req = await parser.parse(body, chat=False)
    toks = req.token_ids[:64]
    rk = Rekeyer(hash_seed=5, block_size=16)
    extra = [["sql-lora", "tenant-a"], ["sql-lora"], ["sql-lora"], ["sql-lora"]]
    out = run(rk, [vllm_stored([1, 2, 3, 4], None, toks, lora_name="sql-lora", extra_keys=extra)])
    assert RequestParser.keys(req, 16)[:4] == out[0].keys
    plain = await parser.parse({**body, "cache_salt": None}, chat=False)
    assert not set(RequestParser.keys(plain, 16)) & set(out[0].keys)


def test_trtllm_token_extra_ids_key_their_own_space() -> None:
    import json

    def ev(eid: int, h: int, extra: int) -> dict:
        blk = _trt_block(h, TOKENS[:16])
        for t in blk["tokens"][4:8]:
            t["token_extra_id"] = extra
        return {"event_id": eid, "data": {"type": "stored", "parent_hash": None, "blocks": [blk]}}

    text = block_keys(TOKENS[:16], 16)
    outs = []
    for extra in (7, 7, 9):
        rk = Rekeyer()
        outs.append(rk.trtllm_events(decode_trtllm(json.dumps([ev(0, 1, extra)]).encode())[0]))
    assert outs[0][0].keys == outs[1][0].keys  # the same image: the engine reuses it
    assert outs[0][0].keys != text and outs[2][0].keys != outs[0][0].keys


def test_a_block_moving_between_tiers_keeps_its_key_and_chain() -> None:
    keys = block_keys(TOKENS[:48], 16)
    rk = Rekeyer(block_size=16)
    assert rk.stored([1, 2], None, TOKENS[:32], 16).keys == keys[:2]  # GPU
    assert rk.stored([2], 1, TOKENS[16:32], 16, "cpu").keys == [keys[1]]  # offloaded copy
    assert rk.removed([2], "gpu") == [BlockRemoved(keys=[keys[1]], tier="gpu")]
    # the CPU copy still names the chain: a child keys from it
    assert rk.stored([3], 2, TOKENS[32:48], 16).keys == [keys[2]]
    tiers = {ev.tier: set(ev.keys) for ev in rk.dump()[1:]}
    assert tiers == {"gpu": {keys[0], keys[2]}, "cpu": {keys[1]}}
    assert rk.removed([2], None) == [BlockRemoved(keys=[keys[1]], tier="cpu")]
    assert rk.stored([1], None, TOKENS[:16], 16) is None and rk.counts == {}  # duplicate
