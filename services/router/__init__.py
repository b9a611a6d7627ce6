"""The router: an OpenAI-compatible proxy that asks the pure policy core where each request goes.

The request path, in order (each step one module, each module's docstring states its invariant):

- ``http_server``: the HTTP/1.1 server of both ports (asyncio + httptools) and the small
  request / response interface the handlers use; ``public_surface``: what it lets through.
- ``handlers``: the HTTP handlers (completions, chat, models, health); thin, no logic.
- ``request_path``: one request from bytes to outcome: parse -> decide -> dispatch -> send,
  retrying on another worker while nothing reached the client; fits on one screen.
- ``tokenize``: parse and tokenize the client's body into a :class:`Parsed` request.
- ``decide``: index overlaps + the policy's decision over the local cluster state (no I/O).
- ``admission``: the bounded wait for capacity when every worker is full (429 on timeout).
- ``dispatch``: the request's claim on its worker (ticket), hot-prefix replicas, follower
  holds and their release; the live-clock driver of ``services.core.lifecycle``.
- ``send``: one attempt on one worker (fast path, whole body, SSE pump); failures before
  output raise ``WorkerFailed`` (retry), after output ``StreamBroken`` (migrate).
- ``migrate``: continue a broken stream on another worker from prompt + generated text.
- ``outcomes``: metrics + one ``RouterOutcome`` per request, published off the request path.
- ``proxy`` / ``sse`` / ``upstream``: the request context, upstream bodies, SSE framing,
  the kept-alive HTTP client (whole responses and streams).

Beside the request path, each with a narrow interface to it:

- ``circuits``: per-worker breakers (``breaker``: half-open trial requests, growing open
  times) and one alert per incident; the request path reports ``sent`` / ``success`` /
  ``failure``, the decision sees ``circuit_open``.
- ``load_share``: this router's in-flight counts out (``router.load``) and other routers' in.
- ``cluster_feed``: heartbeats, telemetry and worker control into ``ClusterState``.
- ``policy_reload``: applies ``policy.updated`` (and the newest stored one at start).
- ``sweeper``: ages state every 100 ms, ticks breakers.
- ``debug``: ``/debug/state`` and ``/debug/route`` (explain a decision, send nothing).
- ``openai_extras``: the rest of vLLM's surface: ``/tokenize``, ``/detokenize``, ``/version``,
  ``/ping``, ``/v1/models/{id}``, and routed ``/v1/embeddings`` + ``--passthrough-paths``
  (through the request path).
- ``signals``: the capacity signal queued requests wait on, and fire-and-forget tasks.
- ``app``: wiring only: construct the parts, start / stop them, build the ports' routes.
"""
