"""The API's view of the fleet: heartbeats and telemetry (in memory, per replica), admin
states (cordoned / draining, in Postgres) and breaker state (open ``circuit_open`` alerts).

Invariants:
- A worker's health comes from the age of its last heartbeat: ``healthy`` within
  ``stale_s``, ``stale`` within ``down_s``, else ``down``; forgotten after ``forget_s``.
- Admin states live in Postgres; :class:`ControlRepublisher` re-sends every non-default
  state every ``period_s`` so routers that start later (or missed a message) learn them.
- A URL re-pin (``repin``) is one message, not a state: it is audited, not stored nor
  re-published (a router started later pins the worker's URL from its first heartbeat anyway).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select

from services.api.db import Database
from services.api.models import WorkerControlState
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.redact import redact_url
from services.common.schemas import WorkerControl, WorkerHeartbeat, WorkerLoad, to_builtins

log = get_logger("api.workers")

CONTROL_STATE = {"cordon": "cordoned", "drain": "draining", "uncordon": "active"}


@dataclass
class _Seen:
    heartbeat: WorkerHeartbeat | None = None
    heartbeat_at: float = 0.0
    load: WorkerLoad | None = None
    load_at: float = 0.0


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


class WorkerRegistry:
    def __init__(self, stale_s: float = 10.0, down_s: float = 60.0, forget_s: float = 600.0):
        self.stale_s = stale_s
        self.down_s = down_s
        self.forget_s = forget_s
        self._seen: dict[str, _Seen] = {}

    def on_heartbeat(self, hb: WorkerHeartbeat, now: float | None = None) -> None:
        seen = self._seen.setdefault(hb.worker_id, _Seen())
        seen.heartbeat = hb
        seen.heartbeat_at = time.time() if now is None else now

    def on_load(self, load: WorkerLoad, now: float | None = None) -> None:
        seen = self._seen.setdefault(load.worker_id, _Seen())
        seen.load = load
        seen.load_at = time.time() if now is None else now

    def health(self, seen: _Seen, now: float) -> str:
        last = max(seen.heartbeat_at, seen.load_at)
        age = now - last
        if seen.heartbeat is None:
            return "unregistered" if age < self.down_s else "down"
        age = now - seen.heartbeat_at
        if age <= self.stale_s:
            return "healthy"
        return "stale" if age <= self.down_s else "down"

    def ids(self) -> list[str]:
        now = time.time()
        for wid in [
            w for w, s in self._seen.items() if now - max(s.heartbeat_at, s.load_at) > self.forget_s
        ]:
            del self._seen[wid]
        return sorted(self._seen)

    def view(
        self, worker_id: str, control: str | None, breaker_open: bool, now: float | None = None
    ) -> dict[str, Any]:
        now = time.time() if now is None else now
        seen = self._seen.get(worker_id, _Seen())
        hb, load = seen.heartbeat, seen.load
        kv: dict[str, Any] = {}
        if load is not None:
            kv = {
                "usage": load.kv_usage,
                "blocks_total": load.kv_blocks_total,
                "blocks_free": load.kv_blocks_free,
            }
        elif hb is not None:
            kv = {"usage": None, "blocks_total": hb.capacity.num_gpu_blocks, "blocks_free": None}
        return {
            "worker_id": worker_id,
            "health": self.health(seen, now) if (hb or load) else "unknown",
            "state": hb.state if hb else None,
            "admin_state": CONTROL_STATE.get(control or "uncordon", "active"),
            "breaker": "open" if breaker_open else "closed",
            "url": redact_url(hb.url) if hb else None,
            "model": hb.model if hb else None,
            "engine": hb.engine if hb else None,
            "role": hb.role if hb else None,  # both | prefill | decode (disaggregated serving)
            "capacity": to_builtins(hb.capacity) if hb else None,
            "last_heartbeat_age_s": round(now - seen.heartbeat_at, 3) if hb else None,
            "load": {
                "running": load.running,
                "waiting": load.waiting,
                "scheduled": load.scheduled,
                "max_batch": load.max_batch,
                "stale": load.stale,
                "age_s": round(now - seen.load_at, 3),
                "gpus": len(load.gpus),
                "cache_hit_rate": load.cache_hit_rate,
                "gpu_sm_util": _mean(
                    [g.sm_util_pct / 100 for g in load.gpus if g.sm_util_pct is not None]
                ),
            }
            if load
            else None,
            "kv": kv,
        }

    async def subscribe(self, bus: Bus) -> None:
        async def on_hb(hb: WorkerHeartbeat, _raw) -> None:
            self.on_heartbeat(hb)

        async def on_load(load: WorkerLoad, _raw) -> None:
            self.on_load(load)

        await bus.subscribe(bus.subjects.heartbeat_all, WorkerHeartbeat, on_hb)
        await bus.subscribe(bus.subjects.telemetry_all, WorkerLoad, on_load)


async def forget_uncordons(db: Database, worker_ids: list[str], older_than: datetime) -> None:
    """Delete uncordon rows no longer re-sent (unless an order replaced them meanwhile)."""
    async with db.transaction() as s:
        await s.execute(
            delete(WorkerControlState).where(
                WorkerControlState.worker_id.in_(worker_ids),
                WorkerControlState.action == "uncordon",
                WorkerControlState.updated_at < older_than,  # one stored since stays
            )
        )


async def control_states(db: Database) -> dict[str, WorkerControlState]:
    async with db.session() as s:
        rows = (await s.execute(select(WorkerControlState))).scalars().all()
    return {r.worker_id: r for r in rows}


async def publish_control(bus: Bus, worker_id: str, action: str, by: str, url: str = "") -> bool:
    """Publish (signed, when the api has a signing key) one worker control message; False
    when the bus would not take it."""
    try:
        await bus.publish(
            bus.subjects.worker_control(worker_id),
            WorkerControl(worker_id=worker_id, action=action, by=by, ts=time.time(), url=url),  # type: ignore[arg-type]
        )
        return True
    except Exception as exc:
        log.warning("worker control publish failed", worker=worker_id, error=repr(exc))
        return False


class ControlRepublisher:
    """Re-sends every worker's admin order every ``period_s``, so a router that missed one
    (started later, reconnected) converges.

    An uncordon is kept as a row and re-sent for ``uncordon_resend_s`` (the routers' freshness
    window for signed orders), then forgotten: a router started after a drain and its uncordon,
    within that window, would otherwise accept a captured copy of the drain (its nonce and
    sequence are new to it); with the uncordon re-sent, the router holds a later sequence from
    the same signer, and the copy is out of order."""

    def __init__(
        self, db: Database, bus: Bus, period_s: float = 5.0, uncordon_resend_s: float = 300.0
    ) -> None:
        self.db = db
        self.bus = bus
        self.period_s = period_s
        self.uncordon_resend_s = uncordon_resend_s
        self._task: asyncio.Task[None] | None = None
        self._log = RateLimiter(60.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="control-republish")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def once(self) -> int:
        states = await control_states(self.db)
        now = datetime.now(UTC)
        expired = [
            wid
            for wid, row in states.items()
            if row.action == "uncordon"
            and (now - row.updated_at).total_seconds() > self.uncordon_resend_s
        ]
        for wid, row in states.items():
            if wid not in expired:
                await publish_control(self.bus, wid, row.action, row.by)
        if expired:
            await forget_uncordons(self.db, expired, older_than=now)
        return len(states) - len(expired)

    async def _loop(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as exc:
                if self._log.allow("republish"):
                    log.warning("worker control republish failed", error=repr(exc)[:200])
            await asyncio.sleep(self.period_s)
