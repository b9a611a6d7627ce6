"""Fault injection state of one simulated worker. Pure, no I/O.

Faults (all at run time, per worker, through flags or ``POST /admin/faults``):

- ``crash``: the worker stops: its HTTP port closes, heartbeats and KV events stop, its cache
  is lost. With ``restart_after_s`` it comes back as a new instance (new ``instance_id``,
  empty cache, KV seq restarting at 0) after that many seconds.
- ``hang``: the engine stops stepping and ``/health`` stops answering; heartbeats stop;
  the port stays open (requests are accepted and never answered). ``hang: false`` resumes.
- ``slow_factor``: every engine step takes this many times longer (>= 1 slows down).
- ``drop_kv`` / ``dup_kv``: fraction of KV event batches not published / published twice
  (a dropped batch still consumes its sequence number, so consumers see a gap).
- ``reject``: fraction of completion requests answered 503.

Invariant: :meth:`Faults.update` applies all of a patch or none of it; a bad value raises
ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("crash", "restart_after_s", "hang", "slow_factor", "drop_kv", "dup_kv", "reject")


@dataclass
class Faults:
    crash: bool = False
    restart_after_s: float | None = None
    hang: bool = False
    slow_factor: float = 1.0
    drop_kv: float = 0.0
    dup_kv: float = 0.0
    reject: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, patch: Any) -> Faults:
        """Apply a JSON patch (only the given fields change); returns self."""
        if not isinstance(patch, dict):
            raise ValueError("faults must be a JSON object")
        unknown = sorted(set(patch) - set(FIELDS) - {"reset"})
        if unknown:
            raise ValueError(f"unknown fault field(s) {unknown}; known: {list(FIELDS)}")
        new = Faults() if patch.get("reset") else Faults(**asdict(self))
        for name in ("crash", "hang"):
            if name in patch:
                if not isinstance(patch[name], bool):
                    raise ValueError(f"'{name}' must be true or false")
                setattr(new, name, patch[name])
        if "restart_after_s" in patch:
            v = patch["restart_after_s"]
            if v is not None and (not _is_num(v) or v < 0):
                raise ValueError("'restart_after_s' must be a number >= 0 or null")
            new.restart_after_s = None if v is None else float(v)
        if "slow_factor" in patch:
            v = patch["slow_factor"]
            if not _is_num(v) or v <= 0:
                raise ValueError("'slow_factor' must be a number > 0")
            new.slow_factor = float(v)
        for name in ("drop_kv", "dup_kv", "reject"):
            if name in patch:
                v = patch[name]
                if not _is_num(v) or not 0.0 <= v <= 1.0:
                    raise ValueError(f"'{name}' must be a fraction between 0 and 1")
                setattr(new, name, float(v))
        for f in FIELDS:
            setattr(self, f, getattr(new, f))
        return self


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
