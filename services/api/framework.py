"""The admin API's small HTTP framework on aiohttp: a route table that drives request
validation, authorization and the OpenAPI document alike.

Invariants:
- Every route is declared once as a :class:`Route`; the aiohttp router and the OpenAPI
  document are both built from the same list, so they cannot disagree.
- A handler only ever sees a body, path and query parameters that passed their declared
  types (unknown fields rejected, every field bounded); otherwise the client gets 400 with
  the field named.
- Errors are JSON ``{"error": {"code", "message", "field"?}}``. Postgres unreachable -> 503
  ``database_unavailable``; a handler bug -> 500 (and a log line), never a hang.
- A JSON body nested deeper than ``MAX_JSON_DEPTH`` is refused (400 ``too_deep``) before it
  is decoded, so nothing recursive ever sees it.
- A client address that failed authentication too often is answered 429 ``throttled`` (with
  Retry-After) on every authenticated route, without its token being looked at
  (:mod:`services.api.auth_throttle`). Every refused token is counted by reason in
  ``kvgate_api_auth_failures_total``; the token itself is never logged.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import Counter

from services.api.auth_throttle import AuthThrottle
from services.api.db import is_unavailable
from services.api.json_depth import nesting_depth
from services.common.logging import RateLimiter, get_logger

log = get_logger("api")

MAX_BODY_BYTES = 256 * 1024
MAX_JSON_DEPTH = 64  # the API's deepest real body is 3 levels; policy params stay far below
ROLES = ("viewer", "admin")

AUTH_FAILURES = Counter(
    "kvgate_api_auth_failures_total",
    "Requests to the admin API refused for their bearer token",
    ["reason"],  # missing | malformed | unknown | revoked | expired | not_configured
)
AUTH_THROTTLED = Counter(
    "kvgate_api_auth_throttled_total",
    "Requests answered 429 because their address failed authentication too often",
)
BODIES_REFUSED = Counter(
    "kvgate_api_bodies_refused_total",
    "Request bodies refused before validation",
    ["reason"],  # too_large | too_deep | invalid_json
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            err["field"] = self.field
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return web.json_response({"error": err}, status=self.status, headers=headers or None)


def not_found(what: str, ident: Any) -> ApiError:
    return ApiError(404, "not_found", f"{what} {ident!r} not found")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


# ----------------------------------------------------------------------------- preconditions
# RFC 9110 8.8.3 and 13.1.1: an entity tag is a quoted string, ``W/`` marks a weak one;
# If-Match is ``*`` or a comma-separated list of them, compared strongly (weak ones never match).
_ENTITY_TAG = re.compile(r'\s*(W/)?"([\x21\x23-\x7e]*)"\s*(?:,|$)')
# the same grammar as one JSON Schema pattern (the OpenAPI document's): what if_match accepts
IF_MATCH_PATTERN = r'^\s*(\*|(W/)?"[!#-~]*"(\s*,\s*(W/)?"[!#-~]*")*\s*,?)\s*$'


def etag(version: int) -> str:
    """The entity tag naming a version: ``"7"``."""
    return f'"{version}"'


def if_match(request: web.Request) -> list[str] | None:
    """The strong entity tags an ``If-Match`` header names (``["*"]`` for any), or None when
    the request has none. A malformed header is a 400 (field ``If-Match``)."""
    values = request.headers.getall("If-Match", [])
    if not values:
        return None
    raw = ",".join(values).strip()
    if raw == "*":
        return ["*"]
    bad = ApiError(
        400,
        "invalid_header",
        'If-Match must be * or quoted entity tags, e.g. "7" (the ETag of a GET)',
        "If-Match",
    )
    if not raw:
        raise bad
    tags: list[str] = []
    pos = 0
    while pos < len(raw):
        m = _ENTITY_TAG.match(raw, pos)
        if m is None:
            raise bad
        if m.group(1) is None:
            tags.append(f'"{m.group(2)}"')
        pos = m.end()
    return tags


def check_precondition(
    tags: list[str] | None, what: str, current: int, unit: str = "version"
) -> None:
    """412 unless ``tags`` (from :func:`if_match`) is None, ``*`` or names ``unit``
    ``current``. Call it after locking the row, inside the transaction that writes it."""
    if tags is None or "*" in tags or etag(current) in tags:
        return
    raise ApiError(
        412,
        "precondition_failed",
        f"{what} is at {unit} {current} now, not the one If-Match names "
        f"({', '.join(tags) or 'a weak tag'}): it changed since it was read; read it again",
        "If-Match",
        headers={"ETag": etag(current)},
    )


@dataclass
class Reply:
    """A handler's JSON answer with response headers (e.g. ETag)."""

    body: Any
    headers: dict[str, str]


