"""The canary state machine in Postgres (transitions; I/O at the edge, rules in evaluator.py).

Every transition runs inside the caller's transaction with the canary row locked
(``SELECT ... FOR UPDATE``), records a ``canary_decisions`` row with the numbers it was based
on, writes the audit log, and bumps the policy revision when the traffic split changes. Lock
order is always canary row, then ``policy_state``, so concurrent transitions cannot deadlock.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.api import audit
from services.api.canary.evaluator import CanaryEvaluator, Criteria, Decision
from services.api.canary.stats import ArmStats
from services.api.models import (
    Canary,
    CanaryArmStats,
    CanaryDecision,
    CanaryTtftBucket,
)
from services.api.publisher import bump_revision, lock_state

OPEN = ("running", "paused")
FINAL = ("promoted", "rolled_back", "aborted")


def evaluator_of(c: Canary) -> CanaryEvaluator:
    return CanaryEvaluator(
        steps=tuple(float(x) for x in c.steps),
        step_duration_s=float(c.step_duration_s),
        criteria=Criteria.from_dict(c.criteria),
    )


def canary_dict(c: Canary) -> dict[str, Any]:
    return {
        "id": c.id,
        "state": c.state,
        "candidate": {
            "name": c.candidate_name,
            "version": c.candidate_version,
            "spec": c.candidate_spec,
        },
        "control": {"name": c.control_name, "version": c.control_version, "spec": c.control_spec},
        "steps": c.steps,
        "step_index": c.step_index,
        "fraction": c.steps[c.step_index],
        "step_duration_s": c.step_duration_s,
        "criteria": c.criteria,
        "window": c.window,
        "window_started_at": c.window_started_at,
        "reason": c.reason,
        "created_by": c.created_by,
        "created_at": c.created_at.isoformat() if c.created_at else None,
        "finished_at": c.finished_at.isoformat() if c.finished_at else None,
    }


def decision_dict(d: CanaryDecision) -> dict[str, Any]:
    return {
        "id": d.id,
        "ts": d.ts.isoformat() if d.ts else None,
        "window": d.window,
        "step_index": d.step_index,
        "fraction": d.fraction,
        "action": d.action,
        "reason": d.reason,
        "by": d.by,
        "numbers": d.numbers,
    }


# ----------------------------------------------------------------------------- stats I/O
async def window_stats(session: AsyncSession, canary_id: str, window: int) -> dict[str, ArmStats]:
    out = {"control": ArmStats(), "candidate": ArmStats()}
    rows = (
        await session.execute(
            select(CanaryArmStats).where(
                CanaryArmStats.canary_id == canary_id, CanaryArmStats.window == window
            )
        )
    ).scalars()
    for r in rows:
        out[r.arm] = ArmStats(
            requests=r.requests,
            errors=r.errors,
            timeouts=r.timeouts,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
        )
    buckets = (
        await session.execute(
            select(CanaryTtftBucket).where(
                CanaryTtftBucket.canary_id == canary_id, CanaryTtftBucket.window == window
            )
        )
    ).scalars()
    for b in buckets:
        if b.arm in out:
            out[b.arm].ttft[b.bucket] = b.count
    return out


async def baseline_control(
    session: AsyncSession, canary_id: str, before_window: int, min_samples: int
) -> tuple[ArmStats, int | None]:
    """Control stats of the newest earlier window with enough control samples (for 100 %)."""
    rows = (
        await session.execute(
            select(CanaryArmStats.window)
            .where(
                CanaryArmStats.canary_id == canary_id,
                CanaryArmStats.arm == "control",
                CanaryArmStats.window < before_window,
                CanaryArmStats.requests >= min_samples,
            )
            .order_by(CanaryArmStats.window.desc())
            .limit(1)
        )
    ).scalar_one_or_none()
    if rows is None:
        return ArmStats(), None
    return (await window_stats(session, canary_id, rows))["control"], int(rows)


async def add_stats(
    session: AsyncSession, canary_id: str, window: int, arm: str, st: ArmStats
) -> None:
    """Add one batch of counts to a window (commutative: replicas add their shares)."""
    ins = insert(CanaryArmStats).values(
        canary_id=canary_id,
        window=window,
        arm=arm,
        requests=st.requests,
        errors=st.errors,
        timeouts=st.timeouts,
        prompt_tokens=st.prompt_tokens,
        cached_tokens=st.cached_tokens,
    )
    t = CanaryArmStats.__table__.c
    await session.execute(
        ins.on_conflict_do_update(
            index_elements=[t.canary_id, t.window, t.arm],
            set_={
                "requests": t.requests + ins.excluded.requests,
                "errors": t.errors + ins.excluded.errors,
                "timeouts": t.timeouts + ins.excluded.timeouts,
                "prompt_tokens": t.prompt_tokens + ins.excluded.prompt_tokens,
                "cached_tokens": t.cached_tokens + ins.excluded.cached_tokens,
            },
        )
    )
    if st.ttft:
        ins_b = insert(CanaryTtftBucket).values(
            [
                {"canary_id": canary_id, "window": window, "arm": arm, "bucket": b, "count": n}
                for b, n in sorted(st.ttft.items())
            ]
        )
        tb = CanaryTtftBucket.__table__.c
        await session.execute(
            ins_b.on_conflict_do_update(
                index_elements=[tb.canary_id, tb.window, tb.arm, tb.bucket],
                set_={"count": tb.count + ins_b.excluded.count},
            )
        )


async def evaluation_inputs(
    session: AsyncSession, c: Canary
) -> tuple[ArmStats, ArmStats, dict[str, Any]]:
    """(control, candidate, extra numbers) for the canary's current window."""
    stats = await window_stats(session, c.id, c.window)
    control, candidate = stats["control"], stats["candidate"]
    extra: dict[str, Any] = {"window": c.window}
    min_samples = int(Criteria.from_dict(c.criteria).min_samples)
    if float(c.steps[c.step_index]) >= 1.0:
        # at 100 % the control's outcomes in this window are only stragglers of the switch
        # (requests routed before it): compare with the last window where control had traffic
        base, base_window = await baseline_control(session, c.id, c.window, min_samples)
        if base_window is not None:
            control = base
            extra["baseline_window"] = base_window
    return control, candidate, extra


