"""Every message on the bus: msgpack-encoded, versioned, validated at decode.

Invariants:
- Each message has ``v`` (schema major version). A decoder accepts ``v == SCHEMA_VERSION``;
  anything else is rejected with :class:`SchemaError`. Unknown *fields* are ignored, so a newer
  minor revision that adds fields can be read by an older service.
- :func:`decode` either returns a fully type-checked object or raises :class:`SchemaError`
  whose message names the message type and the offending field. Nothing half-valid escapes.
- Block keys are canonical kvgate keys (:mod:`services.core.keys`): unsigned 64-bit ints.
- A type with ``batched = True`` may also travel as a msgpack array of several messages in one
  bus message (:func:`encode_batch`); :func:`decode_all` reads either form, so a consumer of
  such a subject handles both (``router.outcomes``: a router sends one array per tick).

Other issues extend this module with their own messages; keep every wire type here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

SCHEMA_VERSION = 1

# msgpack cannot carry ints above 2**64 - 1, so ge=0 makes this exactly uint64
U64 = Annotated[int, Meta(ge=0)]
NonNeg = Annotated[int, Meta(ge=0)]
Pos = Annotated[int, Meta(gt=0)]
Frac = Annotated[float, Meta(ge=0.0, le=1.0)]
NonNegF = Annotated[float, Meta(ge=0.0)]
Token = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")]
Tier = Literal["gpu", "cpu", "disk"]
Severity = Literal["info", "warning", "critical"]


class SchemaError(ValueError):
    """A message failed to decode or validate; the text says which message and which field."""


class Message(Struct, kw_only=True):
    v: int = SCHEMA_VERSION
    # may several travel as one array in a bus message (module invariants)
    batched: ClassVar[bool] = False


def now() -> float:
    return time.time()


# --------------------------------------------------------------------------- KV events


class BlockStored(Struct, tag="stored", tag_field="type", kw_only=True):
    """Full blocks stored, in chain order: ``keys[0]``'s parent is ``parent_key`` (None = root)."""

    keys: list[U64]
    parent_key: U64 | None = None
    block_size: Pos
    tier: Tier = "gpu"


class BlockRemoved(Struct, tag="removed", tag_field="type", kw_only=True):
    keys: list[U64]
    tier: Tier = "gpu"


class AllBlocksCleared(Struct, tag="cleared", tag_field="type", kw_only=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Message):
    """Events of one worker. ``seq`` increases by exactly one per batch per ``instance_id``;
    a new ``instance_id`` means the worker restarted (its earlier blocks are gone)."""

    worker_id: Token
    instance_id: Token
    seq: NonNeg
    ts: float
    events: list[KvEvent]


class KvDumpRequest(Message):
    """Ask a worker (or its bridge) for its full cache, one chunk per request
    (services.common.kvdump). The first request (no ``dump_id``) freezes the cache as of the
    worker's latest KV batch and returns chunk 0; each next request names the ``dump_id`` and
    the ``cursor`` the previous chunk gave as ``next_cursor``. ``max_chunk_bytes``: the
    requester's max_payload (the responder uses the smaller of it and its own)."""

    worker_id: Token
    reason: str = ""
    dump_id: str | None = None
    cursor: NonNeg = 0
    max_chunk_bytes: Pos | None = None


class EngineHistoryLost(Struct, kw_only=True):
    """What a bridge's dump cannot vouch for: the bridge knows only the engine batches it
    received, and some it never got (``reason`` ``lost_history``: it started after the engine
    had already published, or after an engine restart, and the engine's replay no longer held
    the first batches; ``unrecovered_gap``: a gap its replay could not fill). Its view is built
    from engine seq ``view_from_seq`` on (a vLLM/SGLang batch seq, a TensorRT-LLM event id):
    blocks the engine stored before it may still be cached by the engine and are in neither
    the dump nor the index. ``unkeyed_blocks``: blocks the engine stored since the loss that
    could not be keyed because their parent was in the lost history, and ``unknown_hashes``:
    removals or moves of blocks the bridge never saw -- both evidence (a lower bound) of what
    the dump lacks. ``losses``: how many such losses since the engine's cache was last known
    whole. ``detail``: why the history could not be replayed."""

    reason: Literal["lost_history", "unrecovered_gap"]
    first_lost_seq: NonNeg
    last_lost_seq: NonNeg
    view_from_seq: NonNeg
    kv_seq: int = -1
    unkeyed_blocks: NonNeg = 0
    unknown_hashes: NonNeg = 0
    losses: NonNeg = 1
    since: float = 0.0
    detail: str = ""


