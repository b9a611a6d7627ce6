"""Disaggregated serving on the send path: when the decision names a prefill worker
(``Decision.prefill_worker``), the prompt is prefilled there and the answer streams from the
decode worker (``Decision.worker_id``), with the engines' own handshakes:

- ``nixl`` (vLLM's NIXL connector, ``kv_transfer_params``): the prefill request first (the
  client's body with ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``, ``max_tokens``
  1, no stream); the ``kv_transfer_params`` of its answer go into the decode request, which
  the decoder serves after pulling the prompt's KV (vLLM's toy proxy and llm-d do the same);
- ``bootstrap`` (SGLang): ``bootstrap_host`` / ``bootstrap_port`` (the prefill engine's
  bootstrap server) and a random ``bootstrap_room`` added to both requests, sent at once (as
  SGLang's load balancer and sgl-model-gateway do); the prefill's answer is discarded.

Which one: ``--pd-handshake`` (``auto``: a prefill engine that says it is SGLang uses
bootstrap, others NIXL). The prefill worker holds a ticket of its own while it prefills.

Invariants: a prefill that fails before the client saw anything raises :class:`PrefillFailed`
(a ``WorkerFailed`` naming the prefill worker: the request path excludes it, counts it
against its breaker and decides again, so another prefill worker, or the decoder alone,
serves it); a prefill answering 4xx is the client's error and is returned as it is; a decoder
failure is the send path's as for any worker (retry before output, migration after).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from services.common.logging import get_logger
from services.core.cluster import ClusterState, Ticket
from services.core.policy import Decision
from services.router import metrics as M
from services.router.dispatch import Dispatcher
from services.router.http_server import Reply, Request, Response
from services.router.proxy import Ctx, WorkerFailed, upstream_headers, worker_headers
from services.router.send import Sender
from services.router.upstream import FastClient, UpstreamError

log = get_logger("router")

HANDSHAKES = ("auto", "nixl", "bootstrap")
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
# what vLLM's toy proxy and llm-d's sidecar put in the prefill request
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class PrefillFailed(WorkerFailed):
    """The prefill worker failed before the client saw anything (retry elsewhere)."""


class PrefillRefused(Exception):
    """The prefill worker answered 4xx: the request is bad; answered to the client as is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


