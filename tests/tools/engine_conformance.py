"""Conformance of `kvgate bridge` against the engines' own KV-event publishers.

    python -m tests.tools.engine_conformance [--cache-dir DIR] [--record] [--nats-url URL]

Downloads the vLLM 0.22.0, vLLM 0.33.0 and SGLang 0.5.23 wheels (``pip download --no-deps``)
into a cache directory outside the repository, extracts each one's ``kv_events.py`` and drives
its real ``ZmqEventPublisher`` (PUB socket + ROUTER replay socket, its own msgspec encoding
of its own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` classes) into the
bridge (the code `kvgate bridge` runs) and a real indexer over NATS. Every case checks that
the index holds exactly the blocks the engine holds ("the truth": canonical keys computed
from the tokens the case stored) and that what had to be dropped was counted.

The modules are loaded as they are. Their imports of unrelated engine internals are met with
minimal stand-ins (``STANDINS`` below): vLLM's logger, its config dataclass (the publisher
records its settings in it), its network helpers (node IP for ``tcp://*:0`` binds), the
``ExternalBlockHash`` type alias; SGLang's parallel-rank context and address parser. None of
them touches how events are encoded, framed, sequenced or replayed.

``--record`` writes what each publisher emitted (byte-exact payloads, topic, replay framing)
to ``tests/fixtures/engine_kv/<engine>-<version>.msgpack``; tests/test_bridge_conformance.py
plays those bytes through the same cases without any download.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
import types
import uuid
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects
from services.core.keys import block_keys, block_seed
from services.kv_indexer.bridges.runtime import BridgeRuntime
from services.kv_indexer.bridges.zmq_bridge import ZmqBridge

ENGINES = (  # (name, package version, path of kv_events.py in the wheel)
    ("vllm", "0.22.0", "vllm/distributed/kv_events.py"),
    ("vllm", "0.33.0", "vllm/distributed/kv_events.py"),
    ("sglang", "0.5.23", "sglang/srt/disaggregation/kv_events.py"),
)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_kv"
END = (-1).to_bytes(8, "big", signed=True)
TOKENS = list(range(20_000, 20_000 + 16 * 64))
B = 16  # the engines' block size in these cases


# --------------------------------------------------------------------------- engine modules


def _standins() -> None:
    """Stand-ins for the engine internals kv_events.py imports (see module docstring)."""

    def mod(name: str, **attrs: Any) -> None:
        m = sys.modules.get(name) or types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = m

    class KVEventsConfig:  # vllm.config.kv_events: only records the publisher's settings
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    class NetworkAddress:  # sglang.srt.utils.network: host:port parsing for advertising
        def __init__(self, host: str, port: int) -> None:
            self.host, self.port, self.is_ipv6 = host, port, ":" in host

        @classmethod
        def parse(cls, text: str) -> NetworkAddress:
            host, _, port = text.rpartition(":")
            return cls(host.strip("[]"), int(port))

        def to_tcp(self) -> str:
            return f"tcp://{self.host}:{self.port}"

    ranks = types.SimpleNamespace(
        pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=0
    )
    for pkg in (
        "vllm",
        "vllm.config",
        "vllm.utils",
        "vllm.v1",
        "vllm.v1.core",
        "sglang",
        "sglang.srt",
        "sglang.srt.utils",
    ):
        mod(pkg)
    mod("vllm.logger", init_logger=logging.getLogger)
    mod("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    mod(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda p: ("tcp", *p.removeprefix("tcp://").rsplit(":", 1)),
    )
    mod("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    mod("sglang.srt.runtime_context", get_parallel=lambda: ranks)
    mod("sglang.srt.utils.network", NetworkAddress=NetworkAddress)


def load_engine_module(path: Path, tag: str) -> types.ModuleType:
    _standins()
    spec = importlib.util.spec_from_file_location(f"kvgate_conformance_{tag}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fetch_engine(cache: Path, name: str, version: str, member: str) -> Path:
    """``kv_events.py`` of the engine's wheel, downloaded once into ``cache``."""
    out = cache / f"{name}-{version}" / member
    if out.exists():
        return out
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                f"{name}=={version}",
                "-d",
                str(wheels),
            ],
            check=True,
        )
        found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(z.read(member))
    return out


