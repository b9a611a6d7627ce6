"""Postgres tables of the admin API (SQLAlchemy 2 declarative; alembic migrations mirror them).

Invariants:
- ``policy_state`` has exactly one row (id = 1). Its ``revision`` only grows: every change of
  what routers must run (activation, canary start / step / end) increments it in the same
  transaction, and the published ``PolicyUpdated.revision`` is that number.
- At most one canary is open (state ``running`` or ``paused``) at a time (partial unique index).
- A canary window (``canaries.window``) gets at most one state-changing decision
  (advance / complete / rollback): a partial unique index on ``canary_decisions`` enforces it,
  so two API replicas can never both act on the same window.
- At most one open (``firing`` / ``acknowledged``) alert per fingerprint.
- API tokens are stored only as sha256 hex digests. A token is accepted only while
  ``revoked_at`` is null and ``expires_at`` is null or in the future; a ``bootstrap`` row (the
  environment's admin token, recorded by digest) only by a replica configured with that token.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


TZ = DateTime(timezone=True)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    token_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)
    # the row of KVGATE_API_ADMIN_TOKEN (services.api.tokens): revocable, never expires
    bootstrap: Mapped[bool] = mapped_column(
        nullable=False, default=False, server_default=text("false")
    )


class Policy(Base):
    __tablename__ = "policies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    description: Mapped[str] = mapped_column(Text, nullable=False, default="")
    latest_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    policy_id: Mapped[int] = mapped_column(
        ForeignKey("policies.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class PolicyState(Base):
    """The single row saying what routers run: active policy and the revision counter."""

    __tablename__ = "policy_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    active_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    active_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    active_spec: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())


class Canary(Base):
    __tablename__ = "canaries"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    candidate_name: Mapped[str] = mapped_column(String(64), nullable=False)
    candidate_version: Mapped[int] = mapped_column(Integer, nullable=False)
    candidate_spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    control_name: Mapped[str] = mapped_column(String(64), nullable=False)
    control_version: Mapped[int] = mapped_column(Integer, nullable=False)
    control_spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    steps: Mapped[list[float]] = mapped_column(JSONB, nullable=False)
    step_index: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    step_duration_s: Mapped[float] = mapped_column(Float, nullable=False)
    criteria: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    window: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    window_started_at: Mapped[float] = mapped_column(Float, nullable=False)
    next_eval_at: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)

    __table_args__ = (
        Index(
            "one_open_canary",
            text("(true)"),
            unique=True,
            postgresql_where=text("state IN ('running', 'paused')"),
        ),
    )


class CanaryArmStats(Base):
    """Outcome counters of one arm in one canary window (added to by the outcome consumers)."""

    __tablename__ = "canary_arm_stats"

    canary_id: Mapped[str] = mapped_column(
        ForeignKey("canaries.id", ondelete="CASCADE"), primary_key=True
    )
    window: Mapped[int] = mapped_column(Integer, primary_key=True)
    arm: Mapped[str] = mapped_column(String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    timeouts: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class CanaryTtftBucket(Base):
    """TTFT histogram of one arm in one window: ``count`` samples in log bucket ``bucket``."""

    __tablename__ = "canary_ttft_buckets"

    canary_id: Mapped[str] = mapped_column(
        ForeignKey("canaries.id", ondelete="CASCADE"), primary_key=True
    )
    window: Mapped[int] = mapped_column(Integer, primary_key=True)
    arm: Mapped[str] = mapped_column(String(16), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class CanaryDecision(Base):
    __tablename__ = "canary_decisions"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    canary_id: Mapped[str] = mapped_column(
        ForeignKey("canaries.id", ondelete="CASCADE"), nullable=False, index=True
    )
    ts: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    window: Mapped[int] = mapped_column(Integer, nullable=False)
    step_index: Mapped[int] = mapped_column(Integer, nullable=False)
    fraction: Mapped[float] = mapped_column(Float, nullable=False)
    action: Mapped[str] = mapped_column(String(16), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
    numbers: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    by: Mapped[str] = mapped_column(String(128), nullable=False, default="evaluator")

    __table_args__ = (
        Index(
            "one_transition_per_window",
            "canary_id",
            "window",
            unique=True,
            postgresql_where=text("action IN ('advance', 'complete', 'rollback')"),
        ),
    )


class WorkerControlState(Base):
    """A worker's admin order (cordon / drain, or a recent uncordon: re-sent for the routers'
    freshness window, then deleted by services.api.workers.ControlRepublisher)."""

    __tablename__ = "worker_controls"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    action: Mapped[str] = mapped_column(String(16), nullable=False)
    by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())


class AlertRow(Base):
    __tablename__ = "alerts"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(256), nullable=False)
    kind: Mapped[str] = mapped_column(String(128), nullable=False)
    severity: Mapped[str] = mapped_column(String(16), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    source: Mapped[str] = mapped_column(String(128), nullable=False, default="unknown")
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    summary: Mapped[str] = mapped_column(Text, nullable=False, default="")
    remedy: Mapped[str] = mapped_column(Text, nullable=False, default="")
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    count: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    silenced: Mapped[bool] = mapped_column(nullable=False, default=False)
    first_seen: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    acked_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    acked_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)
    resolved_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    resolved_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)

    __table_args__ = (
        Index(
            "one_open_alert_per_fingerprint",
            "fingerprint",
            unique=True,
            postgresql_where=text("state IN ('firing', 'acknowledged')"),
        ),
        Index("alerts_by_last_seen", "last_seen"),
    )


class Silence(Base):
    """Suppresses publishing of matching alerts until ``ends_at`` (empty matcher = any)."""

    __tablename__ = "silences"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    fingerprint: Mapped[str | None] = mapped_column(String(256), nullable=True)
    kind: Mapped[str | None] = mapped_column(String(128), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    severity: Mapped[str | None] = mapped_column(String(16), nullable=True)
    comment: Mapped[str] = mapped_column(Text, nullable=False, default="")
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    ends_at: Mapped[datetime] = mapped_column(TZ, nullable=False)


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ts: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    actor: Mapped[str] = mapped_column(String(128), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target_type: Mapped[str] = mapped_column(String(32), nullable=False)
    target_id: Mapped[str] = mapped_column(String(256), nullable=False, default="")
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)

    __table_args__ = (Index("audit_by_ts", "ts"),)


# ----------------------------------------------------------------------------- tenants
class TenantRow(Base):
    """A tenant and its current settings (``spec``: weight, default priority, quota, cache
    isolation), versioned like policies: each change adds a ``tenant_versions`` row."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(Text, nullable=False, default="")
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    # the tenant's secret cache namespace (sent to routers only; used when spec isolates it)
    cache_salt: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class TenantVersion(Base):
    __tablename__ = "tenant_versions"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class TenantKey(Base):
    """A client API key of a tenant, stored only as its sha256 hex digest (like api_tokens)."""

    __tablename__ = "tenant_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    name: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    priority: Mapped[str | None] = mapped_column(String(16), nullable=True)
    allow_priority_header: Mapped[bool] = mapped_column(
        nullable=False, default=False, server_default=text("false")
    )
    created_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    revoked_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(TZ, nullable=True)


class TenantState(Base):
    """The single row (id = 1) whose ``revision`` numbers the tenant directory routers hold:
    bumped in the same transaction as every change to tenants or keys."""

    __tablename__ = "tenant_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    updated_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())


class TenantUsage(Base):
    """What a tenant used in one minute (unix minute), summed from router outcomes: no
    foreign key, so usage outlives a deleted tenant (a bill is still owed)."""

    __tablename__ = "tenant_usage"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    # prompt tokens of requests whose engine reported no cache figure (neither cached nor
    # computed can be said of them)
    unreported_prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class TenantUsageSeen(Base):
    """OUTCOMES stream messages already added to ``tenant_usage`` (by stream sequence and the
    time the stream stored it: a re-created stream's sequence numbers start again), so a
    message redelivered after a crash between commit and ack is not counted twice."""

    __tablename__ = "tenant_usage_seen"

    stream_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    stored_us: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(TZ, nullable=False, server_default=func.now())
