"""The fault drill's handle on one ``kvgate up`` stack: where its parts listen, which process
is which, and what it reports (verifier repairs, managed alerts, the router's memory).

It starts ``kvgate up`` as a user does (tests.up_stack.UpStack: free ports, auth on, a client
API key), and finds processes by their command line, not by the stack file's pids alone: the
supervisor restarts a dead child under a new pid. A NATS server the drill killed is restarted
by the drill with the same command line (``kvgate up`` does not supervise its NATS); the
drill then owns that process and stops it after the stack.

Invariant: :meth:`DrillStack.stop` leaves no process behind that the drill started, and no
process stopped (SIGSTOP) by a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from nats.js.api import ConsumerConfig, DeliverPolicy

from bench.scrape import parse_counters
from bench.stack import _die_with_parent
from services.common import stackfile
from services.common.bus import Bus
from services.common.schemas import Alert, SchemaError, decode
from services.common.subjects import Subjects
from tests.up_stack import UpStack, pid_alive, processes_mentioning

REPAIRS = "kvgate_index_verify_repairs_total"
CHECKS = "kvgate_index_verify_checks_total"  # the verifier's comparisons, any result
VERIFIER_COUNTERS = (REPAIRS, CHECKS)
ALERTS_IDLE_S = 5.0  # reading the ALERTS stream back: no message for this long, give up


@dataclass(frozen=True)
class StackShape:
    """What ``kvgate up`` runs: its flags, as a scenario needs them."""

    workers: int = 4
    indexers: int = 2
    nats_cluster: int = 1
    extra_args: tuple[str, ...] = ()  # e.g. --database-url (tests)

    def args(self) -> list[str]:
        out = ["--nats-cluster", str(self.nats_cluster)] if self.nats_cluster > 1 else []
        return out + list(self.extra_args)


@dataclass
class Restartable:
    """A process killed by a fault, with what it takes to start it again as it was."""

    argv: list[str]
    cwd: str
    log: Path

    @classmethod
    def of(cls, pid: int, log: Path) -> Restartable:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        return cls([a.decode() for a in argv], os.readlink(f"/proc/{pid}/cwd"), log)

    def start(self) -> subprocess.Popen:
        with open(self.log, "ab") as out:
            return subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )


@dataclass
class DrillStack:
    state: Path
    shape: StackShape
    up: UpStack | None = None
    stack: dict[str, Any] = field(default_factory=dict)  # stack.json as written at start
    owned: list[subprocess.Popen] = field(default_factory=list)  # NATS servers restarted here
    stopped: list[int] = field(default_factory=list)  # pids a fault SIGSTOPped, not yet resumed

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.up = UpStack(
            self.state,
            workers=self.shape.workers,
            indexers=self.shape.indexers,
            args=self.shape.args(),
        )
        self.up.banner()
        self.stack = json.loads((self.state / "stack.json").read_text())

    def stop(self) -> None:
        self.resume_stopped()
        if self.up is not None:
            with contextlib.suppress(Exception):
                self.up.stop()
        for proc in self.owned:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.owned.clear()

    # ------------------------------------------------------------------ where things are
    def url(self, name: str, path: str = "") -> str:
        assert self.up is not None
        return self.up.url(name, path)

    def worker_url(self, i: int, path: str = "") -> str:
        assert self.up is not None
        return f"http://127.0.0.1:{self.up.ports['sim'] + i}{path}"

    def auth(self) -> dict[str, str]:
        assert self.up is not None
        return self.up.auth()

    def indexer_ports(self) -> dict[str, int]:
        return {k: v for k, v in self.stack["ports"].items() if k.startswith("indexer")}

    # ------------------------------------------------------------------ processes
    def _pid_of(self, needle: str) -> int | None:
        found = processes_mentioning(needle)
        return int(found[0].split(":", 1)[0]) if len(found) == 1 else None

    def router_pid(self) -> int | None:
        assert self.up is not None
        return self._pid_of(f"services.cli router --port {self.up.ports['router']}")

    def indexer_pid(self, child: str) -> int | None:
        return self._pid_of(f"services.cli indexer --port {self.indexer_ports()[child]}")

    def nats_pids(self) -> list[int]:
        """The stack's nats-server processes (the embedded one, or each node), alive now."""
        pids = [p for k, p in self.stack["pids"].items() if k.startswith("nats-server")]
        pids += [p.pid for p in self.owned]
        return [p for p in pids if pid_alive(p)]

    def postgres_pids(self) -> list[int]:
        """The embedded postmaster and every backend it forked (a freeze stops them all)."""
        top = stackfile.postmaster_pid(self.state / "postgres")
        if top is None:
            return []
        pids = [top]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == top:
                        pids.append(int(entry))
        return pids

    def kill_for_restart(self, pid: int) -> Restartable:
        """SIGKILL a process the stack does not supervise, keeping how to start it again."""
        again = Restartable.of(pid, self.state / "logs" / f"drill-restarted-{pid}.log")
        os.kill(pid, signal.SIGKILL)
        return again

    def restart(self, again: Restartable) -> subprocess.Popen:
        proc = again.start()
        self.owned.append(proc)
        return proc

    def freeze(self, pids: Sequence[int]) -> None:
        self.stopped += list(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume_stopped(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()

    # ------------------------------------------------------------------ what it reports
    async def set_faults(self, worker: int, patch: dict[str, Any]) -> None:
        """A simulated worker's faults (POST /admin/faults); raises unless it took them."""
        async with aiohttp.ClientSession() as s:
            async with s.post(self.worker_url(worker, "/admin/faults"), json=patch) as r:
                if r.status != 200:
                    raise RuntimeError(f"sim worker {worker} refused faults {patch}: {r.status}")

    async def get_json(self, url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
        """(status, body); status -1 when nothing answered in time."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(timeout_s)) as s:
                async with s.get(url) as r:
                    try:
                        return r.status, await r.json(content_type=None)
                    except ValueError:
                        return r.status, None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return -1, None

    async def healthy(self) -> bool:
        """Every worker answers /health, the router knows them all and is ready."""
        workers = [self.get_json(self.worker_url(i, "/health")) for i in range(self.shape.workers)]
        answers = await asyncio.gather(
            self.get_json(self.url("router", "/ready")),
            self.get_json(self.url("router-operator", "/health")),
            *workers,
        )
        ready, health, *sims = answers
        return (
            ready[0] == 200
            and health[0] == 200
            and int((health[1] or {}).get("workers", 0)) >= self.shape.workers
            and all(st == 200 for st, _ in sims)
        )

    async def problems(self) -> list[str]:
        """What is not as it was before the fault: a worker not answering, a router not ready
        or not knowing every worker, no indexer holding the lease (a group of several)."""
        found = []
        for i in range(self.shape.workers):
            if (await self.get_json(self.worker_url(i, "/health")))[0] != 200:
                found.append(f"sim-{i} not answering /health")
        status, body = await self.get_json(self.url("router", "/ready"))
        if status != 200:
            found.append(f"router not ready ({status}: {body})")
        status, health = await self.get_json(self.url("router-operator", "/health"))
        known = int((health or {}).get("workers", 0)) if status == 200 else 0
        if known < self.shape.workers:
            found.append(f"router knows {known} of {self.shape.workers} workers")
        if len(self.indexer_ports()) > 1 and await self.active_indexer() is None:
            errors = set()
            for port in self.indexer_ports().values():
                _st, h = await self.get_json(self.url_of_port(port, "/health"))
                errors.add(str(((h or {}).get("lease") or {}).get("last_error") or "-"))
            found.append(f"no indexer holds the lease (last errors: {', '.join(sorted(errors))})")
        return found

    async def active_indexer(self) -> str | None:
        names = list(self.indexer_ports())
        answers = await asyncio.gather(
            *(self.get_json(self.url_of_port(p, "/health")) for p in self.indexer_ports().values())
        )
        active = [n for n, (st, h) in zip(names, answers, strict=True) if st == 200 and h["active"]]
        return active[0] if len(active) == 1 else None

    @staticmethod
    def url_of_port(port: int, path: str) -> str:
        return f"http://127.0.0.1:{port}{path}"

    async def verifier_counters(self) -> dict[str, dict[str, float]]:
        """Per counter (:data:`VERIFIER_COUNTERS`), each indexer's value so far, summed over
        its labels; an indexer not answering is left out."""
        out: dict[str, dict[str, float]] = {name: {} for name in VERIFIER_COUNTERS}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(3)) as s:
            for child, port in self.indexer_ports().items():
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with s.get(self.url_of_port(port, "/metrics")) as r:
                        page = await r.text()
                    for name in VERIFIER_COUNTERS:
                        out[name][child] = sum_counter(page, name)
        return out

    async def alerts_between(self, start_ts: float, end_ts: float) -> list[dict[str, Any]]:
        """Managed alerts (the ALERTS stream, as ``kvgate alerts tail`` reads it with the
        operator credential) whose time is in [start_ts, end_ts] (wall clock)."""
        subjects = Subjects(self.stack.get("subject_prefix", ""))
        bus = Bus(
            self.stack["nats_url"],
            "fault-drill",
            subjects,
            auth=stackfile.operator_auth(self.state),
            role="operator",
        )
        await bus.connect(max_wait_s=10)
        found: list[dict[str, Any]] = []
        try:
            info = await bus.js.stream_info(subjects.alerts_stream)
            last = info.state.last_seq
            if not info.state.messages or last == 0:
                return []
            since = datetime.fromtimestamp(start_ts - 5, UTC).isoformat()
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since
            )
            sub = await bus.js.subscribe(
                subjects.alerts_all,
                stream=subjects.alerts_stream,
                ordered_consumer=True,
                config=config,
            )
            try:
                # nothing newer than since: no message will come (the consumer then reports
                # the stream's last seq as delivered, so only num_pending tells)
                if not (await sub.consumer_info()).num_pending:
                    return []
                while True:
                    try:
                        msg = await sub.next_msg(timeout=ALERTS_IDLE_S)
                    except TimeoutError:  # shown in the table: a count that may be short
                        found.append({"kind": "(not read to the end)", "state": "firing"})
                        break
                    try:
                        a = decode(Alert, msg.data)
                    except SchemaError as exc:
                        found.append({"kind": "(unreadable)", "state": "", "error": str(exc)})
                    else:
                        if start_ts <= a.ts <= end_ts:
                            found.append(
                                {
                                    "kind": a.kind,
                                    "state": a.state,
                                    "severity": a.severity,
                                    "ts": a.ts,
                                }
                            )
                    if msg.metadata.sequence.stream >= last:
                        break
            finally:
                await sub.unsubscribe()
        finally:
            await bus.close()
        return found


def sum_counter(text: str, name: str) -> float:
    """Sum of a counter's samples (every label set) in a Prometheus metrics page."""
    base = name.removesuffix("_total")
    return parse_counters(text, (base,))[base]


def counter_delta(before: dict[str, float], after: dict[str, float]) -> float:
    """Growth of per-process counters; a process restarted in between (its counter below the
    earlier value, or new) counts from zero."""
    total = 0.0
    for name, value in after.items():
        prev = before.get(name, 0.0)
        total += value - prev if value >= prev else value
    return total


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


class PeakSampler:
    """Samples a value every ``every_s`` in the background and keeps the peak."""

    def __init__(self, read: Callable[[], float | None], every_s: float = 0.5) -> None:
        self.read = read
        self.every_s = every_s
        self.peak: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            value = await asyncio.to_thread(self.read)
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
            await asyncio.sleep(self.every_s)  # a sampling period, not a synchronisation


def wait_gone(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` has exited (polled: a foreign process has no event to await)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    return False
