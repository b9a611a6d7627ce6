"""Engines' own KV-event wire formats, decoded straight into msgspec structs. Pure.

vLLM / SGLang (ZMQ payload, msgpack): the batch is ``[ts, events, dp_rank]`` (array-like
EventBatch; some builds send a map ``{"ts", "events", "data_parallel_rank"}``). Each event is
either a map with a ``"type"`` key (vLLM >= 0.24, SGLang >= 0.5.20) or an array with the tag
first (older)::

    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                 lora_name (+ extra_keys, group_idx, ... ignored)
    BlockRemoved: block_hashes, medium
    AllBlocksCleared

Block hashes are unsigned 64-bit ints (vLLM), signed int64 (SGLang) or bytes (vLLM sha256).
Fields an older engine does not send take their defaults; trailing fields a newer one adds
are ignored.

TensorRT-LLM (``POST /kv_cache_events`` on trtllm-serve, JSON): a list of
``{"event_id", "data": {...}, "window_size", "attention_dp_rank"?}`` where ``data`` is one of
``created`` (num_blocks_per_cache_level), ``stored`` (parent_hash, blocks: [{block_hash,
tokens: [{token_id, token_extra_id}], cache_level, priority}]), ``removed`` (block_hashes) or
``updated`` (block_hash, cache_level / priority: {new_value, old_value}).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

EngineHash = int | bytes

# --------------------------------------------------------------------------- vLLM / SGLang


class MStored(Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class MRemoved(Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class MCleared(Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class AStored(Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class ARemoved(Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class ACleared(Struct, array_like=True, tag="AllBlocksCleared"):
    pass


MapEvent = MStored | MRemoved | MCleared
ArrayEvent = AStored | ARemoved | ACleared


class BatchArrayMap(Struct, array_like=True):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class BatchArrayArray(Struct, array_like=True):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


class BatchMapMap(Struct):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class BatchMapArray(Struct):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


STORED_TYPES = (MStored, AStored)
REMOVED_TYPES = (MRemoved, ARemoved)
CLEARED_TYPES = (MCleared, ACleared)

_DECODERS = [
    msgspec.msgpack.Decoder(t) for t in (BatchArrayMap, BatchArrayArray, BatchMapMap, BatchMapArray)
]
_any = msgspec.msgpack.Decoder()


class EngineFormatError(ValueError):
    """A payload no known engine form accepts; ``reason`` is the bad-input counter label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class VllmDecoder:
    """Decodes vLLM / SGLang payloads, remembering which of the four forms the engine uses
    (so the common case is a single typed decode)."""

    def __init__(self) -> None:
        self._order = list(range(len(_DECODERS)))

    def decode(self, payload: bytes) -> BatchArrayMap | BatchArrayArray | BatchMapMap:
        first_error: msgspec.ValidationError | None = None
        for pos, i in enumerate(self._order):
            try:
                batch = _DECODERS[i].decode(payload)
            except msgspec.ValidationError as exc:
                first_error = first_error or exc
                continue
            except msgspec.DecodeError as exc:
                raise EngineFormatError("malformed_msgpack", str(exc)) from None
            if pos:
                self._order.insert(0, self._order.pop(pos))
            return batch
        text = str(first_error)
        reason = "wrong_hash_type" if "hash" in text else "invalid_schema"
        # say which part is wrong in terms of the first form that parses structurally
        try:
            obj: Any = _any.decode(payload)
            if not isinstance(obj, (list, dict)):
                reason = "invalid_schema"
        except msgspec.DecodeError:
            reason = "malformed_msgpack"
        raise EngineFormatError(reason, text)


def medium_tier(medium: str | None) -> str:
    """Engine storage medium -> kvgate tier ("GPU" / None -> gpu, "CPU*" -> cpu, else disk)."""
    if not medium:
        return "gpu"
    m = medium.lower()
    if "gpu" in m or "hbm" in m or "device" in m:
        return "gpu"
    if "cpu" in m or "host" in m or "dram" in m:
        return "cpu"
    return "disk"


# --------------------------------------------------------------------------- TensorRT-LLM


class TToken(Struct):
    token_id: int
    token_extra_id: int = 0


class TStoredBlock(Struct):
    block_hash: int
    tokens: list[TToken]
    cache_level: int = 0
    priority: int | None = None
    lora_id: int | None = None


class TCreated(Struct, tag="created", tag_field="type"):
    num_blocks_per_cache_level: list[int] = []


class TStored(Struct, tag="stored", tag_field="type"):
    blocks: list[TStoredBlock]
    parent_hash: int | None = None


class TRemoved(Struct, tag="removed", tag_field="type"):
    block_hashes: list[int]


class TDiff(Struct):
    new_value: int | None = None
    old_value: int | None = None


class TUpdated(Struct, tag="updated", tag_field="type"):
    block_hash: int
    cache_level: TDiff | None = None
    priority: TDiff | None = None


class TEvent(Struct):
    event_id: int
    data: TCreated | TStored | TRemoved | TUpdated
    window_size: int | None = None
    attention_dp_rank: int | None = None


_trt_decoder = msgspec.json.Decoder(list[TEvent])
_trt_one = msgspec.json.Decoder(TEvent)


def decode_trtllm(body: bytes) -> tuple[list[TEvent], list[tuple[str, str]]]:
    """Events of one ``/kv_cache_events`` reply, plus ``(reason, detail)`` for events that
    could not be read (each bad event is skipped, the others kept)."""
    try:
        return _trt_decoder.decode(body), []
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        return [], [("malformed_json", str(exc))]
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:  # pragma: no cover - handled above
        return [], [("malformed_json", str(exc))]
    if not isinstance(raw, list):
        return [], [("invalid_schema", "expected a JSON list of events")]
    good: list[TEvent] = []
    bad: list[tuple[str, str]] = []
    for item in raw:
        try:
            good.append(_trt_one.decode(msgspec.json.encode(item)))
        except msgspec.ValidationError as exc:
            text = str(exc)
            bad.append(("wrong_hash_type" if "hash" in text else "invalid_schema", text))
    return good, bad
