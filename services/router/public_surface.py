"""What the router's public (OpenAI) port lets a client do, and nothing more.

- **Operator endpoints elsewhere**: ``/debug/*`` and ``/metrics`` are served on a separate
  operator port (``--operator-port``, bound to ``--operator-host``), not on the public one.
- **Client API keys** (optional): with keys configured, every ``/v1/*`` request needs
  ``Authorization: Bearer <key>``. Keys are held only as SHA-256 digests (a keys file may hold
  digests alone: ``sha256:<hex>``), and compared in constant time against every digest.
  Tenant keys issued by the admin API (services.router.tenant_identity) are accepted beside
  the static ones; once the directory holds any, a key is required as with static keys. An
  expired tenant key is answered 401 ``API key expired``; a revoked one as an unknown key.
- **Body limit**: a request body above ``--max-body-bytes`` is refused from its Content-Length
  before anything is read, and while reading when no length was sent (chunked); the prompt's
  text is measured (``--max-prompt-chars``) before the tokenizer sees it.
- **TLS** (optional): with ``--tls-cert`` and ``--tls-key`` the OpenAI port serves https
  itself (for a router without a TLS-terminating gateway in front).
- **Connection limits** (services.router.conn_limits): head size, header count, URL length,
  header / body / keep-alive timeouts and the number of open connections, enforced by the
  HTTP server on both ports.
- **Health without details**: with the operator endpoints on their own port, ``/health`` on
  the public port answers only its status (same code, ``{"status": ...}``) unless the client
  shows a valid API key; router id, peers, workers and policy are the operator port's.
- **Not before it knows the cluster** (services.router.readiness): a starting router answers
  ``/v1/models`` 503 + Retry-After (``gate``) until it has heard its workers; ``/ready`` (200
  or 503) is for load balancers and readiness probes, ``/health`` for liveness.
- **Errors in OpenAI's shape**: every error the public port returns, the HTTP server's own
  400, 404, 405, 408, 413, 414, 431, 500 and 503 included, is
  ``{"error": {"message", "type", "param", "code"}}``.

Invariant: the surface holds no per-request state; a refused request never reaches a
handler, the tokenizer or a worker.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import Counter

from services.common import settings as S
from services.router.conn_limits import OPTIONS as CONN_LIMIT_OPTIONS
from services.router.conn_limits import ConnLimits
from services.router.http_server import (
    Handler,
    Reply,
    Request,
    Response,
    Routes,
    Server,
    json_response,
)
from services.router.openai_extras import passthrough_paths
from services.router.tenant_identity import TenantDirectory, bearer_key
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
        "trust_tenant_header",
        False,
        "take the tenant from the x-kvgate-tenant (or llm-d's x-gateway-inference-fairness-id) "
        "header: only behind a gateway that authenticates clients and sets it (never "
        "trusted otherwise)",
        env="KVGATE_ROUTER_TRUST_TENANT_HEADER",
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
    *CONN_LIMIT_OPTIONS,
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
) -> Response:
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
    return json_response(body, status=status, headers=headers)


# ---------------------------------------------------------------------------- the surface
# paths outside /v1/ that cost the router work or reach a worker: keyed like /v1/*. Left open:
# the probes (/health answers status only without a key, /ready, /ping) and /version.
KEYED_PATHS = ("/tokenize", "/detokenize")


class PublicSurface:
    """What the OpenAI port lets through (services.router.http_server.Surface): the API key
    on ``/v1/*`` and on every other path that tokenizes or reaches a worker (``keyed``:
    ``/tokenize``, ``/detokenize``, the passthrough paths), and the body limit from
    Content-Length, both before the body is read; a
    body without a length that grows past the limit while read: 413 (the server stops
    buffering it); every error of the server's own (404, 405, 400, 500) in OpenAI's shape."""

    def __init__(
        self,
        max_body: int,
        keys: ApiKeys | None = None,
        limits: ConnLimits | None = None,
        keyed: Iterable[str] = KEYED_PATHS,
        tenants: TenantDirectory | None = None,
    ) -> None:
        self.max_body = max_body
        self.keys = keys if keys is not None and keys.enabled else None
        self.keyed = frozenset(keyed)  # exact paths besides /v1/* that need a key
        self.limits = limits if limits is not None else ConnLimits()
        self.tenants = tenants
        # a refusal of the router's state (starting), after the key check
        self.gate: Callable[[Request], Response | None] | None = None

    @property
    def keys_required(self) -> bool:
        return self.keys is not None or (self.tenants is not None and self.tenants.has_keys)

    def key_refusal(self, request: Request) -> Response | None:
        """None when the request may pass (a valid static or tenant key, or none needed)."""
        key = bearer_key(request.headers)
        if key is not None and self.tenants is not None:
            why = self.tenants.key_refusal(key)
            if not why:
                return None
            if why == "expired":
                REFUSED.labels("api_key_expired").inc()
                return unauthorized("API key expired")
        if not self.keys_required:
            return None
        if key is not None and self.keys is not None and self.keys.allows(key):
            return None
        REFUSED.labels("api_key").inc()
        return unauthorized(KEY_MESSAGE)

    def presented(self, request: Request) -> bool:
        """Does the request carry a valid key (static or tenant)?"""
        key = bearer_key(request.headers)
        if key is None:
            return False
        if self.tenants is not None and not self.tenants.key_refusal(key):
            return True
        return self.keys is not None and self.keys.allows(key)

    def check(self, request: Request) -> Response | None:
        if request.path.startswith("/v1/") or request.path in self.keyed:
            refused = self.key_refusal(request)
            if refused is not None:
                return refused
        if self.gate is not None:
            refused = self.gate(request)
            if refused is not None:
                return refused
        length = request.content_length
        if length is not None and length > self.max_body:
            return self.too_large(length)
        return None

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return openai_error(status, message, headers=headers)

    def too_large(self, length: int | None) -> Response:
        """413; the server closes the connection after it (the client may still be sending)."""
        REFUSED.labels("body_too_large").inc()
        what = f"request body of {length} bytes" if length is not None else "request body"
        return openai_error(413, f"{what} is over the limit of {self.max_body} bytes")


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

    def presented(self, request: Request) -> bool:
        """Does the request carry one of the keys (``Authorization: Bearer <key>``)?"""
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        return scheme.lower() == "bearer" and bool(key.strip()) and self.allows(key.strip())

    def refusal(self, request: Request) -> Response | None:
        """401 unless the request carries one of the keys."""
        if not self.presented(request):
            REFUSED.labels("api_key").inc()
            return unauthorized(KEY_MESSAGE)
        return None


KEY_MESSAGE = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."


def unauthorized(message: str) -> Response:
    return openai_error(401, message, headers={"WWW-Authenticate": "Bearer"})


# ---------------------------------------------------------------------------- wiring
def public_surface(st: Any, tenants: TenantDirectory | None = None) -> PublicSurface:
    """The OpenAI port's surface: body limit, client API keys (static, and the tenant keys of
    ``tenants``) and connection limits from the settings."""
    max_body = int(getattr(st, "max_body_bytes", 4 * MIB))
    keys = ApiKeys(load_key_digests(getattr(st, "api_keys", ""), getattr(st, "api_keys_file", "")))
    keyed = (*KEYED_PATHS, *passthrough_paths(getattr(st, "passthrough_paths", "") or ""))
    return PublicSurface(max_body, keys, ConnLimits.from_settings(st), keyed, tenants)


def status_only_health(health: Handler, surface: PublicSurface) -> Handler:
    """``/health`` for a public port whose operator endpoints are elsewhere: the full
    handler's status code and ``status`` field, nothing else (a load balancer needs no more),
    unless the client shows a valid API key."""

    async def public_health(request: Request) -> Reply:
        reply = await health(request)
        if surface.presented(request):
            return reply
        status = "ok" if reply.status < 400 else "unavailable"
        if isinstance(reply, Response):
            try:
                said = msgspec.json.decode(reply.body)
            except msgspec.DecodeError:
                said = None
            if isinstance(said, dict) and isinstance(said.get("status"), str):
                status = said["status"]
        return json_response({"status": status}, status=reply.status)

    return public_health


def operator_on_public_port(st: Any) -> bool:
    return not int(getattr(st, "operator_port", 0) or 0)


async def start_operator_http(st: Any, routes: Routes) -> Server | None:
    """Serve ``routes`` (metrics, debug views, health) on the operator port, if one is set."""
    if operator_on_public_port(st):
        return None
    surface = PublicSurface(
        int(getattr(st, "max_body_bytes", 4 * MIB)), limits=ConnLimits.from_settings(st)
    )
    return await Server(routes, surface).start(st.operator_host, int(st.operator_port))
