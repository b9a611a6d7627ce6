"""The built-in operator page: a static shell served at ``/ui/`` (HTML, JS, CSS and SVG
charts written for kvgate, no build step) that reads everything it shows from the admin API
with the operator's token.

- :class:`DecisionFeed` keeps the last routing decisions (router outcomes) this API replica
  saw on the bus, each with a sequence number, for ``GET /api/v1/decisions?after=N``.
- The page itself holds no data, so it is served without a token; every number on it comes
  from a viewer/admin-token call (the token is given in the URL fragment ``#token=...``, which
  browsers never send to the server, or typed into the page) and ack / silence need admin.

Invariant: the feed is bounded (``maxlen``) and its sequence numbers only grow, so a page that
polls with ``after`` sees each decision at most once and notices when it fell behind.
"""

from __future__ import annotations

import time
from collections import deque
from importlib import resources
from typing import Annotated, Any

from aiohttp import web
from msgspec import Meta

from services.api.framework import Req, Route
from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import RouterOutcome

log = get_logger("api.ui")
V1 = "/api/v1"
STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# the page's icon, kept here rather than as a static file so that packaging needs no new glob
FAVICON_SVG = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    b'<rect width="32" height="32" rx="6" fill="#111827"/>'
    b'<path d="M7 7h4v7l7-7h5l-8 8 8 10h-5l-6-7.5-1 1V25H7z" fill="#0ea5e9"/></svg>'
)


class DecisionFeed:
    """The last ``maxlen`` routing decisions, numbered."""

    def __init__(self, maxlen: int = 500) -> None:
        self.items: deque[tuple[int, dict[str, Any]]] = deque(maxlen=maxlen)
        self.seq = 0
        self._sub: Any = None

    def add(self, o: RouterOutcome) -> None:
        self.seq += 1
        self.items.append(
            (
                self.seq,
                {
                    "seq": self.seq,
                    "ts": o.ts,
                    "request_id": o.request_id,
                    "router_id": o.router_id,
                    "policy": o.policy,
                    "policy_version": o.policy_version,
                    "arm": o.arm,
                    "canary_id": o.canary_id,
                    "model": o.model,
                    "worker_id": o.worker_id,
                    "status": o.status,
                    "prompt_tokens": o.prompt_tokens,
                    "predicted_cached_tokens": o.predicted_cached_tokens,
                    "cached_tokens": o.cached_tokens,
                    "available_cached_tokens": o.available_cached_tokens,
                    "lost_reason": o.lost_reason,
                    "ttft_s": o.ttft_s,
                    "e2e_s": o.e2e_s,
                    "retries": o.retries,
                    "migrated": o.migrated,
                    # disaggregated serving: the worker that prefilled (worker_id decoded)
                    "prefill_worker": o.prefill_worker,
                    "prefill_s": o.prefill_s,
                    "handoff_s": o.handoff_s,
                },
            )
        )

    def after(self, seq: int, limit: int) -> list[dict[str, Any]]:
        out = [d for s, d in self.items if s > seq]
        return out[-limit:]

    async def start(self, bus: Bus) -> None:
        """A plain (not durable) subscription: every replica sees every decision live."""

        async def on(o: RouterOutcome, _raw: Any) -> None:
            self.add(o)

        self._sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the bus may be closing already
                log.debug("decision feed unsubscribe failed", error=repr(exc))
            self._sub = None


def routes(feed: DecisionFeed) -> list[Route]:
    async def list_decisions(r: Req) -> dict[str, Any]:
        after = r.query.get("after", 0)
        limit = r.query.get("limit", 100)
        # now: the page's req/s counts decisions by their ts against this clock, not its own
        return {"decisions": feed.after(after, limit), "last": feed.seq, "now": time.time()}

    return [
        Route(
            "GET",
            f"{V1}/decisions",
            list_decisions,
            "recent routing decisions seen on the bus (router outcomes), oldest first",
            "workers",
            query={
                "after": Annotated[int, Meta(ge=0)],
                "limit": Annotated[int, Meta(ge=1, le=500)],
            },
        )
    ]


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def add_static(app: web.Application) -> None:
    """``/ui/`` and its assets (read once; no data in them)."""
    files = {name: _static(name) for name in STATIC}
    headers = {
        # the page's own code only: no inline script, no third-party origin
        "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
        "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    def handler(name: str):
        async def serve(_r: web.Request) -> web.Response:
            return web.Response(body=files[name], headers={**headers, "Content-Type": STATIC[name]})

        return serve

    async def to_slash(_r: web.Request) -> web.Response:
        raise web.HTTPFound("/ui/")

    async def favicon(_r: web.Request) -> web.Response:
        return web.Response(body=FAVICON_SVG, headers={**headers, "Content-Type": "image/svg+xml"})

    # browsers ask for /favicon.ico by themselves: the page's icon, not a 404 in every log
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/ui/favicon.svg", favicon)
    app.router.add_get("/ui", to_slash)
    app.router.add_get("/ui/", handler("index.html"))
    for name in STATIC:
        app.router.add_get(f"/ui/{name}", handler(name))
