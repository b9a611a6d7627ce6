"""What routers must run, from Postgres to the bus.

Invariants:
- The published ``PolicyUpdated`` is always derived from Postgres (``policy_state`` row plus
  the open canary), never from a handler's local variables, so any replica can (re)publish it.
- ``revision`` is the database counter (bumped in the same transaction as the change), so
  routers can drop stale notices by comparing revisions.
- A notice lost while NATS was down is re-sent by :meth:`PolicyPublisher.resync`, which
  compares the newest message in the POLICY stream with the database revision.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.db import Database
from services.api.models import Canary, PolicyState
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import CanaryAssignment, PolicyUpdated, SchemaError, decode
from services.common.streams import require_policy_stream

log = get_logger("api.publisher")


async def bump_revision(session: AsyncSession) -> int:
    """Increment the revision (row-locks policy_state until the transaction ends)."""
    return int(
        (
            await session.execute(
                text(
                    "UPDATE policy_state SET revision = revision + 1, updated_at = now() "
                    "WHERE id = 1 RETURNING revision"
                )
            )
        ).scalar_one()
    )


async def lock_state(session: AsyncSession) -> PolicyState:
    return (
        await session.execute(select(PolicyState).where(PolicyState.id == 1).with_for_update())
    ).scalar_one()


async def open_canary(session: AsyncSession) -> Canary | None:
    return (
        await session.execute(select(Canary).where(Canary.state.in_(("running", "paused"))))
    ).scalar_one_or_none()


async def desired(session: AsyncSession) -> PolicyUpdated | None:
    """The notice routers should have now (None: nothing activated yet)."""
    st = (await session.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
    if st.active_name is None or st.active_spec is None:
        return None
    canary = await open_canary(session)
    assignment = None
    if canary is not None:
        assignment = CanaryAssignment(
            canary_id=canary.id,
            fraction=float(canary.steps[canary.step_index]),
            candidate_name=canary.candidate_name,
            candidate_version=canary.candidate_version,
            candidate_spec=canary.candidate_spec,
        )
    return PolicyUpdated(
        revision=int(st.revision),
        name=st.active_name,
        version=int(st.active_version or 0),
        spec=st.active_spec,
        canary=assignment,
        ts=time.time(),
    )


class PolicyPublisher:
    def __init__(self, db: Database, bus: Bus) -> None:
        self.db = db
        self.bus = bus
        self._log = RateLimiter(30.0)
        self.last_published = -1
        self._lock = asyncio.Lock()  # one publish at a time per process keeps them in order

    async def publish_current(self) -> bool:
        """Publish the database's current notice; False if NATS did not take it (resync will)."""
        async with self._lock:
            return await self._publish_current()

    async def _publish_current(self) -> bool:
        async with self.db.session() as s:
            notice = await desired(s)
        if notice is None:
            return True
        try:
            await require_policy_stream(self.bus)
            await self.bus.js_publish(self.bus.subjects.policy_updated, notice)
        except Exception as exc:
            if self._log.allow("publish"):
                log.warning("policy publish failed; will resync", error=repr(exc))
            return False
        self.last_published = max(self.last_published, notice.revision)
        log.info(
            "policy published",
            revision=notice.revision,
            name=notice.name,
            version=notice.version,
            canary=notice.canary.canary_id if notice.canary else None,
            fraction=notice.canary.fraction if notice.canary else None,
        )
        return True

    async def stream_revision(self) -> int:
        s = self.bus.subjects
        try:
            msg = await self.bus.js.get_last_msg(s.policy_stream, s.policy_updated)
        except Exception:
            return -1
        try:
            return int(decode(PolicyUpdated, msg.data).revision)
        except SchemaError:
            return -1

    async def stored_revision(self) -> int:
        async with self.db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
        return int(st.revision)

    async def resync(self) -> bool:
        """Re-publish if the stream's newest notice is not the database's revision: older (a
        lost publish) or newer (a notice the api never sent, e.g. a forged revision 10^9, which
        would otherwise stay the stream's newest and shadow every later activation)."""
        async with self.db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
        if st.active_name is None:
            return False
        stream = await self.stream_revision()
        if stream == int(st.revision):
            return False
        if stream > int(st.revision):
            log.warning("policy stream holds a revision the api never stored; republishing",
                        stream_revision=stream, stored_revision=int(st.revision))  # fmt: skip
        return await self.publish_current()
