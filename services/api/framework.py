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
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from services.api.db import is_unavailable
from services.common.logging import RateLimiter, get_logger

log = get_logger("api")

MAX_BODY_BYTES = 256 * 1024
ROLES = ("viewer", "admin")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field

    def response(self) -> web.Response:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            err["field"] = self.field
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response({"error": err}, status=self.status, headers=headers)


def not_found(what: str, ident: Any) -> ApiError:
    return ApiError(404, "not_found", f"{what} {ident!r} not found")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


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


def decode_body(raw: bytes, body_type: type, required: bool) -> Any:
    if not raw.strip():
        if required:
            raise ApiError(400, "invalid_body", "a JSON request body is required")
        raw = b"{}"
    try:
        # JSON Schema counts 426.0 as an integer, msgspec does not: integral floats become
        # ints first (a float field takes an int as well)
        obj = msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(raw)), body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(400, "invalid_body", str(exc), _field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
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


TokenLookup = Callable[[str], Awaitable[Principal | None]]


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# ----------------------------------------------------------------------------- app wiring
_err_log = RateLimiter(30.0)


def install(app: web.Application, routes: list[Route], lookup: TokenLookup) -> None:
    """Register every route with validation, auth and error handling around its handler."""
    for route in routes:
        app.router.add_route(route.method, route.path, _wrap(route, lookup))


def _wrap(route: Route, lookup: TokenLookup) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def endpoint(request: web.Request) -> web.Response:
        try:
            principal = Principal("anonymous", "public")
            if route.role != "public":
                token = bearer_token(request)
                if token is None:
                    raise ApiError(401, "unauthorized", "missing bearer token (Authorization)")
                found = await lookup(token)
                if found is None:
                    raise ApiError(401, "unauthorized", "invalid or revoked token")
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
                    raise ApiError(413, "too_large", f"body over {MAX_BODY_BYTES} bytes")
                raw = await request.content.read(MAX_BODY_BYTES + 1)
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, "too_large", f"body over {MAX_BODY_BYTES} bytes")
                req.body = decode_body(raw, route.body, route.body_required)
            result = await route.handler(req)
            if isinstance(result, web.StreamResponse):
                return result
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
