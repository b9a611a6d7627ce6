"""The rest of the OpenAI / vLLM surface the router serves beside completions and chat:

- ``POST /tokenize``, ``POST /detokenize``: answered by the router's own tokenizer and chat
  template (the ones it keys requests with), in vLLM's shapes;
- ``GET /version``, ``GET|POST /ping``: vLLM's liveness and version endpoints;
- ``GET /v1/models/{id}``: one model card in OpenAI's JSON, 404 in OpenAI's error shape;
- routed pass-through: ``POST /v1/embeddings`` (keyed like a completions prompt, from
  ``input``) and every POST path listed in ``--passthrough-paths`` (keyed by ``messages``,
  ``prompt`` or ``input`` when present, else only load-balanced) go through the same
  decide / send / retry path as completions.

Invariant: every answer here is either the documented JSON or an OpenAI-shaped error with
``param`` naming the bad field; nothing raises past the handler.
"""

from __future__ import annotations

import json
import time
from importlib import metadata
from typing import Any, Protocol

from services.common.tokenizer import adds_special_tokens, render_chat
from services.core.cluster import ClusterState
from services.router.http_server import Reply, Request, Response, Routes, json_response
from services.router.route_paths import check_route_path
from services.router.tokenize import RequestParser

EMBEDDINGS_PATH = "/v1/embeddings"


class RequestHandler(Protocol):
    """The router's request path (decide, send, retry, migrate, record)."""

    async def handle(self, request: Request, chat: bool) -> Reply: ...


def error(status: int, message: str, etype: str, param: str | None = None) -> Response:
    """OpenAI's error shape (with vLLM's numeric code)."""
    return json_response(
        {"error": {"message": message, "type": etype, "param": param, "code": status}},
        status=status,
    )


def passthrough_paths(setting: str) -> list[str]:
    """``--passthrough-paths``: comma-separated POST paths, each one canonical
    (services.router.route_paths: absolute, no dot segments, encodings, query or '//')."""
    out: list[str] = []
    for raw in (setting or "").split(","):
        p = raw.strip()
        if not p:
            continue
        check_route_path(p)
        out.append(p)
    return out


def kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Bad(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise _Bad("request body must be a JSON object", None)
    return body


class _Bad(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def max_model_len(state: ClusterState, model: str) -> int:
    """The smallest context among the healthy workers that serve ``model`` (any model when
    it names none): what a request can count on wherever it is routed. 0 with no worker."""
    lens = [
        s.capacity.max_model_len
        for s in state.states.values()
        if s.healthy and (not model or model == s.model or model in s.loras)
    ]
    return min(lens) if lens else 0


def add_routes(
    routes: Routes,
    parser: RequestParser,
    state: ClusterState,
    path: RequestHandler,
    st: Any,
) -> None:
    """Register the endpoints; ``st.passthrough_paths`` lists the extra routed POST paths."""

    async def tokenize(request: Request) -> Response:
        try:
            body = await _json(request)
            tok = parser.tokenizer
            if "messages" in body:
                try:
                    ids = tok.encode(render_chat(tok, body), adds_special_tokens(body, chat=True))
                except ValueError as exc:
                    raise _Bad(str(exc), "messages") from None
            elif isinstance(body.get("prompt"), str):
                try:
                    special = adds_special_tokens(body, chat=False)
                except ValueError as exc:
                    raise _Bad(str(exc), "add_special_tokens") from None
                ids = tok.encode(body["prompt"], special)
            else:
                raise _Bad("'prompt' (a string) or 'messages' is required", "prompt")
        except _Bad as exc:
            return error(400, exc.message, "invalid_request_error", exc.param)
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": max_model_len(state, model or ""),
            "tokens": ids,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [tok.decode([i]) for i in ids]
        return json_response(out)

    async def detokenize(request: Request) -> Response:
        try:
            body = await _json(request)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise _Bad("'tokens' must be a list of token ids (integers >= 0)", "tokens")
        except _Bad as exc:
            return error(400, exc.message, "invalid_request_error", exc.param)
        return json_response({"prompt": parser.tokenizer.decode(ids)})

    async def version(_r: Request) -> Response:
        return json_response({"version": kvgate_version()})

    async def ping(_r: Request) -> Response:
        return Response(status=200)

    async def model(request: Request) -> Response:
        want = request.match_info["model_id"]
        models = state.models()
        if want not in models:
            return error(
                404, f"The model `{want}` does not exist.", "not_found_error", param="model"
            )
        return json_response(
            {
                "id": want,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "kvgate",
                "max_model_len": max_model_len(state, want) or None,
                "workers": models[want],
            }
        )

    async def routed(request: Request) -> Reply:
        return await path.handle(request, chat=False)

    routes.add("POST", "/tokenize", tokenize)
    routes.add("POST", "/detokenize", detokenize)
    routes.add("GET", "/version", version)
    routes.add("GET", "/ping", ping)
    routes.add("POST", "/ping", ping)
    routes.add_prefix("GET", "/v1/models/", "model_id", model)
    paths = [EMBEDDINGS_PATH, *passthrough_paths(getattr(st, "passthrough_paths", ""))]
    for route in dict.fromkeys(paths):
        if route in ("/v1/completions", "/v1/chat/completions"):
            continue
        routes.add("POST", route, routed)
