"""Faults under load: real processes on loopback, a client sending all the time, 0 failures.

One stack for the module: three real nats-server processes as one JetStream cluster (owned by
the test, so it can kill and restart a node), and `kvgate up --nats-url <seeds> --indexers 2`
on it (2 simulated workers, the highly available indexer pair, api, telemetry, router). A
load client (8 threads, each one completion at a time, no retries) keeps sending through a
router for the whole of each test; a quarter of its prompts are new (their blocks are KV
events through JetStream), the rest come from a pool both workers already cache. Each test
asserts that no client request failed and prints what it measured:

- one NATS node (the standby indexer's) SIGKILLed for 30 s, then restarted: once
  it is back, a new prompt's blocks are in the router's index within 2 s;
- the active indexer SIGKILLed: the standby publishes deltas of a new epoch within 3 s, and
  the routers' index (the stack's router and a replica in this process) equals the workers'
  truth (their KV dumps) within 5 s of the kill;
- one of two router processes sharing a port (`kvgate router --processes 2`, SO_REUSEPORT)
  SIGKILLed: every request sent after it died succeeds; requests it was serving at that
  moment lose their connection (counted and printed: a client retries those).

Reproduce the figures: ``pytest -s -m slow tests/test_faults_under_load.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.embedded import EmbeddedNatsCluster, free_port
from services.common.index_replica import IndexReplica
from services.common.kvdump import fetch_kvdump
from services.common.schemas import BlockStored, IndexDelta, decode
from services.common.subjects import Subjects
from tests.up_stack import UpStack, pid_alive, processes_mentioning, up_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "sim-llama-8b"
WORKERS = ["sim-0", "sim-1"]
POOL = [f"pooled prompt {i}: " + " ".join(f"w{i}x{j}" for j in range(40)) for i in range(8)]


def _call(
    port: int,
    method: str,
    path: str,
    body: dict | None = None,
    timeout: float = 20.0,
    auth: dict[str, str] | None = None,
):
    """(status, parsed body or error text); status -1 when the connection failed. ``auth``:
    the client key header of a router that wants one."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json", **(auth or {})}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")[:300]
    except (OSError, http.client.HTTPException) as exc:
        return -1, repr(exc)
    finally:
        conn.close()


def _completion(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}


@dataclass
class Result:
    sent: float
    done: float
    status: int
    detail: str


