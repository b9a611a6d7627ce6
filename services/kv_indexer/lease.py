"""Which indexer of a namespace publishes deltas: a lease in a JetStream key-value bucket.

Several indexers (``kvgate indexer --ha-id <id>``) consume the same KV events and keep the
same index warm; exactly one of them, the lease holder, publishes deltas and serves
snapshots. The lease is one key of a KV bucket whose entries live ``ttl_s`` (the bucket's
max age), so a holder that stops renewing loses it by itself:

- a candidate competes only while ``warm()`` says its index is complete (a process that just
  restarted would otherwise race the warm standby for an expired lease and, winning, publish
  an epoch from a partial index);
- a candidate takes the lease with ``create`` (succeeds only while the key does not exist:
  never held, expired, or released with a delete);
- the holder renews with ``update(last=revision)``: revision-checked, so a holder whose lease
  expired and was taken by another fails instead of overwriting it;
- the holder counts the lease lost when a renewal is refused, or when no renewal has
  succeeded for ``ttl_s`` (it cannot tell whether it still holds it: it steps down first);
- on a clean stop the holder deletes the key (revision-checked), so a standby takes over at
  its next poll instead of waiting for the expiry.

Consensus is JetStream's (the bucket is a stream replicated by NATS' Raft); this module only
reads and writes one key. Invariant: ``held`` is True only between a successful create and
the first failed/late renewal, and at most one holder's renewals can succeed at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors

from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.streams import require_lease_bucket

log = get_logger("kv_indexer.lease")

LEASE_KEY = "active"


class IndexerLease:
    """The lease loop of one candidate; ``on_acquired`` / ``on_lost`` run in the event loop."""

    def __init__(
        self,
        bus: Bus,
        holder_id: str,
        *,
        on_acquired: Callable[[], None],
        on_lost: Callable[[], None],
        ttl_s: float = 1.5,
        warm: Callable[[], bool] = lambda: True,
    ) -> None:
        if ttl_s <= 0.2:
            raise ValueError("lease ttl must be > 0.2 s")
        self.bus = bus
        self.holder_id = holder_id
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.ttl_s = ttl_s
        self.warm = warm
        self.bucket = bus.subjects.indexer_lease_bucket  # one lease per namespace
        self.held = False
        self.revision: int | None = None
        self.acquisitions = 0
        self._renewed_at = 0.0
        self.attempted_at = 0.0  # monotonic time the last lease operation finished
        self.last_error = ""
        self._kv = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="indexer-lease")

    async def stop(self) -> None:
        self._stopping = True  # the loop ends at its next round even if a cancel is swallowed
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self.held and self._kv is not None and self.revision is not None:
            with contextlib.suppress(Exception):  # hand over now rather than at expiry
                await self._kv.delete(LEASE_KEY, last=self.revision)
        self._set_held(False)

    def status(self) -> dict:
        """For /health: whether this candidate holds the lease and that its loop is alive."""
        age = time.monotonic() - self.attempted_at if self.attempted_at else None
        return {
            "held": self.held,
            "holder_id": self.holder_id,
            "acquisitions": self.acquisitions,
            "last_attempt_s_ago": None if age is None else round(age, 3),
            "last_error": self.last_error,
        }

    async def _bucket(self):
        if self._kv is None:
            # provisioned (kvgate bus provision), checked as provisioned, then only used
            await require_lease_bucket(self.bus, self.ttl_s)
            self._kv = await self.bus.js.key_value(self.bucket)
        return self._kv

    def _set_held(self, held: bool) -> None:
        if held == self.held:
            return
        self.held = held
        if held:
            self.acquisitions += 1
            log.info("indexer lease acquired", holder=self.holder_id, revision=self.revision)
            self.on_acquired()
        else:
            log.warning("indexer lease lost or released", holder=self.holder_id)
            self.revision = None
            self.on_lost()

    async def _loop(self) -> None:
        renew_every = self.ttl_s / 4
        poll_every = min(0.2, self.ttl_s / 4)
        # every NATS call gets at most one ttl: a call stuck past it (a reconnect that hangs)
        # would otherwise stall the loop, so a standby never takes an expired lease
        # (asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands
        # as the call completes, and this loop would then run on while stop() awaits it)
        op_timeout = self.ttl_s
        value = self.holder_id.encode()
        while not self._stopping:
            try:
                async with asyncio.timeout(op_timeout):
                    kv = await self._bucket()
                if not self.held and not self.warm():
                    pass  # not a candidate until its index is complete
                elif not self.held:
                    try:
                        async with asyncio.timeout(op_timeout):
                            revision = await kv.create(LEASE_KEY, value)
                        if self._stopping:  # stopped meanwhile: hand it back at once
                            await kv.delete(LEASE_KEY, last=revision)
                            break
                        self.revision = revision
                        self._renewed_at = time.monotonic()
                        self._set_held(True)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        pass  # held by another candidate
                else:
                    try:
                        async with asyncio.timeout(op_timeout):
                            self.revision = await kv.update(LEASE_KEY, value, last=self.revision)
                        self._renewed_at = time.monotonic()
                    except nats.js.errors.KeyWrongLastSequenceError:
                        self._set_held(False)  # expired and taken (or deleted) meanwhile
                self.last_error = ""
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError) as exc:
                self.last_error = repr(exc)
                log.info("indexer lease: NATS unavailable", error=repr(exc), held=self.held)
            except Exception as exc:  # anything else must not end the loop silently
                self.last_error = repr(exc)
                log.warning("indexer lease: unexpected error", error=repr(exc), held=self.held)
            self.attempted_at = time.monotonic()
            if self.held and time.monotonic() - self._renewed_at > self.ttl_s:
                self._set_held(False)  # may have expired: step down before another steps up
            await asyncio.sleep(renew_every if self.held else poll_every)
