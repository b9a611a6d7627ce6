"""Audit log: every change made through the API is recorded in the same transaction as the
change itself (who, what, the target, and the state before and after)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.api.models import AuditEntry


def record(
    session: AsyncSession,
    actor: str,
    action: str,
    target_type: str,
    target_id: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    session.add(
        AuditEntry(
            actor=actor,
            action=action,
            target_type=target_type,
            target_id=str(target_id)[:256],
            before=before,
            after=after,
        )
    )


def audit_dict(row: AuditEntry) -> dict[str, Any]:
    return {
        "id": row.id,
        "ts": row.ts.isoformat() if row.ts else None,
        "actor": row.actor,
        "action": row.action,
        "target_type": row.target_type,
        "target_id": row.target_id,
        "before": row.before,
        "after": row.after,
    }
