"""The indexer's convergence checker: its index against each worker's own dump.

Runs inside the indexer, because only there can a dump taken at the worker's batch seq S be
compared with the index exactly as of S (IndexerCore.verify_check replays the batches the
index applied after S onto the dump). Two users:

- ``kv.index.verify`` (IndexVerifyRequest -> IndexVerifyReply): ``kvgate index verify``
  asks for every (or some) worker and prints the difference per worker;
- a background loop that checks one worker at a time, round robin, repairs (resyncs) a
  divergent worker and sets ``kvgate_index_divergent_blocks{worker}``. A repair is counted
  (``kvgate_index_verify_repairs_total{worker,reason}``, the pairs it fixed in
  ``kvgate_index_verify_repaired_blocks_total{worker,kind}``) and alerted once per incident
  (services.kv_indexer.repair_incidents: ``index_repaired``, warning). It paces itself to
  ``cpu_share`` of one core: after a check that cost c CPU seconds it waits c / cpu_share
  (at least ``min_interval_s``), so a 1 M-block worker is checked about once a minute and a
  small fleet every few seconds.

Invariant: a check is conclusive only when made at an exact seq (see core); inconclusive and
unreachable checks are counted, never reported as divergence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge

from services.common.bus import Bus
from services.common.kvdump import fetch_kvdump
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    Alert,
    EngineHistoryLost,
    IndexVerifyReply,
    IndexVerifyRequest,
    WorkerDivergence,
)
from services.common.streams import raise_alert
from services.kv_indexer.core import IndexerCore
from services.kv_indexer.repair_incidents import RepairIncidents, repair_reason

log = get_logger("kv_verifier")

DIVERGENT = Gauge(
    "kvgate_index_divergent_blocks",
    "Pairs (key, tier) where the index differs from the worker's own dump at its last check",
    ["worker"],
)
CHECKS = Counter("kvgate_index_verify_checks_total", "Index-vs-dump checks, by result", ["result"])
REPAIRS = Counter(
    "kvgate_index_verify_repairs_total",
    "Workers resynced because a check found divergence, by what it found "
    "(reason: missing, extra, missing_and_extra); 0 in a healthy fleet",
    ["worker", "reason"],
)
REPAIRED_BLOCKS = Counter(
    "kvgate_index_verify_repaired_blocks_total",
    "Divergent (key, tier) pairs found by checks that started a repair, by kind (missing, extra)",
    ["worker", "kind"],
)
REPAIR_ALERTS = Counter(
    "kvgate_index_repair_alerts_total",
    "index_repaired alert signals, by state (firing, resolved) and result (sent, failed)",
    ["state", "result"],
)
CPU = Counter(
    "kvgate_index_verify_cpu_seconds_total", "Indexer CPU time spent checking (upper bound)"
)


def repairs_total() -> float:
    """Repairs started since the process began, every worker and reason together."""
    return sum(
        s.value
        for m in REPAIRS.collect()
        for s in m.samples
        if s.name == "kvgate_index_verify_repairs_total"
    )


def describe_history_lost(h: EngineHistoryLost) -> str:
    """One line for an operator: which engine history is gone and what that hides."""
    lost = (
        f"engine batch {h.first_lost_seq}"
        if h.first_lost_seq == h.last_lost_seq
        else f"engine batches {h.first_lost_seq}..{h.last_lost_seq}"
    )
    what = {
        "lost_history": "the bridge started (or the engine restarted) after them",
        "unrecovered_gap": "a gap the bridge could not replay",
    }[h.reason]
    text = (
        f"engine history lost: {lost} never reached the bridge ({what}"
        + (f"; {h.detail}" if h.detail else "")
        + f"); its view starts at engine seq {h.view_from_seq}, so blocks the engine stored "
        f"before are unverifiable; since then {h.unkeyed_blocks} blocks stored on a lost "
        f"parent could not be keyed and {h.unknown_hashes} removals named blocks never seen"
    )
    if h.losses > 1:
        text += f" ({h.losses} losses)"
    return text


def qualify_check(result: WorkerDivergence, lost: EngineHistoryLost | None) -> WorkerDivergence:
    """A check against a dump that lost engine history: "equal" only proves the index equals
    the bridge's view, so it becomes "unknown" (no repair can help: the bridge has nothing
    more to give); "divergent" stays (the index differs even from what the bridge knows) with
    the loss noted. Other results are returned unchanged."""
    if lost is None or result.status not in ("equal", "divergent"):
        return result
    note = describe_history_lost(lost)
    return msgspec.structs.replace(
        result,
        status="unknown" if result.status == "equal" else result.status,
        history_lost=lost,
        detail=f"{result.detail}; {note}" if result.detail else note,
    )


class Verifier:
    def __init__(
        self,
        bus: Bus,
        core: IndexerCore,
        resync: Callable[[list[str]], None],
        *,
        cpu_share: float = 0.01,
        min_interval_s: float = 1.0,
        chunk_timeout_s: float = 5.0,
        settle_s: float = 5.0,
        alert_quiet_s: float = 300.0,
        indexer_name: str = "",
    ) -> None:
        if not 0 < cpu_share <= 1:
            raise ValueError("cpu_share must be in (0, 1]")
        self.bus = bus
        self.core = core
        self.resync = resync
        self.cpu_share = cpu_share
        self.min_interval_s = min_interval_s
        self.chunk_timeout_s = chunk_timeout_s
        self.settle_s = settle_s
        self.cpu_s = 0.0
        self.last: dict[str, WorkerDivergence] = {}
        self._log = RateLimiter(60.0)
        self._busy: set[str] = set()
        self.incidents = RepairIncidents(alert_quiet_s, indexer_name)

    # ------------------------------------------------------------------ one worker
    async def check(self, worker: str, *, repair: bool, max_sample: int = 10) -> WorkerDivergence:
        """Fetch the worker's dump and compare; resync it when divergent and ``repair``."""
        if worker in self._busy:
            return WorkerDivergence(
                worker_id=worker, status="inconclusive", detail="a check is already running"
            )
        self._busy.add(worker)
        cpu0 = time.thread_time()
        try:
            result = await self._check(worker, max_sample)
        finally:
            self._busy.discard(worker)
            self.core.verify_end(worker)
            spent = time.thread_time() - cpu0  # includes other tasks run meanwhile: an upper bound
            self.cpu_s += spent
            CPU.inc(spent)
        CHECKS.labels(result.status).inc()
        if result.status in ("equal", "divergent"):
            DIVERGENT.labels(worker).set(result.missing + result.extra)
            self.last[worker] = result
        if result.status == "equal":
            self._send(self.incidents.checked_equal(worker, time.monotonic()))
        if result.status == "divergent":
            if self._log.allow(("divergent", worker)):
                log.warning(
                    "index diverges from the worker",
                    worker_id=worker,
                    missing=result.missing,
                    extra=result.extra,
                    kv_seq=result.kv_seq,
                    repair=repair,
                )
            if repair and self.core.request_repair(worker):
                REPAIRS.labels(worker, repair_reason(result)).inc()
                REPAIRED_BLOCKS.labels(worker, "missing").inc(result.missing)
                REPAIRED_BLOCKS.labels(worker, "extra").inc(result.extra)
                result.repaired = True
                self.resync([worker])
                self._send(self.incidents.repaired(result, time.monotonic()))
        return result

    def _send(self, alert: Alert | None) -> None:
        """Publish an alert signal without holding up the check (JetStream acks it)."""
        if alert is None:
            return

        async def send() -> None:
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:  # no alert stream (or NATS down): counted, logged
                REPAIR_ALERTS.labels(alert.state, "failed").inc()
                if self._log.allow(("alert", alert.state)):
                    log.warning(
                        "index_repaired alert not sent",
                        worker_id=alert.worker_id,
                        state=alert.state,
                        error=repr(exc),
                    )
                return
            REPAIR_ALERTS.labels(alert.state, "sent").inc()
            log.warning(
                "index_repaired alert " + alert.state,
                worker_id=alert.worker_id,
                summary=alert.summary,
            )

        self.bus.spawn(send(), f"index-repaired-alert:{alert.worker_id}")

    async def _check(self, worker: str, max_sample: int) -> WorkerDivergence:
        if not self.core.verify_begin(worker):
            return WorkerDivergence(
                worker_id=worker, status="unreachable", detail="no such worker registered"
            )
        try:
            fetched = await fetch_kvdump(
                self.bus, worker, reason="verify", chunk_timeout_s=self.chunk_timeout_s
            )
        except Exception as exc:  # no responder, refused, incomplete: nothing to compare
            return WorkerDivergence(
                worker_id=worker, status="unreachable", detail=str(exc) or repr(exc)
            )
        deadline = time.monotonic() + self.settle_s
        while True:
            result = self.core.verify_check(worker, fetched.batch, max_sample)
            if result is not None:  # a bridge that lost engine history: unknown, not equal
                return qualify_check(result, fetched.history_lost)
            if time.monotonic() > deadline:
                return WorkerDivergence(
                    worker_id=worker,
                    status="inconclusive",
                    kv_seq=fetched.batch.seq,
                    detail=f"the index did not reach the dump's seq within {self.settle_s}s",
                )
            await asyncio.sleep(0.02)  # the worker's batches up to the dump are in flight

    # ------------------------------------------------------------------ many workers
    async def verify(self, req: IndexVerifyRequest) -> IndexVerifyReply:
        workers = list(req.workers) or sorted(self.core.workers)
        limit = asyncio.Semaphore(4)  # a few dumps in memory at once, whatever the fleet size

        async def one(w: str) -> WorkerDivergence:
            async with limit:
                return await self.check(w, repair=req.repair, max_sample=req.max_sample)

        results = await asyncio.gather(*(one(w) for w in workers))
        return IndexVerifyReply(
            workers=list(results),
            divergent_blocks=sum(r.missing + r.extra for r in results),
        )

    async def run(self) -> None:
        """Background loop: one worker per round, paced to ``cpu_share`` of a core."""
        turn = 0
        while True:
            workers = sorted(self.core.workers)
            for gone in set(self.last) - set(workers):
                del self.last[gone]
                DIVERGENT.remove(gone)
            for gone in set(self.incidents.open) - set(workers):
                self._send(self.incidents.worker_gone(gone, time.monotonic()))
            if not workers:
                await asyncio.sleep(self.min_interval_s)
                continue
            worker = workers[turn % len(workers)]
            turn += 1
            before = self.cpu_s
            try:
                await self.check(worker, repair=True)
            except Exception as exc:  # a bug must not end the loop
                log.exception("verification failed", worker_id=worker, error=repr(exc))
            spent = self.cpu_s - before
            await asyncio.sleep(max(self.min_interval_s, spent / self.cpu_share))

    def status(self) -> dict[str, Any]:
        return {
            "cpu_share": self.cpu_share,
            "cpu_seconds": round(self.cpu_s, 3),
            "repair_incidents": {
                w: {"repairs": i.repairs, "missing": i.missing, "extra": i.extra}
                for w, i in sorted(self.incidents.open.items())
            },
            "workers": {
                w: {"status": r.status, "missing": r.missing, "extra": r.extra, "kv_seq": r.kv_seq}
                for w, r in sorted(self.last.items())
            },
        }
