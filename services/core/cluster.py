"""The router's view of the cluster, kept as live :class:`WorkerState` objects that the policy
core reads directly (no per-request copying: building a snapshot is O(1)).

Fed by the live router (services/router/cluster_feed.py) from heartbeats, telemetry, worker
control, other routers' loads and its own dispatches (services.core.lifecycle), and by the
cluster simulator (bench/simcore.py) the same way on its virtual clock. Time is passed in
(``now`` = monotonic seconds, ``wall`` = epoch seconds; the simulator passes virtual seconds
for both), so the class is pure and testable without clocks.

Invariants:
- a worker is in :attr:`states` from its first heartbeat until it has been silent for
  ``forget_after`` seconds (with nothing in flight there); then nothing is kept for it but a
  cordon or drain, and ``snapshot.removed`` counts it, so the policies drop their state for it
  too; it is ``healthy`` only while heartbeats are younger than ``worker_timeout`` and its
  state is ``ready``;
- ``states[w].inflight == local inflight + sum of fresh remote router reports``;
- ``states[w].kv_blocks_free`` = telemetry free blocks minus blocks this router reserved for
  requests dispatched at or after that sample's ``ts`` (or, without telemetry, total minus all
  reservations); that reserved sum is kept per worker for the current sample (``_reserved``:
  recounted when a new sample arrives, then moved by each reserve and release), so a dispatch
  costs O(1) however many requests the worker has in flight;
- cordon / drain from ``workers.control`` stick until ``uncordon`` (drain also from heartbeats);
- a worker's URL is the one pinned by :attr:`pins` (services.core.url_pin): a heartbeat the
  pin refuses (:meth:`url_refusal`) changes nothing, not even the worker's liveness (its real
  worker, at the pinned URL, keeps it alive; a worker that truly moved goes unhealthy, not to
  a URL nobody vouched for), until the allowlist or an operator's ``repin`` lets it in;
- every change this class makes to a worker's state (and its arrival or removal) adds the
  worker's id to each set in ``snapshot.watchers`` (the policies' incremental views).
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass

import msgspec

from services.common.schemas import WorkerControl, WorkerHeartbeat, WorkerLoad
from services.core.keys import blocks_needed
from services.core.policy import Capacity, ClusterSnapshot, WorkerState
from services.core.url_pin import Refusal, UrlPins


class Ticket(msgspec.Struct):
    """One dispatched request's claim on a worker (released exactly once). A msgspec struct:
    one per dispatch, live and in the simulator."""

    worker_id: str
    blocks: int
    prefill: int
    wall: float
    prefilling: bool = True
    released: bool = False
    # 1 / (max_tokens - 1): the TPOT a stall of one second adds to it while it decodes (its
    # TPOT averages its max_tokens - 1 gaps; a one-token answer has none: 0)
    gap: float = 0.0


@dataclass
class _Local:
    inflight: int = 0
    prefill: int = 0
    blocks: int = 0  # KV blocks reserved by this router's in-flight requests
    gaps: float = 0.0  # sum of Ticket.gap over this router's requests past their first token


@dataclass
class _Entry:
    hb: WorkerHeartbeat
    seen: float
    load: WorkerLoad | None = None
    load_seen: float = 0.0
    control: str | None = None  # "cordon" | "drain" | None


def prefills_alone(hb: WorkerHeartbeat) -> bool:
    """Can the engine compute a prompt by itself? Not an SGLang decode server: SGLang 0.5.23's
    decode path (sglang/srt/disaggregation/decode.py) waits for every request's KV from a
    prefill server's bootstrap room; vLLM decoders (kv_both / kv_consumer) compute locally what
    they were not sent."""
    return not (hb.role == "decode" and hb.engine == "sglang")


class ClusterState:
    def __init__(
        self,
        worker_timeout: float = 3.0,
        telemetry_stale_s: float = 2.0,
        remote_ttl_s: float = 3.0,
        forget_after: float = 300.0,
        pins: UrlPins | None = None,
    ) -> None:
        self.worker_timeout = worker_timeout
        self.pins = pins if pins is not None else UrlPins()
        self.telemetry_stale_s = telemetry_stale_s
        self.remote_ttl_s = remote_ttl_s
        self.forget_after = forget_after
        self.states: dict[str, WorkerState] = {}
        self._entries: dict[str, _Entry] = {}
        self._local: dict[str, _Local] = {}
        # per worker, its live tickets by id(): released in any order in O(1)
        self._tickets: dict[str, dict[int, Ticket]] = {}
        # per worker: [telemetry sample ts, blocks reserved by tickets dispatched at or after it]
        self._reserved: dict[str, list[float]] = {}
        # per other router: (last heard, its in-flight per worker, its queued prefill per worker)
        self._remote: dict[str, tuple[float, dict[str, int], dict[str, int]]] = {}
        # per worker, the sums over self._remote (refreshing a worker's load reads these, not
        # every router's counts; a router's message changes them by what changed in it)
        self._remote_inflight: dict[str, int] = {}
        self._remote_prefill: dict[str, int] = {}
        self._controls: dict[str, str] = {}  # control may arrive before the first heartbeat
        self._breaker_open: set[str] = set()
        self._ejected: set[str] = set()  # latency outliers (services/router/outlier.py)
        # change notification for the policies' incremental views (ClusterSnapshot.watchers)
        self.snapshot = ClusterSnapshot(self.states, watchers=[])
        self.block_sizes: set[int] = set()
        self.lora_names: frozenset[str] = frozenset()  # adapters any known worker serves

    # ------------------------------------------------------------------ inputs
    def url_refusal(self, hb: WorkerHeartbeat) -> Refusal | None:
        """Why :meth:`on_heartbeat` would ignore ``hb`` (its URL is not the pinned one, or
        outside the allowlist); None: it would apply it."""
        return self.pins.check(hb.worker_id, hb.url)

    def on_heartbeat(self, hb: WorkerHeartbeat, now: float) -> bool:
        """Returns True when the worker is new or came back (capacity may have changed); a
        heartbeat the URL pin refuses is ignored (False)."""
        if self.pins.check(hb.worker_id, hb.url) is not None:
            return False
        self.pins.accept(hb.worker_id, hb.url)
        e = self._entries.get(hb.worker_id)
        new = e is None or now - e.seen > self.worker_timeout
        old_loras = e.hb.loras if e is not None else ()
        if e is None:
            e = self._entries[hb.worker_id] = _Entry(hb, now)
            self._local.setdefault(hb.worker_id, _Local())
            self._tickets.setdefault(hb.worker_id, {})
        e.hb, e.seen = hb, now
        if hb.loras != old_loras:
            self._refresh_loras()
        c = hb.capacity
        s = self.states.get(hb.worker_id)
        if s is None:
            s = self.states[hb.worker_id] = WorkerState(hb.worker_id)
            self._notify(hb.worker_id)
        cap = Capacity(c.block_size, c.num_gpu_blocks, c.max_num_seqs, c.max_model_len)
        url = hb.url.rstrip("/")
        alone = prefills_alone(hb)
        if (s.model, s.url, s.loras, s.capacity, s.role, s.prefills_alone) != (
            hb.model,
            url,
            hb.loras,
            cap,
            hb.role,
            alone,
        ):
            s.model, s.url, s.loras, s.capacity, s.role = hb.model, url, hb.loras, cap, hb.role
            s.prefills_alone = alone
            self._notify(hb.worker_id)
        self._block_sizes_changed()
        self._refresh(hb.worker_id, now)
        return new

    def heartbeat_of(self, worker_id: str) -> WorkerHeartbeat | None:
        """The worker's last applied heartbeat (what it announced of itself), or None."""
        e = self._entries.get(worker_id)
        return e.hb if e is not None else None

    def _block_sizes_changed(self) -> None:
        self.block_sizes = {x.capacity.block_size for x in self.states.values()}
        self.snapshot.max_block_size = max(self.block_sizes, default=0)

    def on_load(self, load: WorkerLoad, now: float) -> None:
        e = self._entries.get(load.worker_id)
        if e is None:
            return
        e.load, e.load_seen = load, now
        self._refresh(load.worker_id, now)

    def on_control(self, ctl: WorkerControl, now: float) -> None:
        if ctl.action == "repin":  # not an admin state: the pin opens, routing is unchanged
            self.pins.repin(ctl.worker_id, ctl.url, now)
            return
        if ctl.action == "uncordon":
            self._controls.pop(ctl.worker_id, None)
        else:
            self._controls[ctl.worker_id] = ctl.action
        if ctl.worker_id in self.states:
            self._refresh(ctl.worker_id, now)

    def on_router_load(
        self, router_id: str, inflight: dict[str, int], prefill: dict[str, int], now: float
    ) -> None:
        """Another router's counts (every worker it has requests on): only the workers whose
        counts changed since its last message are refreshed (O(changes) in Python; the
        comparison of the two messages runs in C), so a fleet of 1,000 workers costs a router
        little per message from each of its peers."""
        old = self._remote.get(router_id)
        new_in, new_pre = dict(inflight), dict(prefill)
        self._remote[router_id] = (now, new_in, new_pre)
        old_in, old_pre = (old[1], old[2]) if old is not None else ({}, {})
        touched = _shift(self._remote_inflight, old_in, new_in)
        touched |= _shift(self._remote_prefill, old_pre, new_pre)
        for wid in touched:
            self._refresh_load(wid)

    @property
    def remote_routers(self) -> KeysView[str]:
        """The other routers heard from (their last load message within ``remote_ttl_s``);
        a live view, valid for the state's lifetime."""
        return self._remote.keys()

    def set_breaker_open(self, worker_id: str, is_open: bool) -> None:
        if is_open:
            self._breaker_open.add(worker_id)
        else:
            self._breaker_open.discard(worker_id)
        s = self.states.get(worker_id)
        if s is not None:
            v = is_open or worker_id in self._ejected
            if s.circuit_open != v:
                s.circuit_open = v
                self._notify(worker_id)

    def set_ejected(self, worker_id: str, ejected: bool) -> None:
        """A latency outlier is out of rotation like a worker whose circuit is open."""
        if ejected:
            self._ejected.add(worker_id)
        else:
            self._ejected.discard(worker_id)
        s = self.states.get(worker_id)
        if s is not None:
            v = ejected or worker_id in self._breaker_open
            if s.circuit_open != v:
                s.circuit_open = v
                self._notify(worker_id)

    def keep_alive(self, now: float) -> None:
        """While the bus is down no heartbeat can arrive: keep the last known workers."""
        for e in self._entries.values():
            e.seen = max(e.seen, now - self.worker_timeout / 2)

    def sweep(self, now: float) -> bool:
        """Age heartbeats, telemetry and remote loads; returns True if anything changed."""
        changed = False
        for rid, (seen, inflight, prefill) in list(self._remote.items()):
            if now - seen > self.remote_ttl_s:
                del self._remote[rid]
                touched = _shift(self._remote_inflight, inflight, {})
                touched |= _shift(self._remote_prefill, prefill, {})
                for wid in touched:
                    self._refresh_load(wid)
                changed = True
        self.pins.expire(now)
        for wid in list(self._entries):
            e = self._entries[wid]
            if now - e.seen > self.forget_after and not self._local[wid].inflight:
                del self._entries[wid]
                self.pins.depart(wid, now)  # its pin stays a while: the id is not up for grabs
                self.states.pop(wid, None)
                # no request in flight there: no ticket to release, nothing reserved
                self._local.pop(wid, None)
                self._tickets.pop(wid, None)
                self._reserved.pop(wid, None)
                self.snapshot.removed += 1  # the policies drop their state for it
                self._notify(wid)
                self._block_sizes_changed()
                self._refresh_loras()
                changed = True
                continue
            before = (self.states[wid].healthy, self.states[wid].telemetry_stale)
            self._refresh(wid, now)
            changed |= before != (self.states[wid].healthy, self.states[wid].telemetry_stale)
        return changed

    # ------------------------------------------------------------------ dispatch
    def reserve(
        self, worker_id: str, prompt_tokens: int, max_tokens: int, cached_tokens: int, wall: float
    ) -> Ticket:
        s = self.states[worker_id]
        bs = s.capacity.block_size
        blocks = max(0, blocks_needed(prompt_tokens, max_tokens, bs) - cached_tokens // bs)
        gap = 1.0 / (max_tokens - 1) if max_tokens > 1 else 0.0
        t = Ticket(worker_id, blocks, max(0, prompt_tokens - cached_tokens), wall, gap=gap)
        loc = self._local[worker_id]
        loc.inflight += 1
        loc.prefill += t.prefill
        loc.blocks += t.blocks
        self._tickets[worker_id][id(t)] = t
        r = self._reserved.get(worker_id)
        if r is not None and wall >= r[0]:
            r[1] += t.blocks
        self._refresh_load(worker_id)
        self._refresh_kv(worker_id)
        return t

    def first_token(self, t: Ticket, now: float | None = None) -> None:
        """The request's prefill is done: release its queued prefill; ``now`` (monotonic) is
        recorded as the worker's ``first_token_at`` (policies time prefills with it)."""
        if t.prefilling and not t.released:
            t.prefilling = False
            loc = self._local.get(t.worker_id)
            if loc is not None:
                loc.prefill -= t.prefill
                loc.gaps += t.gap
                self._refresh_load(t.worker_id)
            s = self.states.get(t.worker_id)
            if now is not None and s is not None:
                s.first_token_at = now
                self._notify(t.worker_id)

    def release(self, t: Ticket) -> None:
        if t.released:
            return
        self.first_token(t)
        t.released = True
        loc = self._local.get(t.worker_id)
        if loc is None:
            return
        loc.inflight -= 1
        loc.blocks -= t.blocks
        # (first_token above added its gap if it had not been); no float residue when empty
        loc.gaps = loc.gaps - t.gap if loc.inflight > 0 else 0.0
        if self._tickets[t.worker_id].pop(id(t), None) is t:
            r = self._reserved.get(t.worker_id)
            if r is not None and t.wall >= r[0]:
                r[1] -= t.blocks
        if t.worker_id in self.states:
            self._refresh_load(t.worker_id)
            self._refresh_kv(t.worker_id)

    # ------------------------------------------------------------------ views
    def local_inflight(self) -> dict[str, int]:
        return {w: loc.inflight for w, loc in self._local.items() if loc.inflight}

    def local_prefill(self) -> dict[str, int]:
        return {w: loc.prefill for w, loc in self._local.items() if loc.prefill}

    def routable_count(self) -> int:
        return sum(1 for s in self.states.values() if s.routable)

    def _refresh_loras(self) -> None:
        self.lora_names = frozenset(x for e in self._entries.values() for x in e.hb.loras)

    def is_lora(self, model: str) -> bool:
        """Does ``model`` name a LoRA adapter some worker serves (its prompt keys then use
        the adapter's seed, as the engine's KV events do)?"""
        return model in self.lora_names

    def models(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.states.values():
            if s.healthy:
                for name in (s.model, *s.loras):
                    out[name] = out.get(name, 0) + 1
        return out

    # ------------------------------------------------------------------ internals
    def _notify(self, wid: str) -> None:
        """``wid``'s state changed: tell the policies' incremental views
        (``ClusterSnapshot.watchers``)."""
        for w in self.snapshot.watchers:
            w.add(wid)

    def _refresh(self, wid: str, now: float) -> None:
        e = self._entries[wid]
        s = self.states[wid]
        before = _signature(s)
        ctl = self._controls.get(wid)
        s.healthy = now - e.seen <= self.worker_timeout and e.hb.state != "starting"
        s.cordoned = ctl == "cordon"
        s.draining = ctl == "drain" or e.hb.state == "draining"
        s.circuit_open = wid in self._breaker_open or wid in self._ejected
        load = e.load
        if load is not None:
            age = now - e.load_seen
            s.telemetry_age_s = age
            s.telemetry_stale = load.stale or age > self.telemetry_stale_s
            fresh = not s.telemetry_stale
            s.running = load.running if fresh else None
            s.waiting = load.waiting if fresh else None
            s.kv_usage = load.kv_usage if fresh else None
            sm = mem = bw = None
            if fresh and load.gpus:
                sms = [g.sm_util_pct for g in load.gpus if g.sm_util_pct is not None]
                bws = [g.mem_bw_util_pct for g in load.gpus if g.mem_bw_util_pct is not None]
                mems = [
                    g.mem_used_bytes / g.mem_total_bytes
                    for g in load.gpus
                    if g.mem_used_bytes is not None and g.mem_total_bytes
                ]
                sm = max(sms) / 100.0 if sms else None
                bw = max(bws) / 100.0 if bws else None
                mem = max(mems) if mems else None
            s.gpu_sm_util, s.gpu_mem_used, s.gpu_bw_util = sm, mem, bw
        if _signature(s) != before:
            self._notify(wid)
        self._refresh_load(wid)
        self._refresh_kv(wid)

    def _refresh_load(self, wid: str) -> None:
        s = self.states.get(wid)
        if s is None:
            return
        loc = self._local.get(wid)
        inflight = (loc.inflight if loc else 0) + self._remote_inflight.get(wid, 0)
        prefill = (loc.prefill if loc else 0) + self._remote_prefill.get(wid, 0)
        gaps = loc.gaps if loc and loc.gaps > 1e-12 else 0.0
        if s.inflight != inflight or s.pending_prefill_tokens != prefill or s.decode_gaps != gaps:
            s.inflight = inflight
            s.pending_prefill_tokens = prefill
            s.decode_gaps = gaps
            self._notify(wid)

    def _refresh_kv(self, wid: str) -> None:
        s = self.states[wid]
        e = self._entries[wid]
        tickets = self._tickets.get(wid, {})
        load = e.load
        if load is not None and not s.telemetry_stale and load.kv_blocks_free is not None:
            since = load.ts
            # a sample taken at ts does not contain a request dispatched at ts (the simulator samples,
            # then dispatches, at one virtual instant)
            r = self._reserved.get(wid)
            if r is None or r[0] != since:  # a new sample: count once, then keep it moving
                r = self._reserved[wid] = [
                    since,
                    sum(t.blocks for t in tickets.values() if t.wall >= since),
                ]
            free = max(0, load.kv_blocks_free - int(r[1]))
        else:
            loc = self._local.get(wid)
            free = max(0, s.capacity.num_gpu_blocks - (loc.blocks if loc else 0))
        if s.kv_blocks_free != free:
            s.kv_blocks_free = free
            self._notify(wid)


def _shift(sums: dict[str, int], old: dict[str, int], new: dict[str, int]) -> set[str]:
    """One router's counts went from ``old`` to ``new``: move ``sums`` (per worker, over every
    router) by the difference; returns the workers whose count changed."""
    changed = {wid for wid, _n in old.items() ^ new.items()}
    for wid in changed:
        n = sums.get(wid, 0) + new.get(wid, 0) - old.get(wid, 0)
        if n:
            sums[wid] = n
        else:
            sums.pop(wid, None)
    return changed


def _signature(s: WorkerState) -> tuple:
    """The state :meth:`ClusterState._refresh` sets besides load and free blocks (the telemetry
    sample's age aside: it changes at every refresh and no policy reads it)."""
    return (
        s.healthy,
        s.cordoned,
        s.draining,
        s.circuit_open,
        s.telemetry_stale,
        s.running,
        s.waiting,
        s.kv_usage,
        s.gpu_sm_util,
        s.gpu_mem_used,
        s.gpu_bw_util,
    )