@dataclass
class Req:
    """What a handler gets: validated inputs and who is asking."""

    request: web.Request
    actor: str
    role: str
    body: Any = None
    path: dict[str, Any] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[Req], Awaitable[Any]]


@dataclass
class Route:
    method: str
    path: str  # aiohttp/OpenAPI style: /api/v1/policies/{name}
    handler: Handler
    summary: str
    tag: str
    role: str = "viewer"  # public | viewer | admin
    body: type | None = None
    body_required: bool = True
    path_params: dict[str, Any] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    description: str = ""
    response: dict[str, Any] | None = None  # JSON Schema of the success body
    etag: str = ""  # what the success answer's ETag header names (none: no ETag)
    if_match: str = ""  # what an If-Match header must name (none: not honoured)

    @property
    def operation_id(self) -> str:
        return getattr(self.handler, "__name__", "op").strip("_")


# ----------------------------------------------------------------------------- validation
_FIELD_RE = re.compile(r"at `\$\.?([^`]*)`")


def _field_of(msg: str) -> str | None:
    m = _FIELD_RE.search(msg)
    if m:
        return m.group(1) or None
    m = re.search(r"unknown field `([^`]*)`", msg)
    if m:
        return m.group(1)
    m = re.search(r"missing required field `([^`]*)`", msg)
    return m.group(1) if m else None


def _no_nul(value: Any, path: str = "") -> None:
    """Postgres text and JSONB cannot hold NUL characters: reject them with the field named."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ApiError(400, "invalid_body", "strings may not contain NUL characters", path)
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul(k, path)
            _no_nul(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nul(v, f"{path}[{i}]")
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _no_nul(getattr(value, name), f"{path}.{name}" if path else name)


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**63 else value
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


def too_large() -> ApiError:
    BODIES_REFUSED.labels("too_large").inc()
    return ApiError(413, "too_large", f"body over {MAX_BODY_BYTES} bytes")


def check_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """400 for JSON nested deeper than ``limit`` (the decoder and the walks below recurse)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot be deeper: skip the scan
        return
    if nesting_depth(raw) > limit:
        BODIES_REFUSED.labels("too_deep").inc()
        raise ApiError(
            400, "too_deep", f"JSON nested deeper than {limit} levels of arrays and objects"
        )


