"""The engine's P/D hooks (services/core/engine.py): a decode request whose prompt KV arrives
by transfer reserves its blocks at admission, computes no prompt, and stores what it received;
a prefill request's blocks stay held until released. Driven on a virtual clock (no I/O)."""

from __future__ import annotations

from services.common.schemas import BlockStored
from services.core.engine import Engine, EngineConfig, SimRequest
from services.core.keys import block_keys, block_seed

BS = 16


def prompt(n: int) -> list[int]:
    return [(i * 7) % 251 + 1 for i in range(n)]


def cfg(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048)
    base.update(kw)
    return EngineConfig(**base)


def test_decode_side_reserves_blocks_then_stores_received_kv_without_prefill_compute():
    e = Engine(cfg())
    p = prompt(100)  # 6 full blocks + 4 tokens
    e.add_request(SimRequest("d", p, max_tokens=3, kv_from_remote=True))
    out = e.step(0.0)
    assert out is not None and out.kv_transfers == ["d"]
    assert "d" in e.receiving and e.num_running == 0
    # the whole prompt + completion is reserved (reserve admission) while the KV is in flight
    assert e.num_free_blocks == 64 - 7
    assert out.kv_events == [] and out.num_prefill_tokens == 0
    assert e.step(0.0) is None  # nothing to compute until the KV arrives
    assert e.kv_received("d")
    out = e.step(1.0)
    # the received full blocks are stored (the decoder publishes them), keyed canonically
    stored = [k for ev in out.kv_events if isinstance(ev, BlockStored) for k in ev.keys]
    assert stored == block_keys(p, BS, block_seed(0, None, None))
    assert out.num_prefill_tokens == 1  # only the last prompt token's logits
    assert out.tokens["d"]
    while out.finished == []:
        out = e.step(2.0)
    assert out.finished[0].completion_tokens == 3
    assert e.num_free_blocks == 64


def test_failed_transfer_recomputes_the_prompt_locally():
    e = Engine(cfg())
    e.add_request(SimRequest("d", prompt(100), max_tokens=2, kv_from_remote=True))
    e.step(0.0)
    assert e.kv_failed("d") and not e.kv_received("d")
    out = e.step(0.0)
    assert out.num_prefill_tokens == 100


def test_abort_while_receiving_frees_the_reservation():
    e = Engine(cfg())
    e.add_request(SimRequest("d", prompt(100), max_tokens=2, kv_from_remote=True))
    e.step(0.0)
    assert e.abort("d")
    out = e.step(0.0)
    assert [f.finish_reason for f in out.finished] == ["abort"]
    assert e.num_free_blocks == 64 and not e.receiving


def test_prefill_side_holds_blocks_until_released():
    e = Engine(cfg())
    e.add_request(SimRequest("p", prompt(100), max_tokens=1, hold_blocks=True))
    out = e.step(0.0)
    assert [f.request_id for f in out.finished] == ["p"]
    assert e.held["p"] and e.num_free_blocks == 64 - len(e.held["p"])
    assert e.release_held("p") and not e.release_held("p")
    assert e.num_free_blocks == 64
