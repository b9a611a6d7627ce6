"""kvgate's pure core: the parts every service and the simulator share, with no I/O in them.

- :mod:`services.core.keys`: canonical chained block keys (xxh3-64 over a block's token ids,
  chained with the parent key, seeded by LoRA / salt) and block arithmetic.
- :mod:`services.core.index`: the global prefix index (which worker holds which block key).
- :mod:`services.core.cindex`: the compiled index core (C extension ``_cindex``), same API as
  the pure-Python index, selected by :data:`services.core.index.PrefixIndex` when built.
- :mod:`services.core.policy`: routing policies as pure functions of (request, cluster
  snapshot) -> decision; filters, scorers and pickers registered by name.
- :mod:`services.core.cluster`: the router's view of the cluster (``ClusterState``: worker
  states from heartbeats / telemetry / control, and the tickets of dispatched requests).
- :mod:`services.core.lifecycle`: one request's lifecycle on an injected clock (decide,
  admission queue, dispatch with replicas and follower holds, first token, end), driven by
  the live router on the wall clock and by the cluster simulator on its virtual clock.
- :mod:`services.core.engine` and :mod:`services.core.kvcache`: the vLLM-like engine model
  (scheduler, paged prefix cache, step-time model) that the simulated worker and the cluster
  simulator both run.

Invariant: nothing under ``services.core`` opens a socket, a file, a database or reads the
wall clock; callers own time and I/O. Services (``services.router``, ``services.api``, ...)
and ``bench`` import the core; the core imports only ``services.common.schemas`` (wire types).
"""
