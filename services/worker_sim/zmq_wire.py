"""vLLM's KV-event wire format (ZMQ), produced from the engine's canonical events. Pure.

Live messages on the PUB socket are three frames ``[topic, seq, payload]``: ``seq`` is an
8-byte big-endian counter starting at 0; ``payload`` is msgpack of the batch
``[ts, events, dp_rank]`` (vLLM's ``EventBatch`` is array-like; optionally the map form
``{"ts", "events", "data_parallel_rank"}`` of vLLM's newest source). Events are, by default, maps
with a ``"type"`` key (vLLM >= 0.24, SGLang >= 0.5.20):

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

or, in the older array form, the same fields in that order with the tag first:
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``.

Block hashes are *engine* hashes, deliberately unlike kvgate's canonical keys (a bridge must
re-derive keys from ``token_ids``): unsigned 64-bit ints (vLLM, default), signed int64
(SGLang), or 32 raw bytes (vLLM's sha256 hashes). They are a pure function of the canonical
key, so removals and replays name the same hash as the store did.

Replay (ROUTER socket): a DEALER sends ``[b"", start_seq (8 bytes BE)]`` and receives
``[b"", seq, payload]`` for every buffered batch with ``seq >= start_seq``, then the end marker
``[b"", (-1 as signed 8 bytes BE), b""]``. vLLM >= 0.26 adds the topic frame after the delimiter:
``[b"", topic, seq, payload]``, and the end marker is ``[b"", b"", -1, b""]``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgpack
import xxhash

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from services.core.kvcache import EventMeta

HashMode = Literal["uint64", "int64", "bytes32"]
EventForm = Literal["map", "array"]
HASH_MODES: tuple[str, ...] = ("uint64", "int64", "bytes32")
BATCH_FORMS: tuple[str, ...] = ("array", "map")
EVENT_FORMS: tuple[str, ...] = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENGINE_SALT = 0x5EED_0F_E9_61_4E  # makes engine hashes differ from canonical keys
MEDIUM = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}


def engine_hash(key: int, mode: str = "uint64") -> int | bytes:
    """The engine-style hash the simulated engine reports for canonical ``key``."""
    raw = key.to_bytes(8, "little")
    if mode == "bytes32":
        return hashlib.sha256(raw + b"kvgate-sim").digest()
    h = xxhash.xxh3_64_intdigest(raw, seed=_ENGINE_SALT)
    if mode == "int64":
        return h - (1 << 64) if h >= 1 << 63 else h
    if mode != "uint64":
        raise ValueError(f"unknown hash mode {mode!r}; choose from {HASH_MODES}")
    return h


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def _event(
    ev: KvEvent,
    meta: EventMeta | None,
    form: str,
    hash_mode: str,
    lora_ids: dict[str, int],
) -> Any:
    if isinstance(ev, BlockStored):
        lora = meta.lora if meta else None
        fields: list[tuple[str, Any]] = [
            ("block_hashes", [engine_hash(k, hash_mode) for k in ev.keys]),
            (
                "parent_block_hash",
                None if ev.parent_key is None else engine_hash(ev.parent_key, hash_mode),
            ),
            ("token_ids", list(meta.token_ids) if meta else []),
            ("block_size", ev.block_size),
            ("lora_id", lora_ids.get(lora) if lora else None),
            ("medium", MEDIUM.get(ev.tier, "GPU")),
            ("lora_name", lora),
        ]
        tag = "BlockStored"
    elif isinstance(ev, BlockRemoved):
        fields = [
            ("block_hashes", [engine_hash(k, hash_mode) for k in ev.keys]),
            ("medium", MEDIUM.get(ev.tier, "GPU")),
        ]
        tag = "BlockRemoved"
    elif isinstance(ev, AllBlocksCleared):
        fields = []
        tag = "AllBlocksCleared"
    else:  # pragma: no cover - KvEvent is a closed union
        raise TypeError(f"not a KV event: {ev!r}")
    if form == "array":
        return [tag] + [v for _, v in fields]
    if form != "map":
        raise ValueError(f"unknown event form {form!r}; choose from {EVENT_FORMS}")
    return {"type": tag, **dict(fields)}


def encode_batch(
    ts: float,
    events: list[KvEvent],
    meta: list[EventMeta | None] | None = None,
    *,
    form: str = "map",
    hash_mode: str = "uint64",
    dp_rank: int = 0,
    lora_ids: dict[str, int] | None = None,
    batch_form: str = "array",
) -> bytes:
    """msgpack payload of one batch: ``[ts, events, dp_rank]`` (``batch_form="array"``, what
    released vLLM sends) or ``{"ts", "events", "data_parallel_rank"}`` (``"map"``: vLLM's newest
    source no longer declares its EventBatch array-like)."""
    meta = meta if meta is not None else [None] * len(events)
    lids = lora_ids or {}
    body = [_event(e, m, form, hash_mode, lids) for e, m in zip(events, meta, strict=True)]
    if batch_form == "map":
        return msgpack.packb(
            {"ts": ts, "events": body, "data_parallel_rank": dp_rank}, use_bin_type=True
        )
    if batch_form != "array":
        raise ValueError(f"unknown batch form {batch_form!r}; choose from {BATCH_FORMS}")
    return msgpack.packb([ts, body, dp_rank], use_bin_type=True)