# --------------------------------------------------------------------------- events


@dataclass
class Ev:
    """One event a case asks the engine to publish (built with the engine's own classes)."""

    kind: str  # stored | removed | cleared | future
    hashes: list[int] = field(default_factory=list)  # block ids, turned into engine hashes
    parent: int | None = None
    tokens: list[Any] = field(default_factory=list)
    block_size: int = B
    fields: dict[str, Any] = field(default_factory=dict)


class NotApplicable(Exception):
    """The engine's event classes lack a field the case needs."""


def engine_hash(flavor: str, i: int) -> int | bytes:
    raw = hashlib.sha256(f"{flavor}-{i}".encode()).digest()
    if flavor == "vllm-0.33.0":
        return raw  # sha256 block hashes
    u = int.from_bytes(raw[:8], "big")
    if flavor.startswith("sglang"):
        return u - (1 << 64) if u >= 1 << 63 else u  # signed int64
    return u


class EngineEvents:
    """Builds the engine's own event and batch objects."""

    def __init__(self, module: types.ModuleType, flavor: str) -> None:
        self.m, self.flavor = module, flavor

        class KvCacheFutureEvent(module.KVCacheEvent):  # an event type this bridge never saw
            note: str = "from a later engine version"

        self.future_cls = KvCacheFutureEvent

    def _make(self, cls: type, **kw: Any) -> Any:
        known = set(cls.__struct_fields__)
        missing = [k for k in kw if k not in known]
        if missing:
            raise NotApplicable(f"{cls.__name__} has no {missing}")
        return cls(**kw)

    def build(self, ev: Ev) -> Any:
        h = [engine_hash(self.flavor, i) for i in ev.hashes]
        if ev.kind == "stored":
            p = None if ev.parent is None else engine_hash(self.flavor, ev.parent)
            base: dict[str, Any] = dict(
                block_hashes=h,
                parent_block_hash=p,
                token_ids=ev.tokens,
                block_size=ev.block_size,
                lora_id=None,
                medium="GPU",
            )
            if "lora_name" in self.m.BlockStored.__struct_fields__:
                base["lora_name"] = None
            return self._make(self.m.BlockStored, **{**base, **ev.fields})
        if ev.kind == "removed":
            return self._make(self.m.BlockRemoved, block_hashes=h, medium="GPU", **ev.fields)
        if ev.kind == "cleared":
            return self.m.AllBlocksCleared()
        return self.future_cls()

    def batch(self, events: list[Ev]) -> Any:
        return self.m.KVEventBatch(ts=time.time(), events=[self.build(e) for e in events])


# --------------------------------------------------------------------------- publishers


