"""An engine's disaggregated-serving role, as the bridge announces it in heartbeats
(``WorkerHeartbeat.role``: ``both``, ``prefill`` or ``decode``; and a prefill engine's
``bootstrap_port``).

Learned from, in order: ``--role`` (ours, or the engines' own words: vLLM's ``kv_role``
``kv_producer`` / ``kv_consumer`` / ``kv_both``, SGLang's ``--disaggregation-mode`` ``null``
/ ``prefill`` / ``decode``); ``--kv-transfer-config`` (the JSON given to vLLM: its
``kv_role``); and, for SGLang, the engine itself (``/server_info``: its
``disaggregation_mode`` and ``disaggregation_bootstrap_port``). vLLM serves no such page: pass
its ``--kv-transfer-config`` (or ``--role``) to the bridge too. Pure functions.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM 0.33 config/kv_transfer.py KVRole; SGLang 0.5.23 arg_groups/fields/disagg.py
VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
SGLANG_MODES = {"null": "both", "prefill": "prefill", "decode": "decode"}
ROLES = ("both", "prefill", "decode")
ROLE_CHOICES = ("auto", *ROLES, *VLLM_KV_ROLES, "null")


def role_from_flags(role: str, kv_transfer_config: str) -> str | None:
    """The role the flags give; None: ``auto`` and no kv_transfer_config (ask the engine).
    A bad value raises ValueError naming it."""
    if role and role != "auto":
        out = VLLM_KV_ROLES.get(role) or SGLANG_MODES.get(role) or role
        if out not in ROLES:
            raise ValueError(f"--role {role!r}: one of {', '.join(ROLE_CHOICES)}")
        return out
    if kv_transfer_config:
        try:
            cfg = json.loads(kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
        kv_role = cfg.get("kv_role") if isinstance(cfg, dict) else None
        if kv_role not in VLLM_KV_ROLES:
            raise ValueError(
                f"--kv-transfer-config kv_role {kv_role!r}: one of {', '.join(VLLM_KV_ROLES)}"
            )
        return VLLM_KV_ROLES[kv_role]
    return None


def role_from_server_info(info: Any) -> tuple[str, int] | None:
    """SGLang's ``/server_info``: (role, bootstrap port) from its resolved server args; None
    when it says nothing about disaggregation."""
    if not isinstance(info, dict):
        return None
    mode = info.get("disaggregation_mode")
    if mode not in SGLANG_MODES:
        return None
    port = info.get("disaggregation_bootstrap_port")
    ok = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
    return SGLANG_MODES[mode], (port if ok and mode == "prefill" else 0)
