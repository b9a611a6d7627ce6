"""The fault drill's scenarios: one fault each, injected into a running ``kvgate up`` stack and
cleared after its hold time, registered by name.

A :class:`Fault` has two steps. ``inject`` starts the fault and returns once it is in effect
(a killed process is gone, a crashed worker's port is closed), so a drill never reports on a
fault that did not happen. ``clear`` ends it (resumes, restarts, lifts the fault); for a fault
the stack heals by itself (a router or indexer killed: ``kvgate up`` restarts it) it does
nothing. The drill measures recovery from the moment it calls ``clear``.

Invariant: after ``clear`` (also when the drill is interrupted; :class:`DrillStack.stop`
resumes what is frozen) nothing of the fault is left in the stack.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.drill_stack import DrillStack, Restartable, wait_gone
from services.common.embedded import port_open

VICTIM = 1  # the simulated worker a single-worker fault hits (sim-1)


class Fault:
    """No fault (the baseline); the base of the others."""

    async def inject(self, stack: DrillStack) -> None:
        return None

    async def clear(self, stack: DrillStack) -> None:
        return None


async def _until(what: str, cond: Callable[[], Any], timeout_s: float) -> None:
    """Poll ``cond`` (sync or async) until true: a foreign process offers no event to await."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"fault drill: timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- NATS
@dataclass
class KillNats(Fault):
    """SIGKILL a nats-server (the embedded one, or the ``node``-th of a cluster's by pid,
    which is the order they started); ``clear``
    starts it again with the same command line and waits until it accepts clients (and, in a
    cluster, until its JetStream is current)."""

    node: int = 0
    _again: Restartable | None = None

    async def inject(self, stack: DrillStack) -> None:
        pids = stack.nats_pids()
        if len(pids) <= self.node:
            raise RuntimeError(f"no nats-server node {self.node} (running: {pids})")
        pid = sorted(pids)[self.node]
        self._again = stack.kill_for_restart(pid)
        if not await asyncio.to_thread(wait_gone, pid, 10):
            raise RuntimeError(f"nats-server {pid} survived SIGKILL")

    async def clear(self, stack: DrillStack) -> None:
        if self._again is None:
            return
        argv = self._again.argv
        port = int(argv[argv.index("-p") + 1])
        monitor = int(argv[argv.index("--http_port") + 1]) if "--http_port" in argv else 0
        stack.restart(self._again)
        self._again = None
        await _until("the restarted nats-server", lambda: port_open("127.0.0.1", port, 0.2), 30)
        if monitor:
            url = stack.url_of_port(monitor, "/healthz")
            await _until("its JetStream", lambda: _status_is(stack, url, 200), 60)


async def _status_is(stack: DrillStack, url: str, status: int) -> bool:
    return (await stack.get_json(url))[0] == status


# ---------------------------------------------------------------------- simulated workers
@dataclass
class SimFaults(Fault):
    """Faults of simulated workers (POST /admin/faults): ``patch`` on inject, ``lift`` on
    clear, on ``workers`` (None: every worker)."""

    patch: dict[str, Any]
    lift: dict[str, Any]
    workers: list[int] | None = None

    def targets(self, stack: DrillStack) -> list[int]:
        return list(range(stack.shape.workers)) if self.workers is None else self.workers

    async def inject(self, stack: DrillStack) -> None:
        for w in self.targets(stack):
            await stack.set_faults(w, self.patch)

    async def clear(self, stack: DrillStack) -> None:
        for w in self.targets(stack):
            await stack.set_faults(w, self.lift)


@dataclass
class CrashWorker(Fault):
    """A worker crashes (its port closes, its streams break, its cache is lost) and comes
    back by itself as a new instance after ``down_s``."""

    down_s: float = 5.0
    worker: int = VICTIM

    async def inject(self, stack: DrillStack) -> None:
        await stack.set_faults(self.worker, {"crash": True, "restart_after_s": self.down_s})
        health = stack.worker_url(self.worker, "/health")
        await _until("the worker's port to close", lambda: _status_is(stack, health, -1), 10)


@dataclass
class HangWorker(SimFaults):
    """The worker freezes: it accepts requests and answers nothing, /health included."""

    patch: dict[str, Any] = field(default_factory=lambda: {"hang": True})
    lift: dict[str, Any] = field(default_factory=lambda: {"hang": False})
    workers: list[int] | None = field(default_factory=lambda: [VICTIM])