class LivePublisher:
    """The engine's real ZmqEventPublisher; records every payload it buffered."""

    def __init__(
        self, module: types.ModuleType, flavor: str, *, buffer_steps: int, bind_to: str | None
    ) -> None:
        self.m, self.flavor = module, flavor
        self.events = EngineEvents(module, flavor)
        self.buffer_steps = buffer_steps
        self.bind_to = bind_to
        self.recorded: list[bytes] = []
        self.topic = b"kv@pod@model"
        self._start()

    def _start(self) -> None:
        pub_port, replay_port = free_port(), free_port()
        # bind mode: the engine's endpoint has no '*', so its PUB connects to the bridge
        endpoint = self.bind_to or f"tcp://*:{pub_port}"
        kw = dict(
            endpoint=endpoint,
            replay_endpoint=f"tcp://*:{replay_port}",
            buffer_steps=self.buffer_steps,
            topic=self.topic.decode(),
        )
        rank = "attn_dp_rank" if self.flavor.startswith("sglang") else "data_parallel_rank"
        self.pub = self.m.ZmqEventPublisher(**{rank: 0}, **kw)
        self.endpoint = self.bind_to or f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.published = 0

    async def publish(self, events: list[Ev]) -> None:
        self.pub.publish(self.events.batch(events))
        self.published += 1
        deadline = time.monotonic() + 10
        while not self.pub._buffer or self.pub._buffer[-1][0] != self.published - 1:
            assert time.monotonic() < deadline, "engine publisher did not publish"
            await asyncio.sleep(0.005)
        self.recorded.append(self.pub._buffer[-1][1])

    async def restart(self) -> None:
        """A new engine process on the same endpoints (seq from 0, empty buffer)."""
        replay = self.replay_endpoint
        self.pub.shutdown()
        port = int(replay.rsplit(":", 1)[1])
        pub_port = int(self.endpoint.rsplit(":", 1)[1])
        endpoint = self.bind_to or f"tcp://*:{pub_port}"
        rank = "attn_dp_rank" if self.flavor.startswith("sglang") else "data_parallel_rank"
        for attempt in range(100):  # the closed sockets release their ports asynchronously
            try:
                self.pub = self.m.ZmqEventPublisher(
                    **{rank: 0},
                    endpoint=endpoint,
                    replay_endpoint=f"tcp://*:{port}",
                    buffer_steps=self.buffer_steps,
                    topic=self.topic.decode(),
                )
                break
            except zmq.ZMQError:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.05)
        self.published = 0

    def close(self) -> None:
        self.pub.shutdown()

    def replay_sample(self) -> list[bytes]:
        """The frames the engine's ROUTER answers a replay from seq 0 with (DEALER side)."""
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.replay_endpoint)
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            assert s.poll(5000), "no replay answer"
            return s.recv_multipart()
        finally:
            s.close(linger=0)


class FixturePublisher:
    """Plays recorded payloads with the recorded framing: PUB ``[topic, seq, payload]`` and a
    ROUTER replay socket answering like the engine's."""

    def __init__(
        self,
        recorded: list[bytes],
        topic: bytes,
        replay_topic_frame: bool,
        *,
        buffer_steps: int,
        bind_to: str | None,
    ) -> None:
        self.recorded = collections.deque(recorded)
        self.topic, self.topic_frame = topic, replay_topic_frame
        self.buffer_steps, self.bind_to = buffer_steps, bind_to
        self.ctx = zmq.asyncio.Context.instance()
        self.task: asyncio.Task[None] | None = None
        self._start()

    def _start(self, pub_port: int | None = None, replay_port: int | None = None) -> None:
        pub_port, replay_port = pub_port or free_port(), replay_port or free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.bind_to:
            self.pub.connect(self.bind_to)
        else:
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.endpoint = self.bind_to or f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=self.buffer_steps
        )
        self.seq = -1
        self.task = asyncio.get_event_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            s = int.from_bytes(start, "big")
            mid = [self.topic] if self.topic_frame else []
            for seq, payload in list(self.buffer):
                if seq >= s:
                    await self.router.send_multipart(
                        [client, b"", *mid, seq.to_bytes(8, "big"), payload]
                    )
            end = [client, b"", b"", END, b""] if self.topic_frame else [client, b"", END, b""]
            await self.router.send_multipart(end)

    async def publish(self, events: list[Ev]) -> None:
        payload = self.recorded.popleft()
        self.seq += 1
        self.buffer.append((self.seq, payload))
        await self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])

    async def _stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def restart(self) -> None:
        pub_port = None if self.bind_to else int(self.endpoint.rsplit(":", 1)[1])
        replay_port = int(self.replay_endpoint.rsplit(":", 1)[1])
        await self._stop()
        for _ in range(100):  # the closed sockets release their ports asynchronously
            try:
                self._start(pub_port, replay_port)
                return
            except zmq.ZMQError:
                for sock in (getattr(self, "pub", None), getattr(self, "router", None)):
                    if sock is not None:
                        sock.close(linger=0)
                await asyncio.sleep(0.05)
        raise RuntimeError("engine ports stayed busy after the restart")

    async def aclose(self) -> None:
        await self._stop()


# --------------------------------------------------------------------------- bridge harness


