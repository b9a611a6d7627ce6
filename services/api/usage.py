"""Per-tenant usage for chargeback: router outcomes summed per tenant and minute in Postgres.

Every request's outcome (services.router.outcomes) carries its tenant, its prompt and
completion tokens, and ``cached_tokens``: the prompt tokens the engine itself reported served
from its prefix cache. This collector reads the OUTCOMES stream with its own durable consumer
(shared by the API replicas: each gets a share) and adds each message's sums to
``tenant_usage`` in one transaction, before acking it.

Invariants:
- Exactly once: a message is added at most once (its stream sequence and stored time are
  recorded in the same transaction: a redelivery after a crash between commit and ack is
  skipped) and at least once (a message whose write failed, e.g. Postgres down, is not acked
  and comes back).
- The sums are the outcomes' own figures, nothing estimated: ``cached_tokens`` of a tenant over
  a period is the sum of its engines' reports; prompts whose engine reported nothing are
  counted apart (``unreported_prompt_tokens``), never as cached nor as computed.
- Tokens count for successful requests (``status == ok``); every request counts in
  ``requests``, the others also in ``errors``. Tenant-less requests are not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any

from prometheus_client import Counter
from sqlalchemy import delete, text
from sqlalchemy.dialects.postgresql import insert

from services.api.db import Database
from services.api.models import TenantUsage, TenantUsageSeen
from services.api.pull import PullLoop
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import RouterOutcome, SchemaError, decode_all
from services.common.streams import require_outcomes_stream

log = get_logger("api.usage")

USAGE_MESSAGES = Counter(
    "kvgate_api_tenant_usage_messages_total",
    "OUTCOMES messages read by the tenant usage collector, by result",
    ["result"],  # counted | no_tenant | duplicate | invalid | retry
)

FIELDS = (
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "unreported_prompt_tokens",
    "completion_tokens",
)
KEEP_SEEN_S = 2 * 86400  # longer than the OUTCOMES stream keeps a message (24 h)


def add_outcome(sums: dict[tuple[str, int], dict[str, int]], o: RouterOutcome) -> None:
    """Add one outcome to per (tenant, unix minute) sums (a tenant-less one is skipped)."""
    if not o.tenant_id:
        return
    row = sums[(o.tenant_id[:64], int(o.ts // 60))]
    row["requests"] += 1
    if o.status != "ok":
        row["errors"] += 1
        return
    row["prompt_tokens"] += o.prompt_tokens
    row["completion_tokens"] += o.completion_tokens
    if o.cached_tokens is None:
        row["unreported_prompt_tokens"] += o.prompt_tokens
    else:
        row["cached_tokens"] += o.cached_tokens


def new_sums() -> dict[tuple[str, int], dict[str, int]]:
    return defaultdict(lambda: dict.fromkeys(FIELDS, 0))


class UsageCollector:
    def __init__(self, db: Database, bus: Bus, prune_s: float = 600.0) -> None:
        self.db = db
        self.bus = bus
        self.prune_s = prune_s
        self.written = asyncio.Event()  # set after each message written (tests await it)
        self._log = RateLimiter(30.0)
        self._pull: PullLoop | None = None
        self._prune: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await require_outcomes_stream(self.bus)
        s = self.bus.subjects
        self._pull = PullLoop(
            self.bus,
            s.outcomes_stream,
            s.router_outcomes,
            s.durable("api_tenant_usage"),
            self._on_raw,
        )
        await self._pull.start()
        self._prune = asyncio.create_task(self._prune_loop(), name="tenant-usage-prune")

    async def stop(self) -> None:
        if self._pull is not None:
            await self._pull.stop()
        if self._prune is not None:
            await cancel_and_wait([self._prune])

    async def _on_raw(self, raw: Any) -> bool:
        try:
            outcomes = decode_all(RouterOutcome, raw.data)
        except SchemaError:
            USAGE_MESSAGES.labels("invalid").inc()
            return True  # the canary collector logs it
        sums = new_sums()
        for o in outcomes:
            add_outcome(sums, o)
        if not sums:
            USAGE_MESSAGES.labels("no_tenant").inc()
            return True
        meta = raw.metadata
        seq = int(meta.sequence.stream)
        stored_us = int(meta.timestamp.timestamp() * 1_000_000) if meta.timestamp else 0
        try:
            counted = await self.write(seq, stored_us, sums)
        except Exception as exc:  # Postgres away: not acked, comes back
            USAGE_MESSAGES.labels("retry").inc()
            if self._log.allow("write"):
                log.warning("tenant usage not written; will retry", error=repr(exc)[:200])
            return False
        USAGE_MESSAGES.labels("counted" if counted else "duplicate").inc()
        self.written.set()
        self.written = asyncio.Event()
        return True

    async def write(
        self, seq: int, stored_us: int, sums: dict[tuple[str, int], dict[str, int]]
    ) -> bool:
        """Add ``sums`` unless message (``seq``, ``stored_us``) was added before."""
        async with self.db.transaction() as s:
            first = (
                await s.execute(
                    insert(TenantUsageSeen)
                    .values(stream_seq=seq, stored_us=stored_us)
                    .on_conflict_do_nothing()
                    .returning(TenantUsageSeen.stream_seq)
                )
            ).first()
            if first is None:
                return False
            for (tenant, minute), counts in sorted(sums.items()):
                stmt = insert(TenantUsage).values(tenant_id=tenant, minute=minute, **counts)
                await s.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[TenantUsage.tenant_id, TenantUsage.minute],
                        set_={f: getattr(TenantUsage, f) + stmt.excluded[f] for f in FIELDS},
                    )
                )
        return True

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.prune_s)
            with contextlib.suppress(Exception):
                async with self.db.transaction() as s:
                    await s.execute(
                        delete(TenantUsageSeen).where(
                            TenantUsageSeen.seen_at
                            < text(f"now() - interval '{int(KEEP_SEEN_S)} seconds'")
                        )
                    )
