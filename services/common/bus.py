"""A thin layer over nats-py: connect with reconnect and backoff, typed publish / subscribe,
idempotent JetStream setup, durable pull consumers, request/reply, drain on shutdown.

Invariants:
- :meth:`Bus.connect` keeps trying (with capped exponential backoff) until the server answers;
  once connected, nats-py reconnects forever by itself (``max_reconnect_attempts=-1``).
- A message that fails schema validation never reaches a handler: it is counted in
  ``kvgate_bus_dropped_total{type,reason}`` and logged (rate-limited), and the subscription
  keeps going. A handler that raises is counted the same way (reason="handler_error").
- Stream setup is idempotent: creating an existing stream updates it to the given config.
- :meth:`Bus.serve` never fails silently: a request that does not decode, a responder that
  raises and a reply that cannot be sent (over the server's max_payload, connection lost)
  are each counted in ``kvgate_bus_reply_failed_total{type,reason}`` and logged, and the
  requester gets an error reply (header ``Kvgate-Error``) that :meth:`Bus.request` raises
  as :class:`RemoteError` instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from msgspec import Struct
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)
from prometheus_client import Counter

from services.common.aio import cancel_and_wait
from services.common.logging import RateLimiter, get_logger
from services.common.redact import redact_text, redact_url
from services.common.schemas import SchemaError, decode, decode_all, encode
from services.common.signing import Signer
from services.common.subjects import Subjects

log = get_logger("bus")
T = TypeVar("T", bound=Struct)

BUS_DROPPED = Counter(
    "kvgate_bus_dropped_total",
    "Bus messages dropped before or inside a handler",
    ["type", "reason"],
)
BUS_RECONNECTS = Counter("kvgate_bus_reconnects_total", "NATS reconnections")
BUS_PERMISSION_DENIED = Counter(
    "kvgate_bus_permission_denied_total",
    "Publishes or subscriptions the NATS server refused (this service's credential lacks them)",
)
BUS_REPLY_FAILED = Counter(
    "kvgate_bus_reply_failed_total",
    "Requests served without their reply (the requester got an error reply where possible)",
    ["type", "reason"],
)

ERROR_HEADER = "Kvgate-Error"
_ERROR_TEXT_MAX = 1000


class RemoteError(RuntimeError):
    """The responder answered with an explicit error instead of a reply."""


Handler = Callable[[T, Msg], Awaitable[None]]


@dataclass(frozen=True)
class NatsAuth:
    """How to authenticate to NATS: at most one of user/password, token, nkey seed file or
    ``.creds`` file (a secret in the URL also works), plus optional TLS.

    Invariant: ``repr`` and every error message name the method, never a secret."""

    user: str = ""
    password: str = ""
    token: str = ""
    nkey_seed: str = ""  # path of a file holding an nkey seed
    creds: str = ""  # path of a .creds file (user JWT + seed)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def __repr__(self) -> str:
        return f"NatsAuth(method={self.method!r}, tls={self.uses_tls})"

    @classmethod
    def from_settings(cls, st: Any) -> NatsAuth:
        """From resolved settings holding services.common.settings.NATS_AUTH."""
        return cls(
            user=getattr(st, "nats_user", "") or "",
            password=getattr(st, "nats_password", "") or "",
            token=getattr(st, "nats_token", "") or "",
            nkey_seed=getattr(st, "nats_nkey_seed", "") or "",
            creds=getattr(st, "nats_creds", "") or "",
            tls_ca=getattr(st, "nats_tls_ca", "") or "",
            tls_cert=getattr(st, "nats_tls_cert", "") or "",
            tls_key=getattr(st, "nats_tls_key", "") or "",
        )

    @property
    def method(self) -> str:
        used = [
            name
            for name, on in (
                ("user", bool(self.user or self.password)),
                ("token", bool(self.token)),
                ("nkey", bool(self.nkey_seed)),
                ("creds", bool(self.creds)),
            )
            if on
        ]
        if len(used) > 1:
            raise ValueError(f"choose one NATS authentication method, not {' + '.join(used)}")
        return used[0] if used else "none"

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_key)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.uses_tls:
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("NATS TLS: give both --nats-tls-cert and --nats-tls-key")
        ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or None
        )  # verifies the server's certificate and host name
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``; a missing file is a clear error now."""
        method = self.method
        for what, path in (
            ("nkey seed", self.nkey_seed),
            ("creds", self.creds),
            ("TLS CA", self.tls_ca),
            ("TLS certificate", self.tls_cert),
            ("TLS key", self.tls_key),
        ):
            if path and not Path(path).is_file():
                raise ValueError(f"NATS {what} file not found: {path}")
        kw: dict[str, Any] = {}
        if method == "user":
            kw.update(user=self.user, password=self.password)
        elif method == "token":
            kw["token"] = self.token
        elif method == "nkey":
            kw["nkeys_seed"] = self.nkey_seed
        elif method == "creds":
            kw["user_credentials"] = self.creds
        tls = self.ssl_context()
        if tls is not None:
            kw["tls"] = tls
        return kw


