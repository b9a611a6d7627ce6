"""Engines' own KV-event wire formats, decoded straight into msgspec structs. Pure.

vLLM / SGLang (ZMQ payload, msgpack): the batch is ``[ts, events, dp_rank]`` (array-like
EventBatch; some builds send a map ``{"ts", "events", "data_parallel_rank"}``). Each event is
either a map with a ``"type"`` key (vLLM >= 0.24, SGLang >= 0.5.20) or an array with the tag
first (older)::

    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                 lora_name, extra_keys, group_idx, kv_cache_spec_kind, locality,
                 lookahead_token_ids (vLLM), cache_salt (SGLang); other fields
                 (session_id, ownership, ...) ignored
    BlockRemoved: block_hashes, medium, group_idx, locality
    AllBlocksCleared

Block hashes are unsigned 64-bit ints (vLLM), signed int64 (SGLang) or bytes (vLLM sha256).
Fields an older engine does not send take their defaults; trailing fields a newer one adds
are ignored.

Validation is per event: :meth:`VllmDecoder.decode` keeps every event it can read and
reports each one it cannot (unknown event type, wrong hash type, SGLang EAGLE bigram pages,
...) as ``(reason, detail)``, so one bad event never costs the rest of its batch.

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
    extra_keys: list[Any] | None = None  # vLLM: one entry (list or None) per block
    group_idx: int | None = None  # vLLM: KV cache group (hybrid models)
    kv_cache_spec_kind: str | None = None  # vLLM: the group's attention kind
    locality: str | None = None  # vLLM: LOCAL / REMOTE to the publisher
    cache_salt: str | None = None  # SGLang
    lookahead_token_ids: list[Any] | None = None  # vLLM: tokens past each block in its hash


class MRemoved(Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


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
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None
    cache_salt: str | None = None
    lookahead_token_ids: list[Any] | None = None


class ARemoved(Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


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


class DecodedBatch(Struct):
    """One engine batch: the events that could be read, in order, and ``(reason, detail)``
    for each event that could not."""

    ts: float
    events: list[MapEvent | ArrayEvent]
    bad: list[tuple[str, str]] = []


_map_event = msgspec.msgpack.Decoder(MapEvent)
_array_event = msgspec.msgpack.Decoder(ArrayEvent)
_KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def _why_bad(raw: object, exc: Exception) -> str:
    """The bad-input reason for one undecodable event (``raw`` as generic msgpack)."""
    tag = (
        raw.get("type")
        if isinstance(raw, dict)
        else (raw[0] if isinstance(raw, list) and raw else None)
    )
    if not isinstance(tag, str):
        return "invalid_schema"
    if tag not in _KNOWN_TYPES:
        return "unknown_event_type"
    toks = raw.get("token_ids") if isinstance(raw, dict) else (raw[3] if len(raw) > 3 else None)
    if tag == "BlockStored" and isinstance(toks, list) and toks and isinstance(toks[0], list):
        return "bigram_page"  # SGLang EAGLE: token_ids as (token, next token) pairs
    return "wrong_hash_type" if "hash" in str(exc) else "invalid_schema"


def decode_event(raw: object) -> tuple[MapEvent | ArrayEvent | None, tuple[str, str] | None]:
    """One event given as generic msgpack -> (event, None) or (None, (reason, detail))."""
    dec = _map_event if isinstance(raw, dict) else _array_event
    try:
        return dec.decode(msgspec.msgpack.encode(raw)), None
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
        return None, (_why_bad(raw, exc), str(exc)[:300])


class VllmDecoder:
    """Decodes vLLM / SGLang payloads, remembering which of the four forms the engine uses
    (so the common case is a single typed decode). A batch with an event the typed decode
    rejects is decoded again event by event: the good ones are kept, each bad one reported.
    """

    def __init__(self) -> None:
        self._order = list(range(len(_DECODERS)))

    def decode(self, payload: bytes) -> DecodedBatch:
        for pos, i in enumerate(self._order):
            try:
                batch = _DECODERS[i].decode(payload)
            except msgspec.ValidationError:
                continue
            except msgspec.DecodeError as exc:
                raise EngineFormatError("malformed_msgpack", str(exc)) from None
            if pos:
                self._order.insert(0, self._order.pop(pos))
            return DecodedBatch(batch.ts, batch.events)  # type: ignore[arg-type]
        return self._per_event(payload)

    @staticmethod
    def _per_event(payload: bytes) -> DecodedBatch:
        try:
            obj: Any = _any.decode(payload)
        except msgspec.DecodeError as exc:
            raise EngineFormatError("malformed_msgpack", str(exc)) from None
        if isinstance(obj, list) and len(obj) >= 2:
            ts, raw_events = obj[0], obj[1]
        elif isinstance(obj, dict):
            ts, raw_events = obj.get("ts"), obj.get("events")
        else:
            raise EngineFormatError("invalid_schema", f"not an event batch: {type(obj).__name__}")
        if (
            not isinstance(ts, (int, float))
            or isinstance(ts, bool)
            or not isinstance(raw_events, list)
        ):
            raise EngineFormatError("invalid_schema", "batch needs ts (number) and events (list)")
        out = DecodedBatch(float(ts), [], [])
        for raw in raw_events:
            ev, why = decode_event(raw)
            if ev is not None:
                out.events.append(ev)
            elif why is not None:
                out.bad.append(why)
        return out


REMOTE_MEDIA = ("EXTERNAL", "REMOTE")


def medium_tier(medium: str | None, locality: str | None = None) -> str | None:
    """Engine storage medium -> kvgate tier ("GPU" / None -> gpu, "CPU*" -> cpu, local
    storage -> disk); None for blocks that are not on this engine (vLLM ``locality`` REMOTE,
    SGLang ``EXTERNAL`` shared pools): those are not this worker's cache."""
    if locality and locality.upper() == "REMOTE":
        return None
    if not medium:
        return "gpu"
    m = medium.lower()
    if m.upper() in REMOTE_MEDIA:
        return None
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