def prefill_body(body: dict[str, Any], extra: dict[str, Any], nixl: bool) -> bytes:
    """The prefill request: the client's body, one token, no stream, plus the handshake's
    fields (NIXL: ``kv_transfer_params`` asking for a remote decode)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if nixl:
        out["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    out.update(extra)
    return _encode(out)


def bootstrap_fields(prefill_url: str, port: int) -> dict[str, Any]:
    """SGLang's bootstrap fields for one request pair: the prefill engine's host and bootstrap
    port, and a random room (63 bits, as SGLang's load balancer draws it)."""
    return {
        "bootstrap_host": urlsplit(prefill_url).hostname or "",
        "bootstrap_port": port,
        "bootstrap_room": secrets.randbits(63),
    }


class PdSender:
    def __init__(
        self,
        state: ClusterState,
        dispatcher: Dispatcher,
        sender: Sender,
        fast: FastClient,
        st: Any,
    ) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.sender = sender
        self.fast = fast
        self.handshake = getattr(st, "pd_handshake", "auto")
        # how long a failed bootstrap decode waits for its prefill's outcome (to tell whose
        # failure it was): the time a dead prefill worker takes to refuse a connection
        self.blame_wait_s = st.connect_timeout
        self.request_timeout_s = st.request_timeout
        self.timeout = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )

    def kind_for(self, pwid: str) -> str:
        """The handshake to speak with prefill worker ``pwid``."""
        if self.handshake != "auto":
            return self.handshake
        hb = self.state.heartbeat_of(pwid)
        return "bootstrap" if hb is not None and hb.engine == "sglang" else "nixl"

    async def send(self, request: Request, ctx: Ctx, ticket: Ticket, d: Decision) -> Reply:
        pwid = d.prefill_worker
        assert pwid is not None
        kind = self.kind_for(pwid)
        ctx.prefill_worker = pwid
        ctx.pd_handshake = kind
        ctx.pd_transfer_predicted = d.transfer_s
        pticket, ctx.pd_ticket = ctx.pd_ticket, None  # taken by Dispatcher.dispatch
        if pticket is None:  # (a dispatcher without the P/D claim: claim it here)
            cached = d.prefill_cached_tokens
            pticket = self.dispatcher.reserve(pwid, len(ctx.parsed.token_ids), 1, cached)
        try:
            if kind == "nixl":
                ok = False
                try:
                    params = await self._prefill(ctx, pwid, {}, nixl=True)
                    ok = True
                finally:
                    self.dispatcher.prefilled(ctx, pticket, ok)
                ctx.pd_fields = {"kv_transfer_params": params}
                M.child(M.PD_REQUESTS, kind, "prefilled").inc()
                return await self.sender.send(request, ctx, ticket)
            return await self._bootstrap(request, ctx, ticket, pwid, pticket)
        except PrefillFailed:
            M.child(M.PD_REQUESTS, kind, "prefill_failed").inc()
            raise
        except PrefillRefused as exc:
            ctx.status, ctx.http_status = "error", exc.response.status
            return exc.response
        finally:
            self.dispatcher.prefilled(ctx, pticket, False)  # no-op once released

    async def _bootstrap(
        self, request: Request, ctx: Ctx, ticket: Ticket, pwid: str, pticket: Ticket
    ) -> Reply:
        """SGLang: both requests at once; a prefill that fails while the decoder has shown the
        client nothing cancels the decode request (it would wait for KV that never comes)."""
        url = self.state.states[pwid].url
        hb = self.state.heartbeat_of(pwid)
        port = (hb.bootstrap_port if hb is not None else 0) or SGLANG_BOOTSTRAP_PORT
        fields = bootstrap_fields(url, port)
        ctx.pd_fields = fields
        prefill = asyncio.ensure_future(self._prefill(ctx, pwid, fields, nixl=False))
        prefill.add_done_callback(
            lambda f: self.dispatcher.prefilled(
                ctx, pticket, not f.cancelled() and f.exception() is None
            )
        )
        decode = asyncio.ensure_future(self.sender.send(request, ctx, ticket))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None and not _client_saw(ctx):
                decode.cancel()
                with contextlib.suppress(BaseException):
                    await decode
                prefill.result()  # raises PrefillFailed / PrefillRefused
            try:
                reply = await decode
            except WorkerFailed:
                # the decoder's failure is usually its transfer's: when the prefill failed
                # too (it may answer a moment later), the prefill worker is the one to blame
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(prefill), self.blame_wait_s)
                if prefill.done() and not prefill.cancelled():
                    if isinstance(prefill.exception(), PrefillFailed):
                        prefill.result()
                raise
            M.child(M.PD_REQUESTS, "bootstrap", "prefilled").inc()
            return reply
        finally:
            if not decode.done():
                decode.cancel()
            if not prefill.done():  # the answer is out; the prefill's own answer is not needed
                prefill.cancel()
            with contextlib.suppress(BaseException):
                await prefill

    async def _prefill(
        self, ctx: Ctx, pwid: str, fields: dict[str, Any], nixl: bool
    ) -> dict[str, Any]:
        """Send the prefill request and wait for its answer; NIXL: its ``kv_transfer_params``."""
        s = self.state.states.get(pwid)
        if s is None:
            raise PrefillFailed(pwid, "prefill worker gone")
        if ctx.engine_priority is not None:  # --engine-priority: the prefill's queue too
            fields = {**fields, "priority": ctx.engine_priority}
        body = prefill_body(ctx.parsed.body, fields, nixl)
        headers = upstream_headers(ctx)  # the trace context too (services.router.trace)
        t0 = time.perf_counter()
        try:
            status, data, ctype = await self._post(s.url, ctx.path, body, headers)
        except (UpstreamError, aiohttp.ClientError, OSError) as exc:
            raise PrefillFailed(pwid, f"prefill failed: {exc}") from exc
        except TimeoutError as exc:
            raise PrefillFailed(pwid, "prefill timed out", timeout=True) from exc
        if status >= 500:
            raise PrefillFailed(pwid, f"prefill answered {status}")
        if status >= 400:
            headers = {**worker_headers(ctx, ctx.worker_id or pwid), "Content-Type": ctype}
            headers["x-kvgate-prefill-worker"] = pwid
            raise PrefillRefused(Response(data, status, headers))
        ctx.pd_prefill_s = time.perf_counter() - t0
        ctx.pd_prefill_done = time.perf_counter()
        M.PD_PREFILL.observe(ctx.pd_prefill_s)
        if not nixl:
            return {}
        try:
            params = _decode(data).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise PrefillFailed(pwid, "prefill answer without kv_transfer_params")
        return params

    async def _post(
        self, url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str]:
        if url.startswith("http://"):
            r = await self.fast.post(url, path, body, headers, self.request_timeout_s)
            return r.status, r.body, r.headers.get("content-type", "application/json")
        assert self.sender.session is not None
        async with self.sender.session.post(
            url + path,
            data=body,
            headers={"Content-Type": "application/json", **headers},
            timeout=self.timeout,
        ) as r:
            return r.status, await r.read(), r.headers.get("content-type", "application/json")


def _client_saw(ctx: Ctx) -> bool:
    return ctx.out is not None and ctx.out.prepared
