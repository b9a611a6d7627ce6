"""Which indexer of a namespace publishes deltas: a lease in a JetStream key-value bucket.

Several indexers (``kvgate indexer --ha-id <id>``) consume the same KV events and keep the
same index warm; exactly one of them, the lease holder, publishes deltas and serves
snapshots. The lease is one key of a KV bucket whose entries live ``ttl_s`` (the bucket's
max age), so a holder that stops renewing loses it by itself:

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
from nats.js.api import KeyValueConfig, StorageType

from services.common.bus import Bus
from services.common.logging import get_logger

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
        replicas: int = 1,
    ) -> None:
        if ttl_s <= 0.2:
            raise ValueError("lease ttl must be > 0.2 s")
        self.bus = bus
        self.holder_id = holder_id
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.ttl_s = ttl_s
        self.replicas = replicas
        self.bucket = bus.subjects.indexer_lease_bucket  # one lease per namespace
        self.held = False
        self.revision: int | None = None
        self.acquisitions = 0
        self._renewed_at = 0.0
        self._kv = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="indexer-lease")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.held and self._kv is not None and self.revision is not None:
            with contextlib.suppress(Exception):  # hand over now rather than at expiry
                await self._kv.delete(LEASE_KEY, last=self.revision)
        self._set_held(False)

    async def _bucket(self):
        if self._kv is None:
            self._kv = await self.bus.js.create_key_value(
                KeyValueConfig(
                    bucket=self.bucket,
                    history=1,
                    ttl=self.ttl_s,
                    storage=StorageType.MEMORY,
                    replicas=self.replicas,
                )
            )
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
        value = self.holder_id.encode()
        while True:
            try:
                kv = await self._bucket()
                if not self.held:
                    try:
                        self.revision = await kv.create(LEASE_KEY, value)
                        self._renewed_at = time.monotonic()
                        self._set_held(True)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        pass  # held by another candidate
                else:
                    try:
                        self.revision = await kv.update(LEASE_KEY, value, last=self.revision)
                        self._renewed_at = time.monotonic()
                    except nats.js.errors.KeyWrongLastSequenceError:
                        self._set_held(False)  # expired and taken (or deleted) meanwhile
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError) as exc:
                log.info("indexer lease: NATS unavailable", error=repr(exc), held=self.held)
            if self.held and time.monotonic() - self._renewed_at > self.ttl_s:
                self._set_held(False)  # may have expired: step down before another steps up
            await asyncio.sleep(renew_every if self.held else poll_every)
