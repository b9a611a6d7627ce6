"""Per-tenant prefix-cache ledger: the KV blocks each tenant holds on the fleet, how many of
its blocks were evicted, and how many evictions of *other* tenants' blocks it caused.

A first approximation, from what one router sees:

- **Owner.** When this router has sent a tenant's request to a worker, the prompt's blocks past
  the ones the worker already held (the decision's overlap) are *claimed* for the tenant: the
  engine computed them, and once its KV events report them stored (``kv.events.<worker>``,
  GPU tier) the tenant owns them. A block keeps its first owner while it stays on the worker
  (a later tenant reusing it is served from cache, not charged).
- **Held.** Owned blocks stored and not yet removed.
- **Evicted / caused.** A removed block counts as evicted for its owner. The eviction is
  charged to the tenant whose blocks the same event batch stored (the engine evicts to make
  room for what it stores), else to the tenant that last got blocks on that worker; when that
  tenant is not the owner it is an eviction *caused to another tenant*.

What it does not see: blocks stored for requests another router sent (no owner here, so not
counted: each router counts the blocks its own requests made, and the routers' figures add
up), evictions an engine makes for its own reasons (charged as above), offload tiers (only
GPU blocks count), and a worker that restarts or clears its cache (its blocks are dropped,
not counted as evictions).

Claims are made after the reply (off the client's wait): blocks the engine reported stored
before their claim wait (bounded) for it, and an eviction made by a batch whose stored blocks
had no owner yet is charged when they get one.

Invariants: pure (no I/O, no clock); bounded: per worker at most ~``2 × max_recent`` claims
waiting for their blocks and as many blocks waiting for a claim (the oldest generation
dropped whole), owned blocks at most what the workers report stored.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

MAX_RECENT = 200_000  # per worker: claims waiting for their blocks, blocks waiting for a claim
_MISS = object()


class _Recent:
    """A bounded map of the newest ~``cap`` entries: two generations, the older one dropped
    whole when the newer fills (O(1), no scan)."""

    __slots__ = ("cap", "new", "old")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.new: dict[int, Any] = {}
        self.old: dict[int, Any] = {}

    def put(self, k: int, v: Any) -> None:
        self.new[k] = v
        if len(self.new) >= self.cap:
            self.old, self.new = self.new, {}

    def pop(self, k: int) -> Any:
        v = self.new.pop(k, _MISS)
        return self.old.pop(k, _MISS) if v is _MISS else v

    def __len__(self) -> int:
        return len(self.new) + len(self.old)


class TenantCacheLedger:
    def __init__(self, max_recent: int = MAX_RECENT) -> None:
        self.max_recent = max_recent
        self.owner: dict[str, dict[int, str]] = {}  # worker -> key -> tenant
        # claims whose blocks were not reported stored yet: worker -> key -> tenant
        self.pending: dict[str, _Recent] = {}
        # blocks reported stored before any claim: worker -> key -> the batch that stored it
        self.unclaimed: dict[str, _Recent] = {}
        # evictions made by a batch whose stored blocks had no owner yet: batch -> victims
        self.victims: dict[int, Counter[str]] = {}
        self._batch = 0
        self.last_storer: dict[str, str] = {}  # worker -> tenant whose blocks it stored last
        self.held: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()  # the tenant's blocks evicted
        self.caused: Counter[str] = Counter()  # other tenants' blocks evicted by this tenant
        self.instances: dict[str, str] = {}

    def _recent(self, table: dict[str, _Recent], w: str) -> _Recent:
        r = table.get(w)
        if r is None:
            r = table[w] = _Recent(self.max_recent)
        return r

    # ------------------------------------------------------------------ the request side
    def claim(self, worker: str, tenant: str, keys: Iterable[int]) -> None:
        """``keys``: the blocks the worker computed (or will) for ``tenant``'s request."""
        owned = self.owner.setdefault(worker, {})
        pending = self._recent(self.pending, worker)
        waiting = pending.new
        unclaimed = self.unclaimed.get(worker)
        if unclaimed is not None and not len(unclaimed):
            unclaimed = None
        for k in keys:
            if k in owned:
                continue
            if unclaimed is not None:
                batch = unclaimed.pop(k)
                if batch is not _MISS:  # reported stored already: owned now
                    self._own(worker, owned, k, tenant)
                    hit = self.victims.pop(batch, None)  # what storing it evicted
                    if hit:
                        self._charge(tenant, hit)
                    continue
            waiting[k] = tenant  # its stored event is still to come
        if len(waiting) >= pending.cap:
            pending.old, pending.new = waiting, {}

    # ------------------------------------------------------------------ the engine side
    def apply(self, batch: KvEventBatch) -> None:
        w = batch.worker_id
        if self.instances.get(w) not in (None, batch.instance_id):
            self.drop_worker(w)  # restarted: its blocks are gone, not evicted
        self.instances[w] = batch.instance_id
        self._batch += 1
        causer = self._storer_of(w, batch)
        victims: Counter[str] = Counter()
        unowned_store = False
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.tier == "gpu":
                    unowned_store |= self._stored(w, ev.keys)
            elif isinstance(ev, BlockRemoved):
                if ev.tier == "gpu":
                    self._removed(w, ev.keys, victims)
            elif isinstance(ev, AllBlocksCleared):
                self.drop_worker(w)
        if not victims:
            return
        if causer is None and unowned_store:  # charged when its blocks are claimed
            self.victims[self._batch] = victims
            while len(self.victims) > self.max_recent:
                del self.victims[next(iter(self.victims))]
            return
        causer = causer or self.last_storer.get(w)
        if causer is not None:
            self._charge(causer, victims)

    def _charge(self, causer: str, victims: Counter[str]) -> None:
        for victim, n in victims.items():
            if victim != causer:
                self.caused[causer] += n

    def _storer_of(self, w: str, batch: KvEventBatch) -> str | None:
        """The tenant whose claimed blocks this batch stores (the first), if any."""
        pending = self.pending.get(w)
        if pending is None:
            return None
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.tier == "gpu":
                for k in ev.keys:
                    t = pending.new.get(k) or pending.old.get(k)
                    if t is not None:
                        return t
        return None

    def _own(self, w: str, owned: dict[int, str], k: int, t: str) -> None:
        owned[k] = t
        self.held[t] += 1
        self.last_storer[w] = t

    def _stored(self, w: str, keys: list[int]) -> bool:
        """True when some stored block has no claim yet."""
        owned = self.owner.setdefault(w, {})
        pending = self.pending.get(w)
        new, old = (pending.new, pending.old) if pending is not None else ({}, {})
        unclaimed = None
        last = None
        for k in keys:
            if k in owned:
                continue
            t = new.pop(k, None) or old.pop(k, None)
            if t is None:
                if unclaimed is None:
                    unclaimed = self._recent(self.unclaimed, w)
                unclaimed.put(k, self._batch)
            else:
                owned[k] = last = t
                self.held[t] += 1
        if last is not None:
            self.last_storer[w] = last
        return unclaimed is not None

    def _removed(self, w: str, keys: list[int], victims: Counter[str]) -> None:
        owned = self.owner.get(w)
        unclaimed = self.unclaimed.get(w)
        for k in keys:
            if unclaimed is not None:
                unclaimed.pop(k)
            t = owned.pop(k, None) if owned else None
            if t is None:
                continue
            self.held[t] -= 1
            self.evicted[t] += 1
            victims[t] += 1

    def drop_worker(self, w: str) -> None:
        for t in (self.owner.pop(w, None) or {}).values():
            self.held[t] -= 1
        for table in (self.pending, self.unclaimed):
            table.pop(w, None)
        self.last_storer.pop(w, None)
        self.instances.pop(w, None)


