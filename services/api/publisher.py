"""What routers must run, from Postgres to the bus.

Invariants:
- The published ``PolicyUpdated`` is always derived from Postgres (``policy_state`` row plus
  the open canary), never from a handler's local variables, so any replica can (re)publish it.
- ``revision`` is the database counter (bumped in the same transaction as the change), so
  routers can drop stale notices by comparing revisions.
- A notice lost while NATS was down is re-sent by :meth:`PolicyPublisher.resync`, which
  compares the newest message in the POLICY stream with the database revision and re-sends
  also when that message is not signed by the api's key (a notice from a stolen credential
  must not stay the one every router reads at start).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client import Counter
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.db import Database
from services.api.models import Canary, PolicyState
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    CanaryAssignment,
    PolicyRevisionReply,
    PolicyRevisionRequest,
    PolicyUpdated,
    SchemaError,
    decode,
)
from services.common.signing import Verifier
from services.common.streams import require_policy_stream

log = get_logger("api.publisher")

STREAM_REPAIRS = Counter(
    "kvgate_api_policy_stream_repairs_total",
    "Notices the api re-published because the POLICY stream's newest was not its own current one",
    ["problem"],  # missing, invalid, behind, ahead, unsigned, bad_signature, untrusted_signer, ...
)


@dataclass(frozen=True, slots=True)
class StoredNotice:
    """The POLICY stream's newest notice: its revision (-1: none readable) and ``signature``,
    the api's verdict on its signature ("" when it is the api's own)."""

    revision: int
    signature: str

    def problem(self, db_revision: int) -> str:
        """ "" when it is the api's own notice at ``db_revision``, else why it is not."""
        if self.signature:  # also "missing" / "invalid": nothing to judge
            return self.signature
        if self.revision < db_revision:
            return "behind"
        return "ahead" if self.revision > db_revision else ""


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
        self._repair: asyncio.Task[None] | None = None
        self._repair_gate = RateLimiter(1.0)

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

    async def stream_notice(self) -> StoredNotice:
        """The POLICY stream's newest notice, as this api judges it."""
        s = self.bus.subjects
        try:
            msg = await self.bus.js.get_last_msg(s.policy_stream, s.policy_updated)
        except Exception:
            return StoredNotice(-1, "missing")
        try:
            revision = int(decode(PolicyUpdated, msg.data).revision)
        except SchemaError:
            return StoredNotice(-1, "invalid")
        # "the api's own": signed by this api's key (any replica's; none configured: any
        # notice, as routers then check no signature either)
        signer = self.bus.signer
        own = Verifier([signer.public_key] if signer is not None else [])
        return StoredNotice(revision, own.reject_reason(msg.subject, msg.data, msg.headers))

    async def stored_revision(self) -> int:
        async with self.db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
        return int(st.revision)

    async def resync(self) -> bool:
        """Re-publish unless the stream's newest notice is this api's own at the database's
        revision: not when it is older (a lost publish), newer (a notice the api never sent, e.g.
        a forged revision 10^9, which would otherwise stay the stream's newest and shadow every
        later activation), or not signed by the api's key (a stolen credential's notice, which
        every router started later would read and reject, left with no policy to start from)."""
        async with self.db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
        if st.active_name is None:
            return False
        stored = await self.stream_notice()
        problem = stored.problem(int(st.revision))
        if not problem:
            return False
        STREAM_REPAIRS.labels(problem).inc()
        if problem not in ("missing", "behind"):
            log.warning("policy stream's newest notice is not the api's; republishing",
                        problem=problem, stream_revision=stored.revision,
                        stored_revision=int(st.revision))  # fmt: skip
        return await self.publish_current()

    async def answer_revision(self, req: PolicyRevisionRequest) -> PolicyRevisionReply:
        """``policy.revision``: the stored revision; with ``repair`` (a router found the stream's
        newest notice unacceptable) a resync soon, at most one at a time and one a second, so
        requests, forged or not, cost no more than the periodic resync."""
        if req.repair and self._repair is None and self._repair_gate.allow("repair"):
            log.info("policy stream repair requested", router=req.router_id[:64])
            self._repair = asyncio.create_task(self._run_repair(), name="policy-repair")
        return PolicyRevisionReply(revision=await self.stored_revision())

    async def _run_repair(self) -> None:
        try:
            await self.resync()
        except Exception as exc:  # the periodic resync retries
            log.warning("policy repair failed", error=repr(exc)[:200])
        finally:
            self._repair = None

    async def close(self) -> None:
        if self._repair is not None:
            await cancel_and_wait([self._repair])
