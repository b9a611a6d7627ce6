"""Routing policies: a pure core shared by the live router and the simulator.

Public API::

    from services.core.policy import (
        RequestInfo, WorkerState, Capacity, ClusterSnapshot, Decision,
        build_policy, decide, validate_policy_spec, PolicyError, POLICY_SCHEMAS,
        DEFAULT_POLICY, policy_names,
    )

    policy = build_policy({"name": "kv_aware", "params": {"decode_weight": 16}})
    overlaps = prefix_index.find_matches(request.block_keys)      # caller computes
    decision = decide(policy, request, snapshot, overlaps)

A spec is ``{"name": <policy>, "params": {...}}``; :data:`POLICY_SCHEMAS` maps every policy name
to the JSON Schema of its params (for the admin API's validation and OpenAPI document).
Docs: docs/router.md.
"""

from __future__ import annotations

from typing import Any

from services.core.policy import builtin as _builtin  # noqa: F401  (registers built-ins)
from services.core.policy.base import (
    REGISTRY,
    Policy,
    PolicyImpl,
    PolicyState,
    build_policy,
    decide,
    params_schema,
    register,
    validate_policy_spec,
)
from services.core.policy.errors import PolicyError
from services.core.policy.types import (
    Capacity,
    ClusterSnapshot,
    Decision,
    RequestInfo,
    WorkerState,
)

DEFAULT_POLICY: dict[str, Any] = {"name": "kv_aware", "params": {}}


def policy_names() -> list[str]:
    return sorted(REGISTRY)


def _schemas() -> dict[str, dict[str, Any]]:
    return {name: params_schema(cls) for name, cls in sorted(REGISTRY.items())}


POLICY_SCHEMAS: dict[str, dict[str, Any]] = _schemas()

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_SCHEMAS",
    "Capacity",
    "ClusterSnapshot",
    "Decision",
    "Policy",
    "PolicyError",
    "PolicyImpl",
    "PolicyState",
    "RequestInfo",
    "WorkerState",
    "build_policy",
    "decide",
    "policy_names",
    "register",
    "validate_policy_spec",
]