def decode_body(raw: bytes, body_type: type, required: bool) -> Any:
    if not raw.strip():
        if required:
            raise ApiError(400, "invalid_body", "a JSON request body is required")
        raw = b"{}"
    check_depth(raw)
    try:
        # JSON Schema counts 426.0 as an integer, msgspec does not: integral floats become
        # ints first (a float field takes an int as well)
        obj = msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(raw)), body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(400, "invalid_body", str(exc), _field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        BODIES_REFUSED.labels("invalid_json").inc()
        raise ApiError(400, "invalid_json", f"malformed JSON: {exc}") from None
    _no_nul(obj)
    return obj


def convert_param(where: str, name: str, raw: str, typ: Any) -> Any:
    if "\x00" in raw:
        raise ApiError(400, f"invalid_{where}", "NUL characters are not allowed", name)
    try:
        # strict=False: query strings are text, so "5" may become 5
        return msgspec.convert(raw, typ, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc).replace("`$`", f"`{name}`")
        raise ApiError(400, f"invalid_{where}", f"{name}: {text}", name) from None


# ----------------------------------------------------------------------------- auth
def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    actor: str
    role: str


@dataclass(frozen=True)
class Refusal:
    """Why a token was refused: ``reason`` for metrics and logs, ``message`` for the client."""

    reason: str
    message: str


TokenLookup = Callable[[str], Awaitable[Principal | Refusal]]


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# ----------------------------------------------------------------------------- app wiring
_err_log = RateLimiter(30.0)


def install(
    app: web.Application,
    routes: list[Route],
    lookup: TokenLookup,
    throttle: AuthThrottle,
) -> None:
    """Register every route with validation, auth and error handling around its handler."""
    for route in routes:
        app.router.add_route(route.method, route.path, _wrap(route, lookup, throttle))


def peer_address(request: web.Request) -> str:
    """The TCP peer's address. X-Forwarded-For is not trusted: any client can write it."""
    return request.remote or "unknown"


async def authenticate(
    request: web.Request, lookup: TokenLookup, throttle: AuthThrottle
) -> Principal:
    """The request's principal, or the ApiError (429 / 401) that refuses it."""
    address = peer_address(request)
    wait = throttle.retry_after(address)
    if wait > 0:
        AUTH_THROTTLED.inc()
        if _err_log.allow("auth-throttled"):
            log.warning(
                "authentication throttled",
                address=address,
                retry_after_s=round(wait, 1),
                suppressed=_err_log.take_suppressed("auth-throttled"),
            )
        retry = max(1, math.ceil(wait))
        raise ApiError(
            429,
            "throttled",
            f"too many failed authentications from this address; retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )
    token = bearer_token(request)
    if token is None:
        AUTH_FAILURES.labels("missing").inc()
        raise ApiError(401, "unauthorized", "missing bearer token (Authorization)")
    found = await lookup(token)
    if isinstance(found, Refusal):
        AUTH_FAILURES.labels(found.reason).inc()
        throttle.failed(address)
        if _err_log.allow("auth-failed"):
            log.warning(
                "bearer token refused",
                reason=found.reason,
                address=address,
                suppressed=_err_log.take_suppressed("auth-failed"),
            )
        raise ApiError(401, "unauthorized", found.message)
    return found


def _wrap(
    route: Route, lookup: TokenLookup, throttle: AuthThrottle
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def endpoint(request: web.Request) -> web.Response:
        try:
            principal = Principal("anonymous", "public")
            if route.role != "public":
                found = await authenticate(request, lookup, throttle)
                if route.role == "admin" and found.role != "admin":
                    raise ApiError(403, "forbidden", "this operation needs the admin role")
                principal = found
            req = Req(request, principal.actor, principal.role)
            for name, typ in route.path_params.items():
                req.path[name] = convert_param("path", name, request.match_info[name], typ)
            for key in request.query:
                if key not in route.query:
                    raise ApiError(400, "invalid_query", f"unknown query parameter {key!r}", key)
            for name, typ in route.query.items():
                if name in request.query:
                    values = request.query.getall(name)
                    if len(values) > 1:
                        raise ApiError(400, "invalid_query", f"{name} given twice", name)
                    if values[0] == "":  # OpenAPI's default: no empty-valued parameters
                        raise ApiError(400, "invalid_query", f"{name} is empty", name)
                    req.query[name] = convert_param("query", name, values[0], typ)
            if route.body is not None:
                if request.content_length and request.content_length > MAX_BODY_BYTES:
                    raise too_large()
                raw = await request.content.read(MAX_BODY_BYTES + 1)
                if len(raw) > MAX_BODY_BYTES:
                    raise too_large()
                req.body = decode_body(raw, route.body, route.body_required)
            result = await route.handler(req)
            if isinstance(result, web.StreamResponse):
                return result
            if isinstance(result, Reply):
                return web.json_response(
                    result.body, status=route.status, headers=result.headers, dumps=_dumps
                )
            return web.json_response(result, status=route.status, dumps=_dumps)
        except ApiError as exc:
            return exc.response()
        except Exception as exc:
            if is_unavailable(exc):
                if _err_log.allow("db"):
                    log.warning("database unavailable", error=repr(exc)[:300])
                return web.json_response(
                    {
                        "error": {
                            "code": "database_unavailable",
                            "message": "PostgreSQL is unreachable or failing; the API keeps "
                            "retrying and recovers by itself when it returns",
                        }
                    },
                    status=503,
                    headers={"Retry-After": "2"},
                )
            log.exception("handler failed", path=route.path, method=route.method)
            return web.json_response(
                {"error": {"code": "internal", "message": f"internal error: {type(exc).__name__}"}},
                status=500,
            )

    endpoint.__name__ = route.operation_id
    return endpoint


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()
