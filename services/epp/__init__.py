"""``kvgate epp``: the router's decision core behind Envoy's ext_proc gRPC protocol, as the
Gateway API Inference Extension's Endpoint Picker (GIE proposal 004).

Map:

- ``protocol``: the EPP protocol's names and the ext_proc messages built from / read into them
  (the pick header + ``envoy.lb`` metadata, a P/D pick's ``x-prefiller-host-port`` for llm-d's
  routing sidecar, the subset hint, the served endpoint, ImmediateResponse);
- ``endpoints``: pods (``ip:port``) <-> kvgate workers, from each worker's heartbeat URL;
- ``picker``: one request's decision through the router's own parser, admission (``decide()``),
  dispatch and outcomes: one decision core, two front doors;
- ``stream``: one ext_proc stream (one HTTP request) as a small state machine;
- ``server``: the gRPC server (ext_proc + health services) around a :class:`Router` that
  serves no HTTP;
- ``cli``: ``kvgate epp``'s options.
"""