@dataclass
class Load:
    """``threads`` clients, each sending one completion at a time to ``port`` until stopped;
    every request's outcome is recorded (no retries: a failure is a failure)."""

    port: int
    auth: dict[str, str] = field(default_factory=dict)  # the router's client key header
    threads: int = 8
    fresh_share: float = 0.25  # share of prompts never sent before (new blocks, KV events)
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ok_event: threading.Condition = field(default_factory=threading.Condition)

    def __enter__(self) -> Load:
        for t in range(self.threads):
            th = threading.Thread(target=self._run, args=(t,), daemon=True)
            th.start()
            self._workers.append(th)
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for th in self._workers:
            th.join(30)

    def _run(self, t: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            fresh = (n * self.threads + t) % 100 < self.fresh_share * 100
            prompt = (
                f"fresh {uuid.uuid4().hex} " + "new " * 30 if fresh else POOL[(n + t) % len(POOL)]
            )
            sent = time.monotonic()
            status, body = _call(
                self.port, "POST", "/v1/completions", _completion(prompt), auth=self.auth
            )
            r = Result(sent, time.monotonic(), status, "" if status == 200 else str(body)[:300])
            with self._ok_event:
                self.results.append(r)
                self._ok_event.notify_all()

    def await_ok(self, count: int, after: float, timeout: float = 60.0) -> None:
        """Wait until ``count`` requests sent at or after ``after`` have succeeded."""

        def enough() -> bool:
            return sum(1 for r in self.results if r.sent >= after and r.status == 200) >= count

        with self._ok_event:
            assert self._ok_event.wait_for(enough, timeout), f"load stalled: {self.summary()}"

    def failed(self, since: float = 0.0) -> list[Result]:
        return [r for r in self.results if r.sent >= since and r.status != 200]

    def summary(self) -> str:
        if not self.results:
            return "no requests"
        span = max(r.done for r in self.results) - min(r.sent for r in self.results)
        ok = sum(r.status == 200 for r in self.results)
        return (
            f"{len(self.results)} requests in {span:.1f}s ({len(self.results) / span:.0f}/s), "
            f"{ok} ok, {len(self.results) - ok} failed"
        )


def _await(cond: Callable[[], object], timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {got!r})")


@dataclass
class Stack:
    nats: EmbeddedNatsCluster
    up: UpStack
    prefix: str
    state: Path

    @property
    def router(self) -> int:
        return self.up.ports["router"]

    @property
    def operator(self) -> int:
        return self.up.ports["router-operator"]

    def indexers(self) -> dict[str, int]:
        """Child name -> port of each indexer (from the stack file)."""
        ports = json.loads((self.state / "stack.json").read_text())["ports"]
        return {k: v for k, v in ports.items() if k.startswith("indexer")}

    def indexer_pid(self, child: str) -> int:
        """The running process of an indexer child (the stack file's pid is stale once the
        supervisor restarted it)."""
        port = self.indexers()[child]
        found = processes_mentioning(f"services.cli indexer --port {port}")
        assert len(found) == 1, found
        return int(found[0].split(":", 1)[0])

    def bus(self, name: str) -> Bus:
        return Bus(self.nats.url, name, Subjects(self.prefix))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("faults")
    nats = EmbeddedNatsCluster(root / "nats", size=3)
    nats.start()
    prefix = f"flt{uuid.uuid4().hex[:8]}"
    up = UpStack(
        root / "state",
        workers=len(WORKERS),
        indexers=2,
        args=["--nats-url", nats.url, "--database-url", database_url, "--subject-prefix", prefix],
    )
    try:
        up.banner()
        s = Stack(nats, up, prefix, root / "state")
        # both workers cache every pooled prompt (sent to each directly), so pooled requests
        # add no blocks: the truth only moves with fresh prompts
        for i in range(len(WORKERS)):
            for p in POOL:
                status, body = _call(up.ports["sim"] + i, "POST", "/v1/completions", _completion(p))
                assert status == 200, body
        yield s
    finally:
        up.stop()
        nats.stop()


def _active_indexer(s: Stack) -> tuple[str, dict] | None:
    healths = {}
    for name, port in s.indexers().items():
        status, h = _call(port, "GET", "/health", timeout=2)
        if status != 200:
            return None
        healths[name] = h
    active = [n for n, h in healths.items() if h["active"]]
    return (active[0], healths) if len(active) == 1 else None


def _overlap(s: Stack, prompt: str) -> int:
    status, explain = _call(s.operator, "POST", "/debug/route", {"model": MODEL, "prompt": prompt})
    return max((explain.get("overlap_blocks") or {}).values(), default=0) if status == 200 else 0


def test_one_of_three_nats_nodes_killed_for_30s_under_load(stack: Stack) -> None:
    # the node the standby indexer is connected to: it must keep its lease loop through the
    # reconnect (next test: it takes over from the active one)
    standby = _await(lambda: _active_indexer(stack), 30, "one active indexer of two")[1]
    standby = next(n for n, h in standby.items() if not h["active"])
    health = _await(
        lambda: (h := _call(stack.indexers()[standby], "GET", "/health")[1])["nats_server"] and h,
        10,
        "the standby's NATS server",
    )
    server = health["nats_server"]
    victim = next(i for i, n in enumerate(stack.nats.nodes) if f"{n.host}:{n.port}" == server)
    node = stack.nats.nodes[victim].server_name
    with Load(stack.router, stack.up.auth()) as load:
        load.await_ok(40, after=0.0)
        stack.nats.nodes[victim].kill()  # a crash: no lame-duck goodbye to the clients
        killed_at = time.monotonic()
        load.await_ok(40, after=killed_at)  # the stack serves without it...
        time.sleep(max(0.0, killed_at + 30.0 - time.monotonic()))  # ...for the fault's 30 s
        down_s = time.monotonic() - killed_at
        stack.nats.nodes[victim].start()
        stack.nats.wait_healthy(60, nodes=[victim])
        recovered_at = time.monotonic()
        # fresh after recovery: a new prompt's blocks reach the router's index
        prompt = f"fresh after recovery {uuid.uuid4().hex} " + " ".join(f"t{i}" for i in range(300))
        status, body = _call(
            stack.router, "POST", "/v1/completions", _completion(prompt), auth=stack.up.auth()
        )
        assert status == 200, body
        _await(lambda: _overlap(stack, prompt) > 0, 10, "the new prompt's blocks in the index")
        fresh_s = time.monotonic() - recovered_at
        load.await_ok(40, after=time.monotonic())
    during = [r for r in load.results if killed_at <= r.sent < recovered_at]
    print(
        f"\nNATS node {node} (the standby indexer's) down {down_s:.1f}s: {load.summary()}; "
        f"{len(during)} requests while it was down; new prompt in the router's index "
        f"{fresh_s:.2f}s after the node was back"
    )
    assert load.failed() == [], load.failed()[:5]
    assert len(during) >= 100, f"too little load while the node was down: {len(during)}"
    assert fresh_s <= 2.0, fresh_s


def test_active_indexer_killed_under_load(stack: Stack) -> None:
    active, _ = _await(lambda: _active_indexer(stack), 30, "one active indexer of two")
    ports = stack.indexers()

    async def run() -> tuple[float, float, float, Load]:
        bus = stack.bus("faults-indexer")
        await bus.connect(max_wait_s=10)
        replica = IndexReplica(bus)  # a router's copy of the index, beside the stack's router
        new_epoch_at: list[float] = []
        new_epoch = asyncio.Event()
        sub = None
        try:
            await replica.start()
            await asyncio.wait_for(replica.ready.wait(), 20)
            old_epoch = replica.epoch

            async def on_delta(msg) -> None:
                if decode(IndexDelta, msg.data).epoch != old_epoch and not new_epoch_at:
                    new_epoch_at.append(time.monotonic())
                    new_epoch.set()

            sub = await bus.client.subscribe(bus.subjects.kv_index_delta, cb=on_delta)
            load = Load(stack.router, stack.up.auth()).__enter__()
            try:
                await asyncio.to_thread(load.await_ok, 40, 0.0)
                os.kill(stack.indexer_pid(active), signal.SIGKILL)
                killed_at = time.monotonic()
                # new blocks keep coming while the active one is dead, then only pooled
                # prompts (the load goes on; the truth stops moving, so "equal" is defined)
                await asyncio.to_thread(load.await_ok, 20, killed_at)
                load.fresh_share = 0.0
                try:
                    await asyncio.wait_for(new_epoch.wait(), killed_at + 10 - time.monotonic())
                except TimeoutError:
                    healths = {n: _call(p, "GET", "/health", timeout=2) for n, p in ports.items()}
                    raise AssertionError(f"no delta of a new epoch in 10 s: {healths}") from None
                takeover_s = new_epoch_at[0] - killed_at

                async def equal_to_truth() -> bool:
                    for w in WORKERS:
                        dump = (await fetch_kvdump(bus, w, reason="fault-test")).batch
                        truth = {
                            k for ev in dump.events if isinstance(ev, BlockStored) for k in ev.keys
                        }
                        status, state = await asyncio.to_thread(
                            _call, stack.operator, "GET", "/debug/state", None, 5
                        )
                        routed = (state.get("workers") or {}).get(w, {}) if status == 200 else {}
                        idx = replica.index
                        if routed.get("indexed_blocks") != len(truth):  # the stack's router
                            return False
                        if idx.blocks_of(w) != len(truth) or not all(
                            idx.holds(w, k) for k in truth
                        ):  # the replica here, key by key
                            return False
                    return True

                while not await equal_to_truth():
                    assert time.monotonic() < killed_at + 15, "routers never equal to the truth"
                    await asyncio.sleep(0.05)
                converged_s = time.monotonic() - killed_at
                await asyncio.to_thread(load.await_ok, 20, time.monotonic())
            finally:
                load.stop()
            return killed_at, takeover_s, converged_s, load
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await replica.stop()
            await bus.close()

    _killed_at, takeover_s, converged_s, load = asyncio.run(run())
    now_active, _ = _await(lambda: _active_indexer(stack), 30, "one active indexer again")
    print(
        f"\nactive indexer {active} SIGKILLed: {load.summary()}; standby {now_active} published "
        f"{takeover_s:.2f}s after the kill; routers equal to the workers' truth {converged_s:.2f}s "
        "after it"
    )
    assert now_active != active
    assert load.failed() == [], load.failed()[:5]
    assert takeover_s <= 3.0, takeover_s
    assert converged_s <= 5.0, converged_s


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _listeners(port: int) -> int:
    """Listening TCP sockets on ``port`` (one per process sharing it with SO_REUSEPORT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def test_one_router_process_killed_under_load(stack: Stack) -> None:
    port = free_port()
    env = up_env() | {
        "KVGATE_NATS_URL": stack.nats.url,
        "KVGATE_SUBJECT_PREFIX": stack.prefix,
        "KVGATE_ROUTER_PORT": str(port),
        "KVGATE_ROUTER_OPERATOR_PORT": "0",  # /health, /debug on the shared port
        "KVGATE_ROUTER_PROCESSES": "2",
        "KVGATE_LOG_FORMAT": "json",
    }
    log = (stack.state / "logs" / "router-pair.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "router"], env=env, stdout=log, stderr=log
    )
    try:
        replica_pids = _await(lambda: _children(proc.pid), 30, "the second router process")
        seen: dict[str, dict] = {}

        def both_ready() -> bool:  # new connections land on either process (SO_REUSEPORT)
            status, h = _call(port, "GET", "/health", timeout=2)
            if status == 200 and h["workers"] >= len(WORKERS) and h["index_ready"]:
                seen[h["router_id"]] = h
            return len(seen) == 2

        _await(both_ready, 60, "both router processes ready")
        assert _listeners(port) == 2
        with Load(port) as load:
            load.await_ok(40, after=0.0)
            victim = replica_pids[0]
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            # gone = its listening socket closed (the process's last thread has exited; its
            # main thread turns zombie earlier, while the others still hold the socket)
            _await(lambda: _listeners(port) == 1, 10, "the killed process's socket", step=0.005)
            assert not pid_alive(victim)
            gone_at = time.monotonic()
            load.await_ok(100, after=gone_at)
        in_flight = [r for r in load.results if r.sent < gone_at and r.done >= killed_at]
        lost = [r for r in in_flight if r.status != 200]
        print(
            f"\nrouter process {victim} SIGKILLed (2 processes on port {port}), its socket closed "
            f"{(gone_at - killed_at) * 1000:.0f} ms later: {load.summary()}; "
            f"{sum(r.sent >= gone_at for r in load.results)} requests sent after it died, "
            f"{len(load.failed(since=gone_at))} failed; {len(lost)} of the requests in flight at "
            f"the kill lost their connection: {sorted({r.detail[:60] for r in lost})}"
        )
        assert load.failed(since=gone_at) == [], load.failed(since=gone_at)[:5]
        # the requests that failed are exactly ones the killed process was serving
        assert all(r.status == -1 and r.sent < gone_at for r in load.failed()), load.failed()[:5]
        assert proc.poll() is None, "the surviving process stopped serving"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
