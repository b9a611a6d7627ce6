"""TensorRT-LLM bridge: poll trtllm-serve's ``POST /kv_cache_events`` -> canonical events.

trtllm-serve drains its KV-event queue on each call and answers a JSON list (see
engine_formats). Tokens ride inside each stored block, so keys are derived exactly as for
vLLM. ``event_id`` increases by one per event; the endpoint has no replay, so a jump is
counted (``seq_gap_unrecovered``) and the indexer's view of this worker is repaired by the
usual path (its blocks age out through removals; a fresh ``created`` event or an engine
restart starts clean). An ``event_id`` that falls back (engine restart) starts a new instance.

History lost -- a jump in ``event_id``, or a first event past id 0 that is not the engine's
``created`` event (the bridge started after the engine's first events were drained or
dropped) -- is recorded in the runtime's history ledger: until the engine restarts or clears
its cache, dumps say the view lacks it and ``index verify`` answers unknown, not equal.
"""

from __future__ import annotations

import asyncio

import aiohttp

from services.common.aio import wait_event
from services.common.logging import get_logger
from services.kv_indexer.bridges.engine_formats import TCreated, decode_trtllm
from services.kv_indexer.bridges.runtime import BRIDGE_GAPS, BridgeRuntime

log = get_logger("bridge.trtllm")

NO_REPLAY = "TensorRT-LLM's /kv_cache_events has no replay: events not polled are gone"


class TrtllmBridge:
    def __init__(self, runtime: BridgeRuntime, url: str, poll_s: float = 0.05) -> None:
        self.rt = runtime
        self.url = url.rstrip("/")
        self.poll_s = poll_s
        self.last_event_id: int | None = None
        self.polls = 0
        self.events = 0
        self.gaps = 0
        self.errors = 0
        self.view_from = 0  # event id of the first event of the current view

    def handle_body(self, body: bytes) -> None:
        """One poll's reply: check event ids, re-key, queue one canonical batch."""
        events, bad = decode_trtllm(body)
        for reason, detail in bad:
            self.rt.bad(reason, detail)
        events.sort(key=lambda e: e.event_id)
        keep = []
        for ev in events:
            last = self.last_event_id
            if last is not None and ev.event_id <= last:
                if ev.event_id == 0 or isinstance(ev.data, TCreated):
                    self.rt.emit(self.rt.rekeyer.trtllm_events(keep))
                    keep = []
                    self.rt.new_instance("engine_restarted")
                    self.view_from = ev.event_id
                else:
                    continue  # duplicate
            elif last is not None and ev.event_id > last + 1:
                self.gaps += 1
                BRIDGE_GAPS.inc()
                self.rt.bad("seq_gap_unrecovered", f"events {last + 1}..{ev.event_id - 1} lost")
                self.rt.history_lost(
                    "unrecovered_gap", last + 1, ev.event_id - 1, self.view_from, NO_REPLAY
                )
            elif last is None:
                self.view_from = ev.event_id
                if ev.event_id > 0 and not isinstance(ev.data, TCreated):
                    self.rt.history_lost("lost_history", 0, ev.event_id - 1, ev.event_id, NO_REPLAY)
            self.last_event_id = ev.event_id
            keep.append(ev)
        self.events += len(keep)
        self.rt.emit(self.rt.rekeyer.trtllm_events(keep))
        # trtllm-serve reports no block size over HTTP: each stored block carries its tokens
        if self.rt.rekeyer.block_size and not self.rt.block_size_known.is_set():
            self.rt.block_size_known.set()

    async def run(self, stop: asyncio.Event) -> None:
        self.rt.mark_ready()  # no replay to wait for: the endpoint hands over what it queued
        timeout = aiohttp.ClientTimeout(total=10.0)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while not stop.is_set():
                try:
                    async with s.post(f"{self.url}/kv_cache_events") as r:
                        body = await r.read()
                        ok = r.status == 200
                    self.polls += 1
                    if ok:
                        self.handle_body(body)
                    else:
                        self.errors += 1
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self.errors += 1
                    if self.errors == 1 or self.errors % 100 == 0:
                        log.warning("poll failed", url=self.url, error=repr(exc))
                await wait_event(stop, self.poll_s)
