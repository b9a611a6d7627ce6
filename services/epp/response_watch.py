"""What the EPP learns from a response passing through it (it moves no bytes itself: each
chunk goes back to the data plane unchanged): the first token's time, the data events of a
stream (one per token chunk) and the ``usage`` (completion and cached tokens), read with the
router's own SSE helpers and usage reading (services/router/sse.py, usage.py), for the
latency model and the outcome.

Invariants: at most one incomplete SSE event (a stream) or ``max_plain_bytes`` of a whole JSON
body is kept between chunks; a response it cannot read is only not counted, never an error.
"""

from __future__ import annotations

from services.router import sse
from services.router.proxy import Ctx
from services.router.usage import read_usage, take_usage


class ResponseWatch:
    def __init__(self, ctx: Ctx, streamed: bool, max_plain_bytes: int = 1 << 20) -> None:
        self.ctx = ctx
        self.streamed = streamed
        self.max_plain_bytes = max_plain_bytes
        self.rest = b""  # a stream's incomplete event, or a whole body read so far

    def chunk(self, data: bytes, end: bool) -> None:
        if self.streamed:
            self._events(self.rest + data if self.rest else data)
        elif len(self.rest) + len(data) <= self.max_plain_bytes:
            self.rest += data
            if end:
                read_usage(self.ctx, self.rest)
        else:
            self.rest = b""
            self.max_plain_bytes = -1  # too large to read: not counted

    def _events(self, buf: bytes) -> None:
        run, events, self.rest = sse.passthrough_split(buf)
        ctx = self.ctx
        if run:
            ctx.chunks += sse.data_events(run)
        for ev in events:
            payload = sse.payload_of(ev)
            if not payload:
                continue
            info = sse.inspect(payload, ctx.parsed.chat)
            if info.done:
                continue
            if info.usage is not None:
                take_usage(ctx, info.usage)
            if not info.usage_only:
                ctx.chunks += 1