class KvDumpChunk(Message):
    """One chunk of a worker's full cache, frozen right after its KV batch ``kv_seq``.

    The events of chunks ``cursor`` 0, next_cursor, ... in order are the whole cache (the
    first starts with AllBlocksCleared); ``next_cursor`` None marks the last chunk.
    ``blocks``: keys in the whole dump, so the requester can tell a complete dump from a
    truncated one. Named ``kv_seq`` (not ``seq``) so a requester expecting the single-reply
    KvEventBatch of older builds fails loudly instead of reading a partial dump."""

    worker_id: Token
    instance_id: Token
    dump_id: Annotated[str, Meta(min_length=1, max_length=64)]
    kv_seq: NonNeg
    cursor: NonNeg
    next_cursor: NonNeg | None
    blocks: NonNeg
    ts: float
    events: list[KvEvent]
    # set by a bridge that lost engine history (chunk 0): the dump is not the engine's cache
    history_lost: EngineHistoryLost | None = None


# --------------------------------------------------------------------------- workers


class WorkerCapacity(Struct, kw_only=True):
    block_size: Pos
    num_gpu_blocks: Pos
    max_num_seqs: Pos
    max_model_len: Pos
    max_num_batched_tokens: Pos | None = None


class WorkerHeartbeat(Message):
    """Registers a worker and states its capacity. ``kv_seq`` is the last KV batch seq it
    published (-1: none yet), so a consumer can see a gap even when no later batch comes."""

    worker_id: Token
    instance_id: Token
    url: str
    model: str
    capacity: WorkerCapacity
    engine: str = "sim"
    state: Literal["starting", "ready", "draining"] = "ready"
    kv_seq: Annotated[int, Meta(ge=-1)] = -1
    kv_events: bool = True
    ts: float = 0.0
    # LoRA adapters the engine serves: a request whose ``model`` names one runs on it, and
    # its blocks are keyed with the adapter's seed (services.core.keys.block_seed)
    loras: Annotated[tuple[str, ...], Meta(max_length=1024)] = ()
    # disaggregated serving: what this engine does (vLLM kv_role / SGLang disaggregation-mode)
    role: Literal["both", "prefill", "decode"] = "both"
    # a prefill engine's KV bootstrap port (SGLang --disaggregation-bootstrap-port; the
    # simulated worker's HTTP port); 0: not announced (the router assumes SGLang's 8998)
    bootstrap_port: Annotated[int, Meta(ge=0, le=65535)] = 0


class WorkerControl(Message):
    """An operator's action on a worker, from the api (signed). ``repin``: routers pin the
    worker's URL anew, to ``url`` or, when empty, to the next heartbeat's (services.core.url_pin)."""

    worker_id: Token
    action: Literal["cordon", "drain", "uncordon", "repin"]
    by: str = ""
    ts: float = 0.0
    url: Annotated[str, Meta(max_length=2000)] = ""  # repin only


class GpuSample(Struct, kw_only=True):
    index: NonNeg
    uuid: str = ""
    name: str = ""
    sm_util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: NonNeg | None = None
    mem_total_bytes: NonNeg | None = None
    mem_bw_util_pct: float | None = None
    pcie_rx_bytes_s: NonNegF | None = None
    pcie_tx_bytes_s: NonNegF | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    xid_errors: NonNeg | None = None
    ecc_errors: NonNeg | None = None
    # added by the telemetry issue (additive; older readers ignore them):
    # mem_util_pct is memory *occupancy* (used/total %), mem_bw_util_pct is NVML's
    # "memory utilization" (share of time device memory was read or written).
    mem_free_bytes: NonNeg | None = None
    last_xid: NonNeg | None = None  # code of the most recent XID error seen


class WorkerLoad(Message):
    """One telemetry sample of a worker. ``stale`` samples carry None, never zeros, for what
    could not be read; ``ts`` is when it was measured, so consumers can judge age."""

    worker_id: Token
    ts: float
    source: str = "sim"  # vllm | sglang | trtllm | sim
    stale: bool = False
    error: str | None = None
    running: NonNeg | None = None
    waiting: NonNeg | None = None
    scheduled: NonNeg | None = None  # TensorRT-LLM "scheduled" (vs active = running)
    max_batch: NonNeg | None = None
    kv_usage: Frac | None = None
    kv_blocks_total: NonNeg | None = None
    kv_blocks_free: NonNeg | None = None
    tokens_per_block: NonNeg | None = None
    prefix_cache_queries: NonNegF | None = None
    prefix_cache_hits: NonNegF | None = None
    gpus: list[GpuSample] = []
    # added by the telemetry issue (additive):
    kv_capacity_tokens: NonNeg | None = None  # KV cache size in tokens (blocks x block size)
    cache_hit_rate: Frac | None = None  # prefix-cache hit rate over the last interval(s)
    prefix_caching: bool | None = None  # engine reports prefix caching on / off