class BridgeHarness:
    """The bridge `kvgate bridge vllm|sglang` runs, with its ZMQ loop pausable (batches
    published while paused are lost to it, as on a flaky link or during a bridge outage)."""

    def __init__(
        self,
        bus: Bus,
        worker: str,
        engine: str,
        endpoint: str,
        replay: str,
        bind: bool,
        *,
        heartbeat_s: float = 0.1,
        tail_check_s: float = 0.3,
        engine_url: str = "",
    ) -> None:
        self.rt = BridgeRuntime(
            bus,
            worker,
            engine=engine,
            model="m",
            engine_url=engine_url,
            heartbeat_s=heartbeat_s,
            block_size=B,
        )
        self.zb = ZmqBridge(
            self.rt, endpoint, replay, topic="kv@", bind=bind, tail_check_s=tail_check_s
        )
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.rt.start()
        await self.resume()

    async def resume(self) -> None:
        self._stop = asyncio.Event()
        self.zb.subscribed.clear()
        self._task = asyncio.create_task(self.zb.run(self._stop))
        await self.zb.subscribed.wait()

    async def pause(self) -> None:
        assert self._stop is not None and self._task is not None
        self._stop.set()
        await self._task

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pause()
        await self.rt.stop()


# --------------------------------------------------------------------------- cases


def toks(block: int, n: int = 1) -> list[int]:
    return TOKENS[B * block : B * (block + n)]


def keys(first: int, n: int, *, lora: str | None = None, salt: str | None = None) -> set[int]:
    """Canonical keys of blocks ``first..first+n-1`` of a chain rooted at block ``first``."""
    return set(block_keys(toks(first, n), B, block_seed(0, lora, salt)))


@dataclass
class Case:
    name: str
    run: Callable[[Ctx], Awaitable[set[int]]]  # publishes, returns the truth
    engines: tuple[str, ...] = ("vllm", "sglang")
    buffer_steps: int = 10_000
    bind: bool = False
    counts: dict[str, int] = field(default_factory=dict)  # bridge bad-input counts, exact
    skipped: dict[str, int] = field(default_factory=dict)
    resets: dict[str, int] = field(default_factory=dict)
    bridge_late: bool = False  # start the bridge after the case has published


class Ctx:
    def __init__(self, pub: Any, harness: BridgeHarness | None, start_bridge: Callable) -> None:
        self.pub, self.harness, self._start_bridge = pub, harness, start_bridge

    async def publish(self, *events: Ev, lost: bool = False) -> None:
        if lost and self.harness is not None:
            await self.harness.pause()
        await self.pub.publish(list(events))
        if lost and self.harness is not None:
            await self.harness.resume()

    async def start_bridge(self) -> None:
        self.harness = await self._start_bridge()


def S(hashes: list[int], parent: int | None, first_block: int, **kw: Any) -> Ev:
    bs = kw.pop("block_size", B)
    n_tok = len(hashes) * bs
    return Ev("stored", hashes, parent, TOKENS[B * first_block : B * first_block + n_tok], bs, kw)


async def case_basic(c: Ctx) -> set[int]:
    await c.publish(S([0, 1], None, 0))
    await c.publish(S([2, 3], 1, 2))
    await c.publish(Ev("removed", [3]))
    return keys(0, 3)


async def case_unknown_event_type(c: Ctx) -> set[int]:
    await c.publish(Ev("future"), S([0, 1], None, 0), Ev("future"))
    return keys(0, 2)


async def case_salt(c: Ctx, flavor: str) -> set[int]:
    if flavor.startswith("sglang"):
        await c.publish(S([0, 1], None, 0, cache_salt="tenant-a"))
    else:  # vLLM: the salt is in the first block's extra_keys
        await c.publish(S([0, 1], None, 0, extra_keys=[("tenant-a",), None]))
    await c.publish(S([10], None, 0))  # the same tokens unsalted: another key
    return keys(0, 2, salt="tenant-a") | keys(0, 1)


async def case_group_idx(c: Ctx) -> set[int]:
    await c.publish(
        S([0, 1, 2], None, 0, group_idx=0, kv_cache_spec_kind="full_attention"),
        S([0, 1, 2], None, 0, group_idx=1, kv_cache_spec_kind="sliding_window"),
    )
    await c.publish(Ev("removed", [0, 1], fields={"group_idx": 1}))  # window slides
    return keys(0, 3)