class Bus:
    def __init__(
        self,
        url: str,
        name: str,
        subjects: Subjects | None = None,
        auth: NatsAuth | None = None,
        role: str = "",
    ) -> None:
        self.url = url
        self.name = name
        self.subjects = subjects or Subjects()
        self.auth = auth or NatsAuth()
        # replies come to an inbox only this role may subscribe to (services.common.permissions)
        self.role = role  # services.common.permissions' role of this connection's credential
        self.inbox_prefix = self.subjects.inbox_prefix(role) if role else "_INBOX"
        # stream name -> when it was last found as provisioned (services.common.streams)
        self.streams_verified: dict[str, float] = {}
        # set on the api: every message it publishes carries its signature (services.common.signing)
        self.signer: Signer | None = None
        self.nc: NatsClient | None = None
        self._js: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._drop_log = RateLimiter(60.0)
        self._error_log = RateLimiter(10.0)
        self._last_error = ""
        self.connected = asyncio.Event()
        self.disconnected = asyncio.Event()  # set while the connection is down
        self._closing = False  # close() drains: the disconnect that follows is not news

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, max_wait_s: float | None = None, backoff_max_s: float = 5.0) -> None:
        """Connect, retrying with backoff until the server answers (or ``max_wait_s`` passes)."""
        self._closing = False
        servers = [s.strip() for s in self.url.split(",") if s.strip()]
        auth = self.auth.connect_kwargs()
        delay = 0.1
        loop = asyncio.get_running_loop()
        deadline = None if max_wait_s is None else loop.time() + max_wait_s
        while True:
            remaining = None if deadline is None else max(0.1, deadline - loop.time())
            try:
                # nats-py itself retries a first connection forever (max_reconnect_attempts=-1):
                # the deadline bounds that too
                self.nc = await asyncio.wait_for(self._connect_once(servers, auth), remaining)
                self._js = self.nc.jetstream()
                self.connected.set()
                connected = self.nc.connected_url
                log.info(
                    "bus connected",
                    url=redact_url(connected.geturl() if connected else self.url),
                    auth=self.auth.method,
                    tls=self.auth.uses_tls,
                )
                return
            except TimeoutError as exc:
                if deadline is not None and loop.time() >= deadline - 0.05:
                    last = self._last_error or "no answer"
                    raise ConnectionError(
                        f"cannot reach NATS at {redact_url(self.url)}: {last}"
                    ) from exc
                error = "timeout"
            except (
                OSError,
                nats.errors.NoServersError,
                nats.errors.TimeoutError,
                nats.errors.Error,  # e.g. an authorization violation: may be fixed server-side
            ) as exc:
                error = redact_text(str(exc) or type(exc).__name__)
            if deadline is not None and loop.time() + delay > deadline:
                raise ConnectionError(f"cannot reach NATS at {redact_url(self.url)}: {error}")
            log.warning(
                "bus connect failed, retrying",
                url=redact_url(self.url),
                auth=self.auth.method,
                error=error,
                retry_in_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, backoff_max_s)

    async def _connect_once(self, servers: list[str], auth: dict[str, Any]) -> NatsClient:
        return await nats.connect(
            servers=servers,
            name=self.name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            inbox_prefix=self.inbox_prefix,
            **auth,
        )

    async def close(self) -> None:
        """Stop consumer loops, then drain (deliver what is buffered) and close."""
        self._closing = True
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=5)
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.connected.clear()

    async def _on_error(self, exc: Exception) -> None:
        error = redact_text(str(exc) or type(exc).__name__)
        self._last_error = error
        if "permissions violation" in error.lower():
            BUS_PERMISSION_DENIED.inc()
        if self._error_log.allow(error):  # a wrong password repeats twice a second
            log.warning("bus error", error=error, suppressed=self._error_log.take_suppressed(error))

    async def _on_disconnected(self) -> None:
        self.connected.clear()
        self.disconnected.set()
        if self._closing:  # our own close(): a warning here would alarm on every clean exit
            log.debug("bus closed")
        else:
            log.warning("bus disconnected")

    async def _on_reconnected(self) -> None:
        BUS_RECONNECTS.inc()
        self.disconnected.clear()
        self.connected.set()
        log.info("bus reconnected")

    @property
    def client(self) -> NatsClient:
        if self.nc is None:
            raise RuntimeError("bus not connected")
        return self.nc

    @property
    def js(self) -> Any:
        if self._js is None:
            raise RuntimeError("bus not connected")
        return self._js

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    # ------------------------------------------------------------------ core pub/sub
    def _signed(
        self, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> dict[str, str] | None:
        if self.signer is None:
            return headers
        return {**(headers or {}), **self.signer.headers(subject, data)}

    async def publish(
        self, subject: str, msg: Struct, headers: dict[str, str] | None = None
    ) -> None:
        data = encode(msg)
        await self.client.publish(subject, data, headers=self._signed(subject, data, headers))

    async def publish_raw(self, subject: str, data: bytes) -> None:
        await self.client.publish(subject, data)

    def _count_drop(self, type_name: str, reason: str, subject: str, error: str) -> None:
        BUS_DROPPED.labels(type_name, reason).inc()
        key = (type_name, reason, subject)
        if self._drop_log.allow(key):
            log.warning(
                "bus message dropped",
                type=type_name,
                reason=reason,
                subject=subject,
                error=error,
                suppressed=self._drop_log.take_suppressed(key),
            )

    def _wrap(self, msg_type: type[T], handler: Handler[T]) -> Callable[[Msg], Awaitable[None]]:
        type_name = msg_type.__name__

        async def on_msg(raw: Msg) -> None:
            try:
                # one message, or several for a batched type (schemas: decode_all)
                objs = decode_all(msg_type, raw.data)
            except SchemaError as exc:
                self._count_drop(type_name, "invalid", raw.subject, str(exc))
                return
            for obj in objs:
                try:
                    await handler(obj, raw)
                except Exception as exc:  # a bad message must not kill the subscription
                    self._count_drop(type_name, "handler_error", raw.subject, repr(exc))

        return on_msg

    async def subscribe(
        self,
        subject: str,
        msg_type: type[T],
        handler: Handler[T],
        queue: str = "",
    ) -> Any:
        """Core NATS subscription delivering decoded, validated messages to ``handler`` (each
        one of a batch, for a ``batched`` type)."""
        return await self.client.subscribe(subject, queue=queue, cb=self._wrap(msg_type, handler))

    async def request(
        self, subject: str, msg: Struct, reply_type: type[T], timeout: float = 2.0
    ) -> T:
        """Request/reply; raises TimeoutError (no responder / slow), RemoteError (the responder
        answered with an error) or SchemaError (bad reply)."""
        return decode(reply_type, await self.request_bytes(subject, msg, timeout))

    async def request_bytes(self, subject: str, msg: Struct, timeout: float = 2.0) -> bytes:
        """Request/reply returning the reply's raw bytes (errors as :meth:`request`)."""
        try:
            reply = await self.client.request(subject, encode(msg), timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise TimeoutError(f"no responder on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no reply on {subject} within {timeout}s") from exc
        error = (reply.headers or {}).get(ERROR_HEADER)
        if error is not None:
            raise RemoteError(f"{subject}: {error}")
        return reply.data

    async def serve(
        self,
        subject: str,
        msg_type: type[T],
        responder: Callable[[T], Awaitable[Struct | bytes]],
        queue: str = "",
    ) -> Any:
        """Answer requests on ``subject``; the responder returns a message (or raw bytes).

        Every failure is counted and logged, and answered with an error reply where one can
        be sent (see the module invariants); a responder raises to refuse a request."""
        type_name = msg_type.__name__

        async def on_msg(raw: Msg) -> None:
            try:
                obj = decode(msg_type, raw.data)
            except SchemaError as exc:
                await self._reply_failed(raw, type_name, "invalid_request", str(exc))
                return
            try:
                result = await responder(obj)
                data = result if isinstance(result, bytes) else encode(result)
            except Exception as exc:  # a bad request or a bug must not kill the subscription
                await self._reply_failed(raw, type_name, "responder_error", repr(exc))
                return
            if not raw.reply:
                return  # published without a reply subject: nobody to answer
            try:
                await self.client.publish(raw.reply, data)
            except nats.errors.MaxPayloadError:
                limit = self.client.max_payload
                await self._reply_failed(
                    raw,
                    type_name,
                    "max_payload",
                    f"reply of {len(data)} bytes exceeds the server's max_payload of {limit}",
                )
            except Exception as exc:
                await self._reply_failed(raw, type_name, "send_error", repr(exc))

        return await self.client.subscribe(subject, queue=queue, cb=on_msg)

    async def _reply_failed(self, raw: Msg, type_name: str, reason: str, error: str) -> None:
        """Count and log a request left without its reply; send the requester an error."""
        BUS_REPLY_FAILED.labels(type_name, reason).inc()
        sent = False
        if raw.reply:
            text = error.replace("\r", " ").replace("\n", " ")[:_ERROR_TEXT_MAX]
            try:
                await self.client.publish(raw.reply, b"", headers={ERROR_HEADER: text})
                sent = True
            except Exception as exc:  # connection gone: the requester will time out
                error = f"{error}; error reply failed too: {exc!r}"
        key = ("reply", type_name, reason)
        if self._drop_log.allow(key):
            log.warning(
                "request not answered",
                type=type_name,
                reason=reason,
                subject=raw.subject,
                error=error[:_ERROR_TEXT_MAX],
                error_reply_sent=sent,
                suppressed=self._drop_log.take_suppressed(key),
            )

    # ------------------------------------------------------------------ JetStream
    async def js_publish(
        self, subject: str, msg: Struct, timeout: float = 5.0, msg_id: str | None = None
    ) -> Any:
        """Publish to a stream and wait for the server's ack (so the message is stored)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        data = encode(msg)
        headers = self._signed(subject, data, headers)
        return await self.js.publish(subject, data, timeout=timeout, headers=headers)

    async def consume(
        self,
        stream: str,
        subject: str,
        durable: str,
        msg_type: type[T],
        handler: Handler[T],
        *,
        batch: int = 256,
        deliver_new: bool = False,
        ack_wait_s: float = 30.0,
    ) -> asyncio.Task[None]:
        """Run a durable pull consumer in a task; each message is acked after its handler ran
        (also after a counted drop: an invalid message will never become valid)."""
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_ack_pending=max(batch * 4, 1024),
        )
        psub = await self.js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
        on_msg = self._wrap(msg_type, handler)

        async def loop() -> None:
            while True:
                try:
                    msgs = await psub.fetch(batch, timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # disconnected, stream gone: back off and retry
                    log.warning("consumer fetch failed", durable=durable, error=repr(exc))
                    await asyncio.sleep(0.5)
                    continue
                for raw in msgs:
                    await on_msg(raw)
                    with contextlib.suppress(Exception):
                        await raw.ack()

        task = asyncio.create_task(loop(), name=f"consume:{durable}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run a background task owned by the bus (cancelled on close)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
