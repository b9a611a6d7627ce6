"""What the router's public (OpenAI) port lets a client do, and nothing more.

- **Operator endpoints elsewhere**: ``/debug/*`` and ``/metrics`` are served on a separate
  operator port (``--operator-port``, bound to ``--operator-host``), not on the public one.
- **Client API keys** (optional): with keys configured, every ``/v1/*`` request needs
  ``Authorization: Bearer <key>``. Keys are held only as SHA-256 digests (a keys file may hold
  digests alone: ``sha256:<hex>``), and compared in constant time against every digest.
- **Body limit**: a request body above ``--max-body-bytes`` is refused from its Content-Length
  before anything is read, and while reading when no length was sent (chunked); the prompt's
  text is measured (``--max-prompt-chars``) before the tokenizer sees it.
- **TLS** (optional): with ``--tls-cert`` and ``--tls-key`` the OpenAI port serves https
  itself (for a router without a TLS-terminating gateway in front).
- **Errors in OpenAI's shape**: every error the public port returns, aiohttp's own 404, 405
  and 413 included, is ``{"error": {"message", "type", "param", "code"}}``.

Invariant: the middlewares hold no per-request state; a refused request never reaches a
handler, the tokenizer or a worker.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from services.common import settings as S
from services.router.tokenize import BadRequest

MIB = 1 << 20

OPTIONS = (
    S.option(
        "max_body_bytes",
        4 * MIB,
        "largest request body accepted on the OpenAI port (bytes); larger: 413",
        env="KVGATE_ROUTER_MAX_BODY_BYTES",
    ),
    S.option(
        "max_prompt_chars",
        1_000_000,  # ~250k tokens: above any served context, far below the body limit's memory
        "largest prompt (characters of prompt / message text) tokenized; larger: 400",
        env="KVGATE_ROUTER_MAX_PROMPT_CHARS",
    ),
    S.option(
        "api_keys",
        "",
        "client API keys for /v1/* (comma-separated; secret, prefer the env var); empty: open",
        env="KVGATE_ROUTER_API_KEYS",
    ),
    S.option(
        "api_keys_file",
        "",
        "file of client API keys, one per line: the key, or sha256:<hex digest> of it",
        env="KVGATE_ROUTER_API_KEYS_FILE",
    ),
    S.option(
        "operator_port",
        0,
        "port of /metrics and /debug/* (0: on the OpenAI port, for local use only)",
        env="KVGATE_ROUTER_OPERATOR_PORT",
    ),
    S.option(
        "operator_host",
        "127.0.0.1",
        "address of the operator port",
        env="KVGATE_ROUTER_OPERATOR_HOST",
    ),
    S.option(
        "tls_cert",
        "",
        "PEM certificate (chain) of the OpenAI port: serve https; needs --tls-key",
        env="KVGATE_ROUTER_TLS_CERT",
    ),
    S.option(
        "tls_key",
        "",
        "PEM private key of --tls-cert",
        env="KVGATE_ROUTER_TLS_KEY",
    ),
)


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext | None:
    """The OpenAI port's TLS context (None: plain http). Both files or neither; a file that
    cannot be loaded stops the router with the reason (never the key's contents)."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("router: --tls-cert and --tls-key go together (give both or neither)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(
            f"router: cannot load the TLS certificate {cert} / key {key}: "
            f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc.args[-1]}"
        ) from None
    return ctx


