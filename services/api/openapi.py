"""The OpenAPI 3.1 document, generated from the route table (:mod:`services.api.routes`) and
the msgspec body/parameter types (:mod:`services.api.bodies`), plus the router's policy
parameter schemas (``POLICY_SCHEMAS``), so it always describes what the server enforces."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from services.api import bodies
from services.api.framework import IF_MATCH_PATTERN, MAX_JSON_DEPTH, Route

REF = "#/components/schemas/{name}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string"},
            },
            "required": ["code", "message"],
        }
    },
    "required": ["error"],
}


def _param_schema(typ: Any) -> dict[str, Any]:
    schema = msgspec.json.schema(typ)
    schema.pop("$defs", None)
    return schema


def _policy_spec_schema(policy_schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """PolicySpec as a oneOf over the router's algorithms, each with its params schema."""
    variants = []
    for name, params in sorted(policy_schemas.items()):
        variants.append(
            {
                "type": "object",
                "title": name,
                "properties": {"name": {"const": name}, "params": params},
                "required": ["name"],
                "additionalProperties": False,
            }
        )
    return {
        "title": "PolicySpec",
        "description": "routing algorithm and its parameters",
        "oneOf": variants,
    }


NO_NUL = "^[^\\u0000]*$"  # Postgres text and JSONB cannot hold NUL (services.api.framework)


def _describe_no_nul(schema: Any) -> None:
    """Every free-text string schema says what the server enforces: no NUL characters."""
    if isinstance(schema, dict):
        if schema.get("type") == "string" and not {"pattern", "enum", "const"} & set(schema):
            schema["pattern"] = NO_NUL
        for value in schema.values():
            _describe_no_nul(value)
    elif isinstance(schema, list):
        for value in schema:
            _describe_no_nul(value)


def build_document(
    routes: list[Route], policy_schemas: dict[str, dict[str, Any]], version: str = "0.1.0"
) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(bodies.ALL_BODIES, ref_template=REF)
    if policy_schemas:
        components["PolicySpec"] = _policy_spec_schema(policy_schemas)
    _describe_no_nul(components)
    components["Error"] = ERROR_SCHEMA
    for update in ("PolicyUpdate", "TenantUpdate"):  # what the handlers enforce: one or both
        if update not in components:
            continue
        components[update]["anyOf"] = [
            {"required": ["spec"], "properties": {"spec": {"type": "object"}}},
            {"required": ["description"], "properties": {"description": {"type": "string"}}},
        ]
    paths: dict[str, dict[str, Any]] = {}
    seen_ids: set[str] = set()
    for route in routes:
        op_id = route.operation_id
        if op_id in seen_ids:  # e.g. /health and /api/v1/health share a handler
            op_id = f"{op_id}_{re.sub(r'[^a-z0-9]+', '_', route.path.lower()).strip('_')}"
        seen_ids.add(op_id)
        op: dict[str, Any] = {
            "operationId": op_id,
            "summary": route.summary,
            "tags": [route.tag],
            "responses": _responses(route),
        }
        if route.description:
            op["description"] = route.description
        if route.role != "public":
            op["security"] = [{"bearer": []}]
            op["x-required-role"] = route.role
        params = []
        for name, typ in route.path_params.items():
            params.append(
                {"name": name, "in": "path", "required": True, "schema": _param_schema(typ)}
            )
        for name, typ in route.query.items():
            params.append(
                {"name": name, "in": "query", "required": False, "schema": _param_schema(typ)}
            )
        if route.if_match:
            params.append(
                {
                    "name": "If-Match",
                    "in": "header",
                    "required": False,
                    "description": f"only if the ETag is still this: {route.if_match} "
                    "(`*`: any; several, comma-separated: any of them); else 412",
                    "schema": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 1024,
                        "pattern": IF_MATCH_PATTERN,
                    },
                }
            )
        _describe_no_nul(params)
        if params:
            op["parameters"] = params
        if route.body is not None:
            op["requestBody"] = {
                "required": route.body_required,
                "content": {
                    "application/json": {"schema": {"$ref": REF.format(name=route.body.__name__)}}
                },
            }
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvgate admin API",
            "version": version,
            "description": "Routing policies, canary rollouts, workers and alerts. "
            "Send `Authorization: Bearer <token>`; `viewer` tokens read, `admin` tokens change. "
            "Tokens may expire (`expires_at`); an address that fails authentication too often "
            "is answered 429 with Retry-After for a while.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _responses(route: Route) -> dict[str, Any]:
    err = {"application/json": {"schema": {"$ref": REF.format(name="Error")}}}
    ok_schema = route.response or {"type": "object"}
    out: dict[str, Any] = {
        str(route.status): {
            "description": "success",
            "content": {"application/json": {"schema": ok_schema}},
        }
    }
    if route.etag:
        out[str(route.status)]["headers"] = {
            "ETag": {"description": route.etag, "schema": {"type": "string"}}
        }
    if route.body is not None or route.path_params or route.query:
        what = "invalid input (the field is named)"
        if route.body is not None:
            what += f"; JSON nested deeper than {MAX_JSON_DEPTH} levels: code too_deep"
        out["400"] = {"description": what, "content": err}
    if route.role != "public":
        out["401"] = {"description": "missing, invalid, revoked or expired token", "content": err}
        out["429"] = {
            "description": "this client address failed authentication too often; the token "
            "was not checked (code throttled)",
            "headers": {
                "Retry-After": {
                    "description": "seconds until the address may try again",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
            "content": err,
        }
    if route.role == "admin":
        out["403"] = {"description": "token lacks the admin role", "content": err}
    if route.path_params or route.body is not None:
        # the path's object, or one the body names (a canary's policy)
        out["404"] = {"description": "not found", "content": err}
    if route.method != "GET":
        out["409"] = {"description": "conflicts with the current state", "content": err}
    if route.if_match:
        out["412"] = {
            "description": "If-Match does not name the current ETag (code "
            "precondition_failed; nothing changed; the ETag header names the current one)",
            "headers": {"ETag": {"description": route.if_match, "schema": {"type": "string"}}},
            "content": err,
        }
    if route.body is not None:
        out["413"] = {"description": "body too large", "content": err}
    out["503"] = {"description": "PostgreSQL unavailable (retry later)", "content": err}
    return out


def aiohttp_path_names(path: str) -> list[str]:
    return re.findall(r"\{([^}]+)\}", path)
