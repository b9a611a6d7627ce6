"""Active policy and canary split, applied from ``policy.updated``.

Invariants:
- only a notice with a higher ``revision`` than the applied one takes effect (replays and
  reordering are harmless); a notice whose spec fails validation is rejected and the previous
  policies stay in force;
- arm assignment is a pure function of (canary_id, key): key = the session id when the request
  has one (a conversation stays on one arm), else the request id; the candidate arm gets the
  requests whose hash falls below ``fraction``;
- swapping policies never drops a request: a request keeps the Policy object it started with.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from services.common.schemas import PolicyUpdated
from services.core.policy import Policy, build_policy

_U64 = float(1 << 64)


def arm_for(canary_id: str, key: str, fraction: float) -> str:
    """ "candidate" for a ``fraction`` of keys, deterministically; else "control"."""
    if fraction <= 0.0:
        return "control"
    if fraction >= 1.0:
        return "candidate"
    h = xxhash.xxh3_64_intdigest(f"{canary_id}\0{key}".encode())
    return "candidate" if h / _U64 < fraction else "control"


@dataclass(frozen=True)
class Arm:
    name: str  # "control" | "candidate"
    policy: Policy
    canary_id: str | None
    policy_version: int
    label: str = ""  # what operators call it: "<policy name>@<version>" (x-kvgate-policy)


def policy_label(name: str, version: int | None) -> str:
    """A managed policy is ``name@version``; the router's built-in default ``algo@default``."""
    return f"{name}@{version}" if version is not None else f"{name}@default"


def spec_of(name: str, spec: dict) -> dict:
    """PolicyUpdated carries ``name`` and ``spec``; ``spec`` may be the full
    ``{"name", "params"}`` object or just the params. Both mean the same policy."""
    if isinstance(spec, dict) and "name" in spec and set(spec) <= {"name", "params"}:
        return spec
    return {"name": name, "params": spec or {}}


class PolicySet:
    def __init__(self, default: Policy) -> None:
        self.control = default
        self.candidate: Policy | None = None
        self.canary_id: str | None = None
        self.fraction = 0.0
        self.revision = -1
        self.source = "default"
        self.control_label = policy_label(default.name, None)
        self.candidate_label = ""
        self._build_arms()

    def apply(self, msg: PolicyUpdated) -> bool:
        """Apply a notice; returns False if it was stale. Raises PolicyError if invalid."""
        if msg.revision <= self.revision:
            return False
        control = build_policy(spec_of(msg.name, msg.spec), version=msg.version)
        candidate = None
        if msg.canary is not None:
            c = msg.canary
            candidate = build_policy(
                spec_of(c.candidate_name, c.candidate_spec), version=c.candidate_version
            )
        self.control = control
        self.candidate = candidate
        self.canary_id = msg.canary.canary_id if msg.canary else None
        self.fraction = msg.canary.fraction if msg.canary else 0.0
        self.revision = msg.revision
        self.source = "policy.updated"
        self.control_label = policy_label(msg.name, msg.version)
        self.candidate_label = (
            policy_label(msg.canary.candidate_name, msg.canary.candidate_version)
            if msg.canary is not None
            else ""
        )
        self._build_arms()
        return True

    def _build_arms(self) -> None:
        """The arms a request can get until the next notice, shared by every request (none
        is built per request): the control (with the canary's id while there is one) and
        the candidate (None without a canary)."""
        self._control_arm = Arm(
            "control", self.control, self.canary_id, self.control.version, self.control_label
        )
        self._candidate_arm = (
            Arm(
                "candidate",
                self.candidate,
                self.canary_id,
                self.candidate.version,
                self.candidate_label,
            )
            if self.candidate is not None and self.canary_id is not None
            else None
        )

    def arm(self, request_id: str, session_id: str | None) -> Arm:
        if self._candidate_arm is not None:
            assert self.canary_id is not None
            if arm_for(self.canary_id, session_id or request_id, self.fraction) == "candidate":
                return self._candidate_arm
        return self._control_arm

    def describe(self) -> dict:
        out = {
            "revision": self.revision,
            "source": self.source,
            "control": {
                **self.control.spec,
                "version": self.control.version,
                "label": self.control_label,
            },
            "canary": None,
        }
        if self.candidate is not None:
            out["canary"] = {
                "canary_id": self.canary_id,
                "fraction": self.fraction,
                "candidate": {
                    **self.candidate.spec,
                    "version": self.candidate.version,
                    "label": self.candidate_label,
                },
            }
        return out
