"""Prefill/decode disaggregation: the KV transfer model and the pairing of a prefill engine
with a decode engine. Pure code, shared by the router, the simulated worker and the simulator.
Docs: docs/router.md (disaggregated serving)."""