def evaluate(c: Canary, control: ArmStats, candidate: ArmStats, now: float) -> Decision:
    return evaluator_of(c).decide(c.step_index, now - c.window_started_at, control, candidate)


# ----------------------------------------------------------------------------- transitions
async def lock_canary(session: AsyncSession, canary_id: str) -> Canary | None:
    return (
        await session.execute(select(Canary).where(Canary.id == canary_id).with_for_update())
    ).scalar_one_or_none()


def _record(
    session: AsyncSession,
    c: Canary,
    action: str,
    reason: str,
    numbers: dict[str, Any],
    by: str,
) -> None:
    session.add(
        CanaryDecision(
            canary_id=c.id,
            window=c.window,
            step_index=c.step_index,
            fraction=float(c.steps[c.step_index]),
            action=action,
            reason=reason[:4000],
            numbers=numbers,
            by=by,
        )
    )


async def start(
    session: AsyncSession,
    *,
    candidate: tuple[str, int, dict[str, Any]],
    control: tuple[str, int, dict[str, Any]],
    steps: list[float],
    step_duration_s: float,
    criteria: Criteria,
    actor: str,
    now: float | None = None,
) -> Canary:
    now = time.time() if now is None else now
    c = Canary(
        id=str(uuid.uuid4()),
        state="running",
        candidate_name=candidate[0],
        candidate_version=candidate[1],
        candidate_spec=candidate[2],
        control_name=control[0],
        control_version=control[1],
        control_spec=control[2],
        steps=list(steps),
        step_index=0,
        step_duration_s=step_duration_s,
        criteria=criteria.to_dict(),
        window=0,
        window_started_at=now,
        next_eval_at=0.0,
        reason="",
        created_by=actor,
    )
    session.add(c)
    await session.flush()
    await bump_revision(session)
    _record(session, c, "start", f"canary started at {steps[0]:.0%}", {"steps": steps}, actor)
    audit.record(session, actor, "canary.start", "canary", c.id, None, canary_dict(c))
    return c


async def apply(
    session: AsyncSession,
    c: Canary,
    action: str,
    reason: str,
    numbers: dict[str, Any],
    by: str,
    now: float | None = None,
) -> bool:
    """Apply a transition to a locked canary. Returns True if the traffic split changed
    (the caller publishes after commit). ``action``: advance | complete | rollback | pause |
    resume | abort | hold (hold only records)."""
    now = time.time() if now is None else now
    before = canary_dict(c)
    _record(session, c, action, reason, numbers, by)
    split_changed = False
    if action == "advance":
        if c.step_index + 1 >= len(c.steps):
            action = "complete"
        else:
            c.step_index += 1
            c.window += 1
            c.window_started_at = now
            c.next_eval_at = 0.0
            split_changed = True
    if action == "complete":
        st = await lock_state(session)
        st.active_name = c.candidate_name
        st.active_version = c.candidate_version
        st.active_spec = c.candidate_spec
        c.state = "promoted"
        c.finished_at = datetime.now(UTC)
        c.reason = reason
        split_changed = True
    elif action in ("rollback", "abort"):
        c.state = "rolled_back" if action == "rollback" else "aborted"
        c.finished_at = datetime.now(UTC)
        c.reason = reason
        split_changed = True
    elif action == "pause":
        c.state = "paused"
    elif action == "resume":
        c.state = "running"
        c.window += 1
        c.window_started_at = now
        c.next_eval_at = 0.0
    if split_changed:
        await bump_revision(session)
    c.updated_at = datetime.now(UTC)
    if action != "hold":
        audit.record(session, by, f"canary.{action}", "canary", c.id, before, canary_dict(c))
    return split_changed