REFUSED = Counter(
    "kvgate_router_refused_total",
    "Requests the public port refused before routing",
    ["reason"],
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------------------- error shape
_TYPES = {429: "rate_limit_error"}  # other 4xx: invalid_request_error, 5xx: server_error


def openai_error(
    status: int,
    message: str,
    *,
    etype: str = "",
    code: int | str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An error in OpenAI's shape, with the numeric code the router's other errors carry
    (services.router.proxy.error_response: vLLM's dialect)."""
    etype = (
        etype
        or _TYPES.get(status)
        or ("server_error" if status >= 500 else "invalid_request_error")
    )
    body = {
        "error": {
            "message": message,
            "type": etype,
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return web.json_response(body, status=status, headers=headers)


def _passthrough_headers(exc: web.HTTPException) -> dict[str, str]:
    keep = ("Allow", "Retry-After", "WWW-Authenticate")
    return {k: v for k, v in exc.headers.items() if k in keep}


@web.middleware
async def error_shape(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (no route, wrong method, body too large) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.content_type == "text/plain" else exc.reason
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} not allowed on {request.path}"
        return openai_error(exc.status, message or exc.reason, headers=_passthrough_headers(exc))


# ---------------------------------------------------------------------------- body limit
def body_limit(max_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes:
            REFUSED.labels("body_too_large").inc()
            # refuse before reading (the client may still be sending: close the connection)
            resp = openai_error(
                413, f"request body of {length} bytes is over the limit of {max_bytes} bytes"
            )
            resp.force_close()
            return resp
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            # no Content-Length (chunked): aiohttp stopped reading at client_max_size
            REFUSED.labels("body_too_large").inc()
            resp = openai_error(413, f"request body is over the limit of {max_bytes} bytes")
            resp.force_close()
            return resp

    return check


def _texts(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key in ("content", "text"):
            if key in value:
                yield from _texts(value[key])


def check_prompt_size(body: Any, max_chars: int) -> None:
    """Raise BadRequest when the prompt or messages hold more text than the tokenizer may see."""
    if not isinstance(body, dict) or max_chars <= 0:
        return
    total = 0
    for text in _texts([body.get("prompt"), body.get("messages")]):
        total += len(text)
        if total > max_chars:
            REFUSED.labels("prompt_too_large").inc()
            raise BadRequest(f"prompt is over the limit of {max_chars} characters")


# ---------------------------------------------------------------------------- API keys
def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_key_digests(keys: str, keys_file: str) -> list[bytes]:
    """SHA-256 digests of the configured keys (plain keys are not kept)."""
    out = [_digest(k.strip()) for k in keys.split(",") if k.strip()]
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"cannot read the API keys file {keys_file}: {exc.strerror}") from None
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(line.removeprefix("sha256:"))
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise SystemExit(f"{keys_file}: a sha256: line needs 64 hex digits")
                out.append(digest)
            else:
                out.append(_digest(line))
    return out


class ApiKeys:
    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def allows(self, presented: str) -> bool:
        digest = _digest(presented)
        ok = False
        for known in self.digests:  # every digest compared: time does not depend on which
            ok |= hmac.compare_digest(digest, known)
        return ok

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.enabled and request.path.startswith("/v1/"):
                auth = request.headers.get("Authorization", "")
                scheme, _, key = auth.partition(" ")
                if scheme.lower() != "bearer" or not key.strip() or not self.allows(key.strip()):
                    REFUSED.labels("api_key").inc()
                    return openai_error(
                        401,
                        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
            return await handler(request)

        return check


# ---------------------------------------------------------------------------- wiring
def public_app(st: Any) -> web.Application:
    """The OpenAI port's application: body limit, API keys and error shape installed."""
    max_body = int(getattr(st, "max_body_bytes", 4 * MIB))
    keys = ApiKeys(load_key_digests(getattr(st, "api_keys", ""), getattr(st, "api_keys_file", "")))
    return web.Application(
        client_max_size=max_body,
        middlewares=[error_shape, keys.middleware(), body_limit(max_body)],
    )


def operator_on_public_port(st: Any) -> bool:
    return not int(getattr(st, "operator_port", 0) or 0)


async def start_operator_http(st: Any, routes: list[web.RouteDef]) -> web.AppRunner | None:
    """Serve ``routes`` (metrics, debug views, health) on the operator port, if one is set."""
    if operator_on_public_port(st):
        return None
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, st.operator_host, int(st.operator_port), reuse_address=True).start()
    return runner