async def case_group_idx_unlabelled(c: Ctx) -> set[int]:
    await c.publish(S([0, 1, 2], None, 0, group_idx=0), S([0, 1, 2], None, 0, group_idx=1))
    await c.publish(Ev("removed", [0, 1], fields={"group_idx": 1}))
    return keys(0, 3)


async def case_mixed_block_sizes(c: Ctx) -> set[int]:
    await c.publish(
        S([0], None, 0),
        S([1, 2], 0, 1, block_size=2 * B, group_idx=1),  # 32-token blocks of another group
        S([3], 2, 5, block_size=B // 2),  # a partial block: cannot be keyed at 16, counted
    )
    return keys(0, 5)


async def case_bigram_pages(c: Ctx) -> set[int]:
    pairs = [[t, t + 1] for t in toks(0)]
    await c.publish(Ev("stored", [9], None, pairs, B), S([0, 1], None, 0))
    return keys(0, 2)


async def case_lookahead(c: Ctx) -> set[int]:
    await c.publish(S([5], None, 5, lookahead_token_ids=[toks(6)[:4]]), S([0], None, 0))
    return keys(0, 1)


async def case_remote_medium(c: Ctx, flavor: str) -> set[int]:
    remote = {"medium": "EXTERNAL"} if flavor.startswith("sglang") else {"locality": "REMOTE"}
    await c.publish(S([5], None, 5, **remote), S([0], None, 0))
    return keys(0, 1)


async def case_restart_lost_first_batches(c: Ctx) -> set[int]:
    await c.publish(S([0], None, 0))
    await c.publish(S([1], 0, 1))
    await c.publish(S([2], 1, 2))
    assert c.harness is not None
    await c.harness.pause()
    await c.pub.restart()
    for i in range(5):  # the new process's first batches: nobody receives them
        await c.pub.publish([S([100 + i], 100 + i - 1 if i else None, 20 + i)])
    await c.harness.resume()
    await c.publish(S([105], 104, 25))
    return keys(20, 6)


async def case_idle_bridge_start(c: Ctx) -> set[int]:
    await c.publish(S([0, 1], None, 0))
    await c.publish(S([2], 1, 2))
    await c.start_bridge()  # the engine is idle from now on
    return keys(0, 3)


async def case_short_replay_buffer(c: Ctx) -> set[int]:
    await c.publish(S([0], None, 0))
    await c.publish(S([1], 0, 1))
    await c.publish(S([2], 1, 2))  # its parent's batch falls out of the 2-batch buffer
    await c.publish(S([7], None, 7))
    await c.start_bridge()
    return keys(7, 1)


async def case_bind_mode(c: Ctx) -> set[int]:
    # the engine's PUB connects to the bridge and joins asynchronously: whatever it sends
    # before that is refilled from the replay socket
    for j in range(3):
        await c.publish(S([40 + j], None, 40 + j))
        await asyncio.sleep(0.02)  # pacing the publisher, not synchronisation
    await c.publish(S([0, 1], None, 0))
    return keys(0, 2) | keys(40, 1) | keys(41, 1) | keys(42, 1)


def cases_for(flavor: str) -> list[Case]:
    engine = flavor.split("-")[0]
    out = [
        Case("basic", case_basic),
        Case("unknown_event_type", case_unknown_event_type, counts={"unknown_event_type": 2}),
        Case("salt", lambda c: case_salt(c, flavor)),
        Case("group_idx", case_group_idx, engines=("vllm",), skipped={"non_prefix_group": 2}),
        Case("group_idx_unlabelled", case_group_idx_unlabelled, engines=("vllm",)),
        Case(
            "mixed_block_sizes",
            case_mixed_block_sizes,
            engines=("vllm",),
            counts={"block_size_mismatch": 1},
        ),
        Case("lookahead", case_lookahead, engines=("vllm",), counts={"lookahead_hash": 1}),
        Case("bigram_pages", case_bigram_pages, engines=("sglang",), counts={"bigram_page": 1}),
        Case(
            "remote_medium", lambda c: case_remote_medium(c, flavor), skipped={"remote_medium": 1}
        ),
        Case("restart_lost_first_batches", case_restart_lost_first_batches),
        Case("idle_bridge_start", case_idle_bridge_start, bridge_late=True),
        Case(
            "short_replay_buffer",
            case_short_replay_buffer,
            bridge_late=True,
            buffer_steps=2,
            counts={"seq_gap_unrecovered": 1, "unknown_parent": 1},
            resets={"lost_history": 1},
        ),
        Case("bind_mode", case_bind_mode, bind=True),
    ]
    return [c for c in out if engine in c.engines]


async def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        await asyncio.sleep(0.01)


@dataclass
class CaseResult:
    name: str
    ok: bool
    detail: str = ""
    recorded: list[bytes] = field(default_factory=list)
    seconds: float = 0.0


async def run_case(
    case: Case,
    flavor: str,
    bus: Bus,
    svc: Any,
    make_publisher: Callable[[Case, str | None], Any],
) -> CaseResult:
    """One case: publisher + bridge (worker id of its own) + the shared indexer; the index
    must equal the truth, and the bridge's counts the case's expectations."""
    worker = f"{flavor.replace('.', '_')}-{case.name}"[:60]
    bind_to = f"tcp://127.0.0.1:{free_port()}" if case.bind else None
    pub = make_publisher(case, bind_to)
    engine = flavor.split("-")[0]
    harness: BridgeHarness | None = None

    async def start_bridge() -> BridgeHarness:
        nonlocal harness
        harness = BridgeHarness(
            bus, worker, engine, bind_to or pub.endpoint, pub.replay_endpoint, case.bind
        )
        await harness.start()
        await wait_for(lambda: harness is not None and harness.rt.ready, 10, "bridge ready")
        return harness

    t0 = time.monotonic()
    try:
        if not case.bridge_late:
            await start_bridge()
        ctx = Ctx(pub, harness, start_bridge)
        truth = await case.run(ctx)
        assert ctx.harness is not None
        rt = ctx.harness.rt

        def held() -> set[int]:
            idx = svc.core.index
            return {k for k in idx.keys() if idx.holds(worker, k)}

        try:
            await wait_for(lambda: held() == truth, 15, "index == truth")
        except AssertionError:
            got = held()
            return CaseResult(
                case.name,
                False,
                f"index has {len(got & truth)}/{len(truth)} "
                f"of the truth and {len(got - truth)} extra; counts "
                f"{dict(rt.rekeyer.counts)} resets {rt.resets}",
            )
        problems = []
        for label, want, have in (
            ("bad input", case.counts, dict(rt.rekeyer.counts)),
            ("skipped", case.skipped, dict(rt.rekeyer.skipped)),
        ):
            if {k: v for k, v in have.items() if k != "replay_failed"} != want:
                problems.append(f"{label} {have} != {want}")
        if case.resets and {k: rt.resets.get(k) for k in case.resets} != case.resets:
            problems.append(f"resets {rt.resets} != {case.resets}")
        return CaseResult(
            case.name, not problems, "; ".join(problems), seconds=time.monotonic() - t0
        )
    except NotApplicable as exc:
        return CaseResult(case.name, True, f"not applicable: {exc}")
    finally:
        if harness is not None:
            await harness.close()
        if isinstance(pub, FixturePublisher):
            await pub.aclose()
        else:
            pub.close()


@contextlib.asynccontextmanager
async def stack(nats_url: str) -> AsyncIterator[tuple[Bus, Any]]:
    """A bus and a real indexer in a namespace of their own."""
    from services.kv_indexer.app import IndexerService

    subjects = Subjects(f"conf{uuid.uuid4().hex[:8]}")
    bus = Bus(nats_url, "conformance", subjects)
    await bus.connect(max_wait_s=10)
    ibus = Bus(nats_url, "conformance-indexer", subjects)
    await ibus.connect(max_wait_s=10)
    try:
        await require_kv_events_stream(bus)
        svc = IndexerService(ibus, tick_s=0.02, heartbeat_timeout_s=60.0)
        await svc.start()
        await asyncio.wait_for(svc.consuming.wait(), 10)
        try:
            yield bus, svc
        finally:
            await svc.stop()
    finally:
        with contextlib.suppress(Exception):
            for info in await bus.js.streams_info():
                if info.config.name.startswith(subjects.stream("")):
                    await bus.js.delete_stream(info.config.name)
        await ibus.close()
        await bus.close()


def fixture_path(flavor: str) -> Path:
    return FIXTURES / f"{flavor}.msgpack"


def load_fixture(flavor: str) -> dict[str, Any]:
    return msgpack.unpackb(fixture_path(flavor).read_bytes(), raw=False)


async def run_fixture(flavor: str, bus: Bus, svc: Any) -> list[CaseResult]:
    """Every case of ``flavor`` from its recorded bytes (no engine code, no download)."""
    fx = load_fixture(flavor)

    def make(case: Case, bind_to: str | None) -> FixturePublisher:
        rec = fx["cases"][case.name]
        return FixturePublisher(
            rec["payloads"],
            fx["topic"],
            fx["replay_topic_frame"],
            buffer_steps=case.buffer_steps,
            bind_to=bind_to,
        )

    return [
        await run_case(c, flavor, bus, svc, make)
        for c in cases_for(flavor)
        if c.name in fx["cases"]
    ]


async def run_live(
    flavor: str, module: types.ModuleType, bus: Bus, svc: Any, record: bool
) -> list[CaseResult]:
    results: list[CaseResult] = []
    publishers: dict[str, LivePublisher] = {}

    def make(case: Case, bind_to: str | None) -> LivePublisher:
        p = LivePublisher(module, flavor, buffer_steps=case.buffer_steps, bind_to=bind_to)
        publishers[case.name] = p
        return p

    for case in cases_for(flavor):
        r = await run_case(case, flavor, bus, svc, make)
        r.recorded = publishers[case.name].recorded
        results.append(r)
    # the replay framing, as the engine's ROUTER really answers
    p = LivePublisher(module, flavor, buffer_steps=4, bind_to=None)
    try:
        await p.publish([S([0], None, 0)])
        frames = p.replay_sample()
    finally:
        p.close()
    topic_frame = len(frames) == 4  # [b"", topic, seq, payload] vs [b"", seq, payload]
    if record:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        doc = {
            "engine": flavor,
            "source": "recorded by tests/tools/engine_conformance.py --record from the "
            "engine wheel's own ZmqEventPublisher",
            "topic": p.topic,
            "replay_topic_frame": topic_frame,
            "replay_sample": frames,
            "cases": {r.name: {"payloads": r.recorded} for r in results if r.recorded},
        }
        fixture_path(flavor).write_bytes(msgpack.packb(doc, use_bin_type=True))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cache-dir",
        default=os.path.expanduser("~/.cache/kvgate-conformance"),
        help="where the engine wheels are downloaded (outside the repository)",
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="(re-)write tests/fixtures/engine_kv/*.msgpack from the real publishers",
    )
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--engine", action="append", help="only these (e.g. vllm-0.33.0)")
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir)
    logging.basicConfig(level=logging.WARNING)

    async def go() -> int:
        failed = 0
        async with stack(args.nats_url) as (bus, svc):
            for name, version, member in ENGINES:
                flavor = f"{name}-{version}"
                if args.engine and flavor not in args.engine:
                    continue
                path = fetch_engine(cache, name, version, member)
                module = load_engine_module(path, flavor.replace(".", "_").replace("-", "_"))
                for r in await run_live(flavor, module, bus, svc, args.record):
                    failed += not r.ok
                    print(
                        f"{flavor:14} {r.name:28} {'ok' if r.ok else 'FAIL'} "
                        f"{r.seconds:5.2f}s {r.detail}"
                    )
        return 1 if failed else 0

    return asyncio.run(go())


if __name__ == "__main__":
    raise SystemExit(main())
