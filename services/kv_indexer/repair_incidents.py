"""Index repairs as incidents: what the verifier alerts on. Pure (no I/O, the clock is passed in).

A repair means the index had drifted from a worker's own cache although every batch was applied
in order: events were lost or misapplied somewhere, which is a bug or a fault to look at, not
routine. So the first repair of a worker opens an *incident* and fires one ``index_repaired``
alert (severity warning, source ``indexer``, fingerprint ``index_repaired:<worker>``); further
repairs of that worker only add to the incident's counts. The incident resolves (one
``resolved`` alert with its totals) at the first equal check of the worker after ``quiet_s``
without a repair, or when the worker leaves the fleet.

Invariant: per worker, alerts alternate firing, resolved, firing, ...: at most one firing per
incident however many repairs it holds, and each firing is followed by exactly one resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.common.schemas import Alert, WorkerDivergence

KIND = "index_repaired"
REMEDY = (
    "The indexer found its index different from the worker's own KV cache at the same batch "
    "seq and resynced the worker from a full dump, so routing is right again. A repair means "
    "KV events were lost or misapplied on the normal path: look at the worker's "
    "kv_dropped counters and publish errors, the indexer's kvgate_indexer_seq_gaps_total and "
    "bad_input_total, and NATS (slow consumers, JetStream storage); `kvgate index verify` "
    "compares every worker now."
)


def repair_reason(result: WorkerDivergence) -> str:
    """What a divergent check found, as the repair counter's ``reason`` label."""
    if result.missing and result.extra:
        return "missing_and_extra"
    return "missing" if result.missing else "extra"


@dataclass
class Incident:
    worker_id: str
    opened_at: float
    last_repair_at: float
    repairs: int = 0
    missing: int = 0  # pairs repaired over the incident
    extra: int = 0


class RepairIncidents:
    def __init__(self, quiet_s: float = 300.0, indexer: str = "") -> None:
        if quiet_s <= 0:
            raise ValueError("quiet_s must be > 0")
        self.quiet_s = quiet_s
        self.indexer = indexer  # which indexer saw it (HA: several may)
        self.open: dict[str, Incident] = {}

    def repaired(self, result: WorkerDivergence, now: float) -> Alert | None:
        """A repair of ``result.worker_id``: the firing alert when it opens an incident."""
        inc = self.open.get(result.worker_id)
        first = inc is None
        if inc is None:
            inc = self.open[result.worker_id] = Incident(result.worker_id, now, now)
        inc.repairs += 1
        inc.missing += result.missing
        inc.extra += result.extra
        inc.last_repair_at = now
        if not first:
            return None
        return self._alert(
            result.worker_id,
            "firing",
            (
                f"the KV index drifted from worker {result.worker_id}'s cache at batch seq "
                f"{result.kv_seq}: {result.missing} blocks missing, {result.extra} extra "
                f"(of {result.worker_blocks} the worker holds); the worker was resynced"
            ),
            {
                "reason": repair_reason(result),
                "kv_seq": result.kv_seq,
                "missing": result.missing,
                "extra": result.extra,
                "worker_blocks": result.worker_blocks,
                "index_blocks": result.index_blocks,
                "missing_sample": [f"{k:#018x}" for k in result.missing_sample[:5]],
                "extra_sample": [f"{k:#018x}" for k in result.extra_sample[:5]],
            },
            remedy=REMEDY,
        )

    def checked_equal(self, worker_id: str, now: float) -> Alert | None:
        """An equal check: resolves the worker's incident once it has been quiet long enough."""
        inc = self.open.get(worker_id)
        if inc is None or now - inc.last_repair_at < self.quiet_s:
            return None
        return self._resolve(inc, now, f"no repair for {self.quiet_s:.0f} s and the index equal")

    def worker_gone(self, worker_id: str, now: float) -> Alert | None:
        inc = self.open.get(worker_id)
        return None if inc is None else self._resolve(inc, now, "the worker left the fleet")

    def _resolve(self, inc: Incident, now: float, why: str) -> Alert:
        del self.open[inc.worker_id]
        return self._alert(
            inc.worker_id,
            "resolved",
            (
                f"{KIND} resolved for worker {inc.worker_id}: {why}; {inc.repairs} repairs "
                f"({inc.missing} blocks missing, {inc.extra} extra) over "
                f"{now - inc.opened_at:.0f} s"
            ),
            {
                "repairs": inc.repairs,
                "missing": inc.missing,
                "extra": inc.extra,
                "seconds": round(now - inc.opened_at, 1),
            },
        )

    def _alert(
        self,
        worker_id: str,
        state: Literal["firing", "resolved"],
        summary: str,
        details: dict[str, Any],
        remedy: str = "",
    ) -> Alert:
        """The incident's alert signal: one fingerprint per worker, the indexer named."""
        return Alert(
            fingerprint=f"{KIND}:{worker_id}",
            kind=KIND,
            severity="warning",
            state=state,
            source="indexer",
            worker_id=worker_id,
            summary=summary,
            remedy=remedy,
            details={**details, "indexer": self.indexer},
        )
