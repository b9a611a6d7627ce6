"""Mid-stream migration: a worker's stream broke after the client got output; continue the
same client stream on another worker from prompt + generated text, re-framed in the client's
format (a completions request upstream, chat or completions chunks to the client).

Invariants: at most ``max_migrations`` continuations per request; every worker that broke is
excluded from the request's later decisions and counted against its breaker; each
continuation holds its own ticket, released in ``finally``; the client's stream always ends
(``[DONE]`` or an error event, then EOF) unless the client left.
"""

from __future__ import annotations

import contextlib
import time

from services.common.logging import get_logger
from services.router import metrics as M
from services.router import sse
from services.router.circuits import Circuits
from services.router.decide import Decider
from services.router.dispatch import Dispatcher
from services.router.http_server import Request, StreamResponse
from services.router.proxy import (
    ClientGone,
    Ctx,
    StreamBroken,
    Upstream5xx,
    WorkerFailed,
    upstream_body,
)
from services.router.send import Sender
from services.router.tokenize import Parsed

log = get_logger("router")


class Migrator:
    def __init__(
        self,
        decider: Decider,
        dispatcher: Dispatcher,
        sender: Sender,
        circuits: Circuits,
        max_migrations: int,
    ) -> None:
        self.decider = decider
        self.dispatcher = dispatcher
        self.sender = sender
        self.circuits = circuits
        self.max_migrations = max_migrations
        self.tokenizer = decider.parser.tokenizer

    async def migrate(self, request: Request, ctx: Ctx, exc: StreamBroken) -> None:
        """Continue the client's stream on another worker from prompt + generated text."""
        try:
            await self._continue(request, ctx, exc)
        finally:
            if ctx.trace is not None:  # the last continuation's spans end with the stream
                ctx.trace.end_migration(ctx.status)

    async def _continue(self, request: Request, ctx: Ctx, exc: StreamBroken) -> None:
        broken = exc
        while True:
            self.circuits.failure(broken.worker_id, broken.reason, ctx.sent_at)
            ctx.excluded.add(broken.worker_id)
            out = ctx.out
            assert out is not None
            if ctx.migrated >= self.max_migrations or not ctx.parsed.migratable:
                M.MIGRATIONS.labels("gave_up").inc()
                ctx.status, ctx.http_status = "error", 502
                await _end_with_error(out, f"worker failed mid-stream: {broken.reason}")
                return
            ctx.migrated += 1
            gen_tokens = len(self.tokenizer.encode(ctx.generated)) if ctx.generated else 0
            ctx.completion_tokens = ctx.carried_tokens = gen_tokens
            remaining = ctx.parsed.max_tokens - gen_tokens
            tr = ctx.trace
            if tr is not None:
                tr.start_migration(broken.worker_id, broken.reason, gen_tokens)
            log.info(
                "migrating stream",
                request_id=ctx.request_id,
                failed=broken.worker_id,
                generated_tokens=gen_tokens,
            )
            if remaining <= 0:
                M.MIGRATIONS.labels("completed").inc()
                await out.write(sse.DONE)
                await out.write_eof()
                return
            # decide among the others for prompt + generated text
            cont = Parsed(
                body=ctx.parsed.body,
                chat=ctx.parsed.chat,
                model=ctx.parsed.model,
                prompt=ctx.parsed.prompt + ctx.generated,
                token_ids=self.decider.parser.continuation_ids(
                    ctx.parsed, ctx.parsed.prompt + ctx.generated
                ),
                max_tokens=remaining,
                stream=True,
                seed=ctx.parsed.seed,
            )
            d, _ = self.decider.decide_for(
                cont, ctx.request_id, ctx.session_id, ctx.arm.policy, ctx.excluded
            )
            if d.worker_id is None:
                M.MIGRATIONS.labels("no_worker").inc()
                ctx.status, ctx.http_status = "error", 503
                await _end_with_error(
                    out, "worker failed mid-stream and no other worker can continue"
                )
                return
            wid = d.worker_id
            ctx.worker_id = wid
            ticket = self.dispatcher.reserve(wid, len(cont.token_ids), remaining, d.cached_tokens)
            self.circuits.sent(wid)  # a half-open circuit counts its trials
            if tr is not None:
                tr.start_attempt(wid, self.sender.url_of(wid), ctx.retries + ctx.migrated)
            try:
                body = upstream_body(ctx, migrate=True, max_tokens=remaining)
                ctx.sent_at = time.monotonic()
                try:
                    resp = await self.sender.post(ctx, wid, "/v1/completions", body, b"")
                except (WorkerFailed, Upstream5xx) as e:
                    broken = StreamBroken(wid, str(e))
                    continue
                if resp.status != 200:
                    resp.release()
                    broken = StreamBroken(wid, f"{resp.status} from worker")
                    continue
                try:
                    await self.sender.pump(request, ctx, wid, resp, ticket, reframe=True)
                    M.MIGRATIONS.labels("completed").inc()
                    return
                except ClientGone:
                    ctx.status, ctx.http_status = "cancelled", 499
                    return
                except WorkerFailed as e:
                    broken = StreamBroken(wid, e.reason)
                except StreamBroken as e:
                    broken = e
            finally:
                self.dispatcher.release_ticket(ticket)


async def _end_with_error(out: StreamResponse, message: str) -> None:
    """The client's stream ends with an error event (best effort: the client may be gone)."""
    with contextlib.suppress(Exception):
        await out.write(sse.event({"error": {"message": message, "type": "upstream_error"}}))
        await out.write_eof()
