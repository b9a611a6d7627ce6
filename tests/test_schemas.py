"""Schemas: every message round-trips; every malformed shape is rejected with a clear error."""

from __future__ import annotations

import msgpack
import pytest

from services.common import schemas as s


def _messages() -> list:
    cap = s.WorkerCapacity(block_size=16, num_gpu_blocks=100, max_num_seqs=8, max_model_len=4096)
    return [
        s.KvEventBatch(
            worker_id="w-1",
            instance_id="abc",
            seq=3,
            ts=1.5,
            events=[
                s.BlockStored(keys=[1, 2**64 - 1], parent_key=None, block_size=16, tier="gpu"),
                s.BlockRemoved(keys=[2], tier="cpu"),
                s.AllBlocksCleared(),
            ],
        ),
        s.WorkerHeartbeat(
            worker_id="w-1",
            instance_id="abc",
            url="http://x:1",
            model="m",
            capacity=cap,
            kv_seq=7,
            ts=2.0,
        ),
        s.WorkerLoad(
            worker_id="w-1",
            ts=3.0,
            running=2,
            waiting=1,
            kv_usage=0.5,
            gpus=[s.GpuSample(index=0, sm_util_pct=50.0)],
        ),
        s.WorkerControl(worker_id="w-1", action="cordon", by="ops"),
        s.RouterLoad(router_id="r1", ts=1.0, inflight={"w-1": 3}),
        s.RouterOutcome(
            request_id="req", router_id="r1", ts=1.0, policy="kv_aware", worker_id="w-1", ttft_s=0.1
        ),
        s.PolicyUpdated(
            revision=1,
            name="kv_aware",
            version=2,
            spec={"weights": {"prefix": 1.0}},
            canary=s.CanaryAssignment(
                canary_id="c1",
                fraction=0.05,
                candidate_name="p",
                candidate_version=1,
                candidate_spec={},
            ),
        ),
        s.Alert(
            fingerprint="kv_starved:w-1",
            kind="kv_starved",
            severity="warning",
            worker_id="w-1",
            details={"running": 1},
        ),
        s.KvDumpRequest(worker_id="w-1"),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    assert s.decode(type(msg), s.encode(msg)) == msg


def _batch(**overrides) -> dict:
    base = {
        "v": 1,
        "worker_id": "w1",
        "instance_id": "i1",
        "seq": 0,
        "ts": 1.0,
        "events": [{"type": "stored", "keys": [1, 2], "parent_key": None, "block_size": 16}],
    }
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\xc1\xc1\xc1", "malformed msgpack"),
        (b"", "malformed msgpack"),
        (msgpack.packb([1, 2, 3]), "Expected `object`"),
        (msgpack.packb(_batch(v=2)), "unsupported schema version"),
        (msgpack.packb(_batch(seq=-1)), "seq"),
        (msgpack.packb(_batch(seq="1")), "seq"),
        (msgpack.packb({k: v for k, v in _batch().items() if k != "worker_id"}), "worker_id"),
        (msgpack.packb(_batch(worker_id="a.b")), "worker_id"),
        (msgpack.packb(_batch(worker_id="")), "worker_id"),
        (msgpack.packb(_batch(events=[{"type": "bogus"}])), "type"),
        (
            msgpack.packb(_batch(events=[{"type": "stored", "keys": [-1], "block_size": 16}])),
            "keys",
        ),
        (
            msgpack.packb(_batch(events=[{"type": "stored", "keys": ["x"], "block_size": 16}])),
            "keys",
        ),
        (
            msgpack.packb(_batch(events=[{"type": "stored", "keys": [1], "block_size": 0}])),
            "block_size",
        ),
        (msgpack.packb(_batch(events=[{"type": "removed", "keys": [1], "tier": "tape"}])), "tier"),
        (msgpack.packb(_batch(events="nope")), "events"),
    ],
)
def test_malformed_batch_rejected(data: bytes, needle: str) -> None:
    with pytest.raises(s.SchemaError) as err:
        s.decode(s.KvEventBatch, data)
    assert "KvEventBatch" in str(err.value)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("msg_type", "payload", "needle"),
    [
        (
            s.WorkerHeartbeat,
            {"worker_id": "w", "instance_id": "i", "url": "u", "model": "m"},
            "capacity",
        ),
        (
            s.WorkerHeartbeat,
            {
                "worker_id": "w",
                "instance_id": "i",
                "url": "u",
                "model": "m",
                "capacity": {
                    "block_size": 16,
                    "num_gpu_blocks": -3,
                    "max_num_seqs": 1,
                    "max_model_len": 1,
                },
            },
            "num_gpu_blocks",
        ),
        (s.WorkerLoad, {"worker_id": "w", "ts": 1.0, "kv_usage": 1.5}, "kv_usage"),
        (s.WorkerLoad, {"worker_id": "w", "ts": 1.0, "running": -1}, "running"),
        (s.WorkerControl, {"worker_id": "w", "action": "explode"}, "action"),
        (s.Alert, {"fingerprint": "", "kind": "k", "severity": "warning"}, "fingerprint"),
        (s.Alert, {"fingerprint": "f", "kind": "k", "severity": "apocalyptic"}, "severity"),
        (s.RouterLoad, {"router_id": "r", "ts": 1.0, "inflight": {"w": -2}}, "inflight"),
        (s.PolicyUpdated, {"revision": 1, "name": "p", "version": 1}, "spec"),
    ],
)
def test_malformed_messages_rejected(msg_type, payload, needle) -> None:
    with pytest.raises(s.SchemaError) as err:
        s.decode(msg_type, msgpack.packb(payload))
    assert needle in str(err.value)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    payload = _batch(new_field_from_v1_1="hello")
    batch = s.decode(s.KvEventBatch, msgpack.packb(payload))
    assert batch.seq == 0 and batch.events[0].keys == [1, 2]


def test_a_batched_type_decodes_from_one_message_or_an_array() -> None:
    """``decode_all``: a RouterOutcome alone or a msgpack array of them (as another msgpack
    library writes it: the format is the contract, not our encoder); every element is
    validated and version-checked, one bad element rejects the message."""
    o = {"request_id": "r", "router_id": "rt", "ts": 1.0, "policy": "p", "v": s.SCHEMA_VERSION}
    one = s.decode_all(s.RouterOutcome, msgpack.packb(o))
    many = s.decode_all(s.RouterOutcome, msgpack.packb([o, {**o, "request_id": "r2"}]))
    assert [x.request_id for x in one] == ["r"]
    assert [x.request_id for x in many] == ["r", "r2"]
    assert s.decode_all(s.RouterOutcome, msgpack.packb([])) == []
    assert s.decode_all(s.RouterOutcome, s.encode_batch([s.encode(x) for x in many])) == many
    with pytest.raises(s.SchemaError, match=r"RouterOutcome.*\$\[1\]\.ts"):
        s.decode_all(s.RouterOutcome, msgpack.packb([o, {**o, "ts": "soon"}]))
    with pytest.raises(s.SchemaError, match="unsupported schema version v=99"):
        s.decode_all(s.RouterOutcome, msgpack.packb([o, {**o, "v": 99}]))
    # a type that never travels in arrays
    load = {"router_id": "r1", "ts": 1.0, "v": s.SCHEMA_VERSION}
    assert len(s.decode_all(s.RouterLoad, msgpack.packb(load))) == 1
    with pytest.raises(s.SchemaError, match="RouterLoad: Expected `object`, got `array`"):
        s.decode_all(s.RouterLoad, msgpack.packb([load]))