# --------------------------------------------------------------------------- routers


class RouterLoad(Message):
    """A router's in-flight requests per worker (for global least-request across replicas)."""

    router_id: Token
    ts: float
    seq: NonNeg = 0
    inflight: dict[str, NonNeg] = {}
    # uncached prompt tokens of those requests still before their first token (queued prefill)
    pending_prefill: dict[str, NonNeg] = {}
    # per tenant with a quota: [requests, input tokens, output tokens] in the last minute and
    # requests in flight, admitted by this router (services.core.flow.quota)
    tenant_usage: dict[str, list[NonNeg]] = {}
    # per tenant: KV blocks this router's requests made that the engines still hold (its
    # cache ledger, services.router.tenant_cache); cache budgets are enforced on the sum.
    # None: not in this message (sent at most every half load interval)
    tenant_cache_blocks: dict[str, NonNeg] | None = None


class RouterOutcome(Message):
    """One finished request. Routers send the outcomes of one tick as an array of these
    (:func:`encode_batch`): a message per request cost the broker ~5 % of a core at 8,000
    requests/s (docs/benchmarks.md, proxy)."""

    batched: ClassVar[bool] = True

    request_id: str
    router_id: Token
    ts: float
    policy: str
    policy_version: NonNeg = 0
    arm: Literal["control", "candidate"] = "control"
    canary_id: str | None = None
    model: str = ""
    worker_id: str | None = None
    status: Literal["ok", "error", "timeout", "rejected", "cancelled"] = "ok"
    http_status: int = 200
    prompt_tokens: NonNeg = 0
    completion_tokens: NonNeg = 0
    predicted_cached_tokens: NonNeg = 0  # captured: the chosen worker's, by the index
    cached_tokens: NonNeg | None = None  # as reported by the worker (ground truth)
    ttft_s: NonNegF | None = None
    e2e_s: NonNegF | None = None
    retries: NonNeg = 0
    migrated: NonNeg = 0
    stream: bool = False
    # disaggregated serving: the worker that prefilled (``worker_id`` decoded), how long its
    # prefill took, and the time from its end to the decoder's first token (KV transfer)
    prefill_worker: str | None = None
    prefill_s: NonNegF | None = None
    handoff_s: NonNegF | None = None
    # reuse attribution (services/core/policy/attribution.py): the most prompt tokens an
    # eligible worker held cached, and why that worker was not chosen ("" when it was)
    available_cached_tokens: NonNeg = 0
    lost_reason: str = ""
    # who it was for (services.common.tenancy; None: a tenant-less request) and its band:
    # the admin API sums these per tenant for chargeback (services.api.usage)
    tenant_id: str | None = None
    priority: str | None = None


class CanaryAssignment(Struct, kw_only=True):
    canary_id: str
    fraction: Frac
    candidate_name: str
    candidate_version: NonNeg
    candidate_spec: dict[str, Any]


class PolicyRevisionRequest(Message):
    """A router asks the api which policy revision it stored (``policy.revision``): a notice
    with a higher revision was not sent by the api. ``repair``: the POLICY stream's newest notice
    failed this router's checks; the api re-publishes its own (services.api.publisher)."""

    router_id: str = ""
    repair: bool = False


class PolicyRevisionReply(Message):
    revision: NonNeg


class PolicyUpdated(Message):
    """The active policy (and canary split, if any). Routers apply the newest ``revision``."""

    revision: NonNeg
    name: str
    version: NonNeg
    spec: dict[str, Any]
    canary: CanaryAssignment | None = None
    ts: float = 0.0


# --------------------------------------------------------------------------- tenants


TenantId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
PriorityName = Literal["critical", "standard", "sheddable"]
OptCount = Annotated[int, Meta(ge=1)] | None


class TenantRecord(Struct, kw_only=True):
    """One tenant as routers need it (services.common.tenancy.Tenant, plus its cache salt)."""

    tenant_id: TenantId
    weight: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0
    default_priority: PriorityName = "standard"
    requests_per_min: OptCount = None
    input_tokens_per_min: OptCount = None
    output_tokens_per_min: OptCount = None
    concurrent_requests: OptCount = None
    cache_budget_blocks: OptCount = None
    cache_isolation: bool = False
    # the tenant's secret cache namespace (random, made by the api); used only when isolated
    cache_salt: Annotated[str, Meta(max_length=128)] = ""
    version: NonNeg = 0