# ---------------------------------------------------------------------------- I/O and metrics
class TenantCacheFeed:
    """Feeds a router's ledger: the claims of its requests (:meth:`claim`, at dispatch) and
    the workers' KV events (a core subscription to ``kv.events.*``, opened once the router
    knows a tenant: a router without tenants decodes no KV events for this)."""

    def __init__(self, bus: Any, ledger: TenantCacheLedger | None = None) -> None:
        self.bus = bus
        self.ledger = ledger if ledger is not None else TenantCacheLedger()
        self._sub: Any = None
        self._starting = False
        _LEDGERS.add(self.ledger)

    @property
    def active(self) -> bool:
        return self._sub is not None

    async def start(self) -> None:
        if self._starting:
            return
        self._starting = True
        try:
            self._sub = await self.bus.subscribe(
                self.bus.subjects.kv_events_all, KvEventBatch, self._on
            )
        except Exception:
            self._starting = False  # the next directory tries again
            raise

    async def _on(self, batch: KvEventBatch, _raw: Any) -> None:
        self.ledger.apply(batch)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        self._starting = False


_LEDGERS: weakref.WeakSet[TenantCacheLedger] = weakref.WeakSet()


class _LedgerCollector:
    """Exports the process's ledgers at scrape time (nothing is updated per KV event)."""

    def describe(self) -> list[Any]:
        return list(self._families())

    def collect(self) -> Iterable[Any]:
        return self._families()

    def _families(self) -> Iterable[Any]:
        held = GaugeMetricFamily(
            "kvgate_tenant_cache_blocks",
            "GPU KV blocks a tenant's requests (sent by this router) stored and still held",
            labels=["tenant"],
        )
        evicted = CounterMetricFamily(
            "kvgate_tenant_cache_evicted_blocks",
            "A tenant's KV blocks the engines evicted",
            labels=["tenant"],
        )
        caused = CounterMetricFamily(
            "kvgate_tenant_cache_evictions_caused",
            "Other tenants' KV blocks evicted while the engine stored this tenant's",
            labels=["tenant"],
        )
        totals: dict[str, Counter[str]] = {"h": Counter(), "e": Counter(), "c": Counter()}
        for ledger in list(_LEDGERS):
            totals["h"].update(ledger.held)
            totals["e"].update(ledger.evicted)
            totals["c"].update(ledger.caused)
        for tenant, n in sorted(totals["h"].items()):
            held.add_metric([tenant], n)
        for tenant, n in sorted(totals["e"].items()):
            evicted.add_metric([tenant], n)
        for tenant, n in sorted(totals["c"].items()):
            caused.add_metric([tenant], n)
        yield held
        yield evicted
        yield caused


REGISTRY.register(_LedgerCollector())