# ---------------------------------------------------------------------- Postgres
class FreezePostgres(Fault):
    """SIGSTOP the embedded Postgres (postmaster and backends: connections stay open,
    nothing answers); SIGCONT on clear."""

    async def inject(self, stack: DrillStack) -> None:
        pids = stack.postgres_pids()
        if not pids:
            raise RuntimeError("no embedded Postgres to freeze (the stack uses --database-url)")
        stack.freeze(pids)

    async def clear(self, stack: DrillStack) -> None:
        stack.resume_stopped()


# ---------------------------------------------------------------------- supervised children
@dataclass
class SignalRouter(Fault):
    """Send the router ``sig``; ``kvgate up`` restarts it once it has exited (after its drain,
    on SIGTERM)."""

    sig: signal.Signals = signal.SIGKILL

    async def inject(self, stack: DrillStack) -> None:
        pid = stack.router_pid()
        if pid is None:
            raise RuntimeError("no router process found")
        os.kill(pid, self.sig)
        ready = stack.url("router", "/ready")

        async def took_effect() -> bool:  # gone, or draining (/ready 503 at once on SIGTERM)
            if await asyncio.to_thread(wait_gone, pid, 0.05):
                return True
            return not await _status_is(stack, ready, 200)

        await _until("the router to stop or drain", took_effect, 30)


class KillActiveIndexer(Fault):
    """SIGKILL the indexer that holds the lease (the standby takes over; ``kvgate up``
    restarts the killed one)."""

    async def inject(self, stack: DrillStack) -> None:
        active = await stack.active_indexer()
        if active is None:
            raise RuntimeError(f"no indexer is active: {await stack.problems()}")
        pid = stack.indexer_pid(active)
        if pid is None:
            raise RuntimeError(f"no process found for the active indexer {active}")
        os.kill(pid, signal.SIGKILL)
        if not await asyncio.to_thread(wait_gone, pid, 10):
            raise RuntimeError(f"indexer {pid} survived SIGKILL")


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Scenario:
    """A named fault and how long it lasts (a full drill, a ``--quick`` one)."""

    name: str
    what: str  # one line an operator reads in the table's legend
    fault: Callable[[float], Fault]  # hold time -> a fresh fault
    hold_s: float
    quick_hold_s: float
    indexers: int = 1  # at least this many indexers (--indexers)
    nats_cluster: int = 1  # exactly this many NATS nodes (--nats-cluster)
    faulty: bool = True  # False: the baseline (nothing to recover from)


# nats-kill last of the shared stack's: a restarted single nats-server has lost the streams
# kept in memory (the indexers' lease bucket), which may leave the pair without an active
# indexer for the scenarios after it
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("baseline", "no fault", lambda _h: Fault(), 20, 5, faulty=False),
        Scenario(
            "worker-crash",
            "sim-1 crashes mid-stream, back (empty cache) after the hold",
            lambda h: CrashWorker(down_s=h),
            5,
            3,
        ),
        Scenario(
            "kv-drop-dup",
            "every worker drops 5 % and duplicates 5 % of its KV event batches",
            lambda _h: SimFaults({"drop_kv": 0.05, "dup_kv": 0.05}, {"drop_kv": 0, "dup_kv": 0}),
            30,
            10,
        ),
        Scenario(
            "postgres-freeze", "embedded Postgres SIGSTOPped", lambda _h: FreezePostgres(), 20, 6
        ),
        Scenario(
            "worker-503",
            "sim-1 answers 50 % of completions 503 (its /health fine)",
            lambda _h: SimFaults({"reject": 0.5}, {"reject": 0.0}, [VICTIM]),
            60,
            15,
        ),
        Scenario("worker-hang", "sim-1 frozen mid-stream", lambda _h: HangWorker(), 20, 6),
        Scenario(
            "router-sigterm",
            "router SIGTERMed (drains), kvgate up restarts it",
            lambda _h: SignalRouter(signal.SIGTERM),
            0,
            0,
        ),
        Scenario(
            "router-sigkill",
            "router SIGKILLed, kvgate up restarts it",
            lambda _h: SignalRouter(signal.SIGKILL),
            0,
            0,
        ),
        Scenario(
            "indexer-kill",
            "the active indexer of 2 SIGKILLed",
            lambda _h: KillActiveIndexer(),
            0,
            0,
            indexers=2,
        ),
        Scenario(
            "nats-kill",
            "embedded NATS SIGKILLed, restarted after the hold",
            lambda _h: KillNats(),
            10,
            5,
        ),
        Scenario(
            "nats-node-kill",
            "one of 3 NATS nodes SIGKILLed, restarted after the hold",
            lambda _h: KillNats(node=1),
            30,
            8,
            indexers=2,
            nats_cluster=3,
        ),
    ]
}
