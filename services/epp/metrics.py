"""The EPP's own Prometheus metrics (the decisions it shares with the router are counted by
the router's metrics: decision time, outcomes, in flight). Updated from the event loop only
(the grpc.aio servicer's; services.common.loop_metrics: no lock per update)."""

from __future__ import annotations

from services.common.loop_metrics import LoopCounter, LoopHistogram

PICKS = LoopCounter(
    "kvgate_epp_picks_total",
    "ext_proc requests answered by the endpoint picker, by result "
    "(picked, or the ImmediateResponse status)",
    ["result"],
)
PROTOCOL_ERRORS = LoopCounter(
    "kvgate_epp_protocol_errors_total",
    "ext_proc streams the EPP could not follow, by reason (the stream ends with a gRPC error)",
    ["reason"],
)
PICKED = PICKS.labels("picked")
PD_PICKS = LoopCounter(
    "kvgate_epp_pd_picks_total",
    "picks of a P/D policy, by where the prompt is prefilled: remote (x-prefiller-host-port "
    "names the prefill worker for the decode pod's sidecar) or decoder (no header)",
    ["prefill"],
)
SERVED_ELSEWHERE = LoopCounter(
    "kvgate_epp_served_elsewhere_total",
    "responses whose served endpoint (x-gateway-destination-endpoint-served) was not the pick",
)
PICK_SECONDS = LoopHistogram(
    "kvgate_epp_pick_seconds",
    "from the request's last body chunk to the pick (parse, tokenize, decide, dispatch)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0),
)
