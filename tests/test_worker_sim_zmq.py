"""The vLLM-format ZMQ KV event stream, read by a plain zmq + msgpack subscriber (no kvgate
code on the reading side), and the replay ROUTER socket."""

from __future__ import annotations

import asyncio

import msgpack
import openai
import pytest
import zmq
import zmq.asyncio

from services.common.embedded import free_port
from services.core.keys import block_keys
from tests.test_worker_sim_support import sim_worker

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 bytes: 11 full blocks


def ports() -> tuple[int, int]:
    a = free_port()
    b = free_port()
    while b == a:
        b = free_port()
    return a, b


async def drive_until_received(sub, url: str, timeout: float = 10.0) -> list[list[bytes]]:
    """Send requests until the SUB socket (slow joiner) gets messages; return them all."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got: list[list[bytes]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    i = 0
    try:
        while not got:
            if loop.time() > deadline:
                raise AssertionError("no ZMQ message received")
            await c.completions.create(model="m", prompt=f"{i:03d} " + PROMPT, max_tokens=3)
            i += 1
            while await sub.poll(200):
                got.append(await sub.recv_multipart())
    finally:
        await c.close()
    return got


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            out.append(frames)
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                return out
    finally:
        dealer.close()


@pytest.mark.parametrize(
    ("form", "hash_mode", "topic_frame", "batch_form"),
    [
        ("map", "uint64", False, "array"),
        ("array", "int64", True, "array"),
        ("map", "bytes32", False, "map"),
    ],
)
async def test_vllm_wire_format_live_and_replay(
    form: str, hash_mode: str, topic_frame: bool, batch_form: str
):
    pub_port, replay_port = ports()
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    async with sim_worker(
        worker_id="z0",
        model="llama-sim",
        zmq_port=pub_port,
        zmq_replay_port=replay_port,
        zmq_event_form=form,
        zmq_hash=hash_mode,
        zmq_replay_topic_frame=topic_frame,
        zmq_batch_form=batch_form,
    ) as w:
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        try:
            live = await drive_until_received(sub, w.url)
        finally:
            sub.close()
        for frames in live:
            assert len(frames) == 3
            assert frames[0] == b"kv@z0@llama-sim"
            assert len(frames[1]) == 8
        seqs = [int.from_bytes(f[1], "big") for f in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        # replay everything from seq 0: batches in order, then the end marker
        rep = await replay(f"tcp://127.0.0.1:{replay_port}", 0)
        end = rep.pop()
        if topic_frame:
            assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            assert all(len(f) == 4 and f[1] == b"kv@z0@llama-sim" for f in rep)
            rep = [[f[0], f[2], f[3]] for f in rep]
        else:
            assert end == [b"", (-1).to_bytes(8, "big", signed=True), b""]
            assert all(len(f) == 3 for f in rep)
        assert all(f[0] == b"" for f in rep)
        rseqs = [int.from_bytes(f[1], "big") for f in rep]
        assert rseqs == list(range(w.kv_seq + 1))
        by_seq = {int.from_bytes(f[1], "big"): f[2] for f in rep}
        for frames in live:  # live and replayed payloads are identical
            assert by_seq[int.from_bytes(frames[1], "big")] == frames[2]

        # decode with plain msgpack: [ts, events, dp_rank]
        stored_tokens: list[list[int]] = []
        stored_hashes: list = []
        all_hashes: set = set()
        first_events = None
        for seq in sorted(by_seq):
            batch = msgpack.unpackb(by_seq[seq], raw=False)
            if batch_form == "map":
                ts, events, dp_rank = batch["ts"], batch["events"], batch["data_parallel_rank"]
            else:
                ts, events, dp_rank = batch
            assert isinstance(ts, float) and dp_rank == 0
            if first_events is None:
                first_events = events
            for ev in events:
                if form == "map":
                    tag = ev["type"]
                    fields = ev
                else:
                    tag = ev[0]
                    names = {
                        "BlockStored": [
                            "block_hashes",
                            "parent_block_hash",
                            "token_ids",
                            "block_size",
                            "lora_id",
                            "medium",
                            "lora_name",
                        ],
                        "BlockRemoved": ["block_hashes", "medium"],
                        "AllBlocksCleared": [],
                    }[tag]
                    assert len(ev) == 1 + len(names)
                    fields = dict(zip(names, ev[1:], strict=True))
                if tag == "BlockStored":
                    assert fields["block_size"] == 16 and fields["medium"] == "GPU"
                    assert fields["lora_id"] is None and fields["lora_name"] is None
                    assert len(fields["token_ids"]) == 16 * len(fields["block_hashes"])
                    stored_tokens.append(fields["token_ids"])
                    stored_hashes.append(fields["block_hashes"])
                    all_hashes.update(
                        h if not isinstance(h, bytes | bytearray) else bytes(h)
                        for h in fields["block_hashes"]
                    )
                    if fields["parent_block_hash"] is not None:
                        p = fields["parent_block_hash"]
                        assert (bytes(p) if isinstance(p, bytes | bytearray) else p) in all_hashes
        expect_first = {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]
        assert first_events == [expect_first]
        # the first request's prompt blocks, with its token ids
        first_prompt = list(("000 " + PROMPT).encode())
        assert stored_tokens[0][: 16 * 11] == first_prompt[: 16 * 11]
        # engine hashes have the requested type and differ from the canonical keys
        canonical = set(block_keys(first_prompt, 16))
        for h in stored_hashes[0]:
            if hash_mode == "uint64":
                assert isinstance(h, int) and 0 <= h < 2**64
            elif hash_mode == "int64":
                assert isinstance(h, int) and -(2**63) <= h < 2**63
            else:
                assert isinstance(h, bytes) and len(h) == 32
            assert h not in canonical
        if hash_mode == "int64":
            assert any(h < 0 for hs in stored_hashes for h in hs)

        # replay from the middle returns only the tail
        mid = w.kv_seq // 2
        tail = await replay(f"tcp://127.0.0.1:{replay_port}", mid)
        seq_frame = 2 if topic_frame else 1
        assert [int.from_bytes(f[seq_frame], "big") for f in tail[:-1]] == list(
            range(mid, w.kv_seq + 1)
        )


async def test_removed_events_name_the_stored_engine_hashes():
    pub_port, replay_port = ports()
    async with sim_worker(
        worker_id="z1",
        zmq_port=pub_port,
        zmq_replay_port=replay_port,
        engine={"num_gpu_blocks": 24},
    ) as w:
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        for i in range(5):
            await c.completions.create(model="m", prompt=f"{i} " + PROMPT, max_tokens=8)
        await c.close()
        rep = await replay(f"tcp://127.0.0.1:{replay_port}", 0)
        held: set[int] = set()
        removed_any = False
        for _, _seq, payload in rep[:-1]:
            _, events, _ = msgpack.unpackb(payload)
            for ev in events:
                if ev["type"] == "BlockStored":
                    held.update(ev["block_hashes"])
                elif ev["type"] == "BlockRemoved":
                    assert set(ev["block_hashes"]) <= held  # only what was stored
                    held.difference_update(ev["block_hashes"])
                    removed_any = True
        assert removed_any
        assert len(held) == w.engine.num_cached_blocks