class TenantKeyRecord(Struct, kw_only=True):
    """A client API key of a tenant, by its SHA-256 digest (the key itself is never sent)."""

    key_id: NonNeg
    tenant_id: TenantId
    digest: Annotated[str, Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
    priority: PriorityName | None = None  # None: the tenant's default
    allow_priority_header: bool = False  # may the request name its band (x-kvgate-priority)
    expires_at: NonNegF | None = None  # unix seconds; None: until revoked


class TenantsUpdated(Message):
    """The whole tenant directory (tenants and their active keys: a revoked key is absent).
    Routers apply the newest ``revision``; the api publishes it after every change and
    re-publishes it when the TENANTS stream does not hold its own current one."""

    revision: NonNeg
    tenants: list[TenantRecord] = []
    keys: list[TenantKeyRecord] = []
    ts: float = 0.0


# --------------------------------------------------------------------------- alerts


class Alert(Message):
    """An alert signal (from a detector or router) or a managed alert state change.
    ``fingerprint`` identifies the condition (kind + worker + ...) for de-duplication."""

    fingerprint: Annotated[str, Meta(min_length=1, max_length=256)]
    kind: Token
    severity: Severity
    state: Literal["firing", "resolved"] = "firing"
    source: Token = "unknown"
    worker_id: str | None = None
    summary: Annotated[str, Meta(max_length=2000)] = ""
    remedy: Annotated[str, Meta(max_length=4000)] = ""
    details: dict[str, Any] = {}
    ts: float = 0.0
    alert_id: str | None = None  # set by the alert manager


# --------------------------------------------------------------------------- KV index plane
# The indexer publishes ordered IndexDelta messages (kv.index.delta) and answers
# SnapshotRequest (kv.index.snapshot) with one or more SnapshotChunk replies sent to the
# request's reply subject; KvQuery -> KvQueryReply on kv.query. See docs/kv-index.md.


class IndexStored(Struct, tag="stored", tag_field="op", kw_only=True):
    worker_id: str
    keys: list[U64]
    tier: Tier = "gpu"


class IndexRemoved(Struct, tag="removed", tag_field="op", kw_only=True):
    worker_id: str
    keys: list[U64]
    tier: Tier | None = None  # None: every tier


class IndexCleared(Struct, tag="cleared", tag_field="op", kw_only=True):
    worker_id: str


class IndexEvicted(Struct, tag="evicted", tag_field="op", kw_only=True):
    """Keys pruned by the indexer's memory cap: dropped for every worker."""

    keys: list[U64]


IndexOp = IndexStored | IndexRemoved | IndexCleared | IndexEvicted


class IndexDelta(Message):
    """Index changes in apply order. ``seq`` increases by one per delta within an ``epoch``
    (one epoch per indexer process); a replica that sees a gap or a new epoch re-snapshots."""

    epoch: str
    seq: NonNeg
    ts: float
    ops: list[IndexOp]


class SnapshotRequest(Message):
    """A snapshot, or a window of one: ``max_chunks`` chunks from ``first_chunk`` of the
    snapshot ``snapshot_id`` ("" = take a new one). ``max_chunks`` 0 asks for every chunk at
    once (replicas before windows; a large snapshot then overruns a slow reader's buffer at the
    server, which drops the connection as a slow consumer)."""

    replica_id: str = ""
    max_chunk_bytes: Pos | None = None
    snapshot_id: str = ""
    first_chunk: NonNeg = 0
    max_chunks: NonNeg = 0


class SnapshotChunk(Message):
    """One part of a snapshot taken right after delta ``delta_seq`` of ``epoch``.

    ``keys`` is little-endian uint64 packed; ``masks`` one packed uint64 array per 64 worker
    slots (bit i of word w: slot 64*w+i holds the key); ``slots`` names the worker of each
    slot ("" = free) and ``counts`` its pairs. Tier data (sparse, 3 bits per slot: gpu=1,
    cpu=2, disk=4) rides in ``tier_keys`` (packed) and ``tier_values`` (bytes of each int,
    little-endian). Rows ``row_start..`` of the key table; chunks ``chunk`` of ``chunks``.
    """

    epoch: str
    snapshot_id: str
    delta_seq: int
    chunk: NonNeg
    chunks: Pos
    slots: list[str]
    counts: list[NonNeg]
    row_start: NonNeg
    keys: bytes
    masks: list[bytes]
    tier_keys: bytes = b""
    tier_values: list[bytes] = []
    error: str | None = None
    # the reply's window ends before this chunk (0: an indexer that sends every chunk at once)
    window_end: NonNeg = 0
    # past 64 slots: one row per (key, slot) pair, ``keys`` repeated per holder and the slot of
    # each row here (uint32 LE); ``masks`` is then empty. None: the mask form above.
    pair_slots: bytes | None = None


class IndexVerifyRequest(Message):
    """Ask the indexer to compare its index with each worker's own dump (``kv.index.verify``).
    ``workers`` empty: every registered worker. ``repair``: resync the divergent ones."""

    workers: list[Token] = []
    repair: bool = False
    max_sample: Annotated[int, Meta(ge=0, le=1000)] = 10


class WorkerDivergence(Struct, kw_only=True):
    """The index vs one worker's dump. ``status``: equal | divergent | inconclusive (the
    worker restarted or was resynced meanwhile, or its batches did not catch up in time) |
    unreachable (no dump) | unknown (the index equals a bridge's dump, but the bridge lost
    engine history, so the engine may hold blocks neither has: ``history_lost`` says which).
    ``missing``: pairs the worker holds that the index lacks; ``extra``: pairs the index holds
    that the worker does not (a pair is a key on a tier)."""

    worker_id: str
    status: Literal["equal", "divergent", "inconclusive", "unreachable", "unknown"]
    kv_seq: int = -1
    worker_blocks: NonNeg = 0
    index_blocks: NonNeg = 0
    missing: NonNeg = 0
    extra: NonNeg = 0
    missing_sample: list[U64] = []
    extra_sample: list[U64] = []
    detail: str = ""
    repaired: bool = False
    history_lost: EngineHistoryLost | None = None


class IndexVerifyReply(Message):
    workers: list[WorkerDivergence] = []
    divergent_blocks: NonNeg = 0
    error: str | None = None


class KvQuery(Message):
    """Which workers hold this prompt's prefix: give ``token_ids`` (keys are derived with
    ``block_size`` — default the indexer's — and the cluster seed, ``lora`` and ``salt``) or
    canonical ``keys`` directly."""

    token_ids: list[NonNeg] | None = None
    keys: list[U64] | None = None
    block_size: Pos | None = None
    lora: str | None = None
    salt: str | None = None


class KvQueryMatch(Struct, kw_only=True):
    worker_id: str
    matched_blocks: NonNeg
    gpu_blocks: NonNeg = 0
    cpu_blocks: NonNeg = 0
    disk_blocks: NonNeg = 0


class KvQueryReply(Message):
    blocks: NonNeg = 0  # keys considered
    matches: list[KvQueryMatch] = []
    error: str | None = None


# --------------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def encode_batch(encoded: list[bytes]) -> bytes:
    """One bus message carrying several already-encoded messages of a ``batched`` type (a
    msgpack array of them; :func:`decode_all` reads it)."""
    return _encoder.encode([msgspec.Raw(b) for b in encoded])


def decode(msg_type: type[Struct], data: bytes | bytearray | memoryview) -> Any:
    """Decode and validate ``data`` as ``msg_type`` or raise SchemaError naming the problem."""
    return _checked(msg_type, _decode(msg_type, msg_type, data))


def decode_all(msg_type: type[Struct], data: bytes | bytearray | memoryview) -> list[Any]:
    """The messages in ``data``: one ``msg_type``, or for a ``batched`` type an array of them
    (all valid, or SchemaError for the whole message)."""
    if not getattr(msg_type, "batched", False):
        return [decode(msg_type, data)]
    obj = _decode(msg_type, msg_type | list[msg_type], data)  # type: ignore[operator]
    if isinstance(obj, list):
        return [_checked(msg_type, o) for o in obj]
    return [_checked(msg_type, obj)]


def _decode(msg_type: type[Struct], spec: Any, data: bytes | bytearray | memoryview) -> Any:
    dec = _decoders.get(spec)
    if dec is None:
        dec = _decoders[spec] = msgspec.msgpack.Decoder(spec)
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"{msg_type.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"{msg_type.__name__}: malformed msgpack ({exc})") from None


def _checked(msg_type: type[Struct], obj: Any) -> Any:
    version = getattr(obj, "v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"{msg_type.__name__}: unsupported schema version v={version} (this build reads v={SCHEMA_VERSION})"
        )
    return obj


def to_builtins(msg: Struct) -> Any:
    """Plain dicts/lists (for JSON in HTTP debug views and the admin API)."""
    return msgspec.to_builtins(msg)
