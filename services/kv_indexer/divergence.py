"""A worker's own truth (its dump, plus the batches applied after it) against the index. Pure.

A *pair* is a key a worker holds with its tier bits (gpu=1, cpu=2, disk=4), with the index's
meaning (services.core.index): storing a key on a tier adds that tier, removing it from a tier
drops that tier (the pair goes when none is left; a BlockRemoved without tier is "gpu" on the
wire, IndexRemoved without tier is every tier), AllBlocksCleared drops every pair.

Invariant: applying :func:`repair_steps` of ``diff_pairs(expected, actual)`` to an index whose
pairs for the worker are ``actual`` leaves exactly ``expected``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from services.core.index import TIER_BIT, TIERS

Pairs = dict[int, int]


def apply_events(
    pairs: Pairs, events: Iterable[KvEvent], accept: Callable[[BlockStored], bool] | None = None
) -> Pairs:
    """Apply KV events to ``pairs`` in place (``accept`` False: a stored event is skipped, as
    the indexer skips it); returns ``pairs``."""
    for ev in events:
        t = type(ev)
        if t is BlockStored:
            if accept is not None and not accept(ev):  # type: ignore[arg-type]
                continue
            tb = TIER_BIT[ev.tier]  # type: ignore[union-attr]
            get = pairs.get
            for k in ev.keys:  # type: ignore[union-attr]
                pairs[k] = get(k, 0) | tb
        elif t is BlockRemoved:
            tb = TIER_BIT[ev.tier]  # type: ignore[union-attr]
            for k in ev.keys:  # type: ignore[union-attr]
                cur = pairs.get(k)
                if cur is None or not cur & tb:
                    continue
                cur &= ~tb
                if cur:
                    pairs[k] = cur
                else:
                    del pairs[k]
        elif t is AllBlocksCleared:
            pairs.clear()
    return pairs


@dataclass
class PairDiff:
    """``missing``: key -> tier bits the worker holds and the index lacks; ``extra``: key ->
    tier bits the index holds and the worker does not."""

    missing: Pairs = field(default_factory=dict)
    extra: Pairs = field(default_factory=dict)
    # full expected bits of each key in ``extra`` that the worker still holds on another tier
    keep: Pairs = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        """Divergent (worker, key) pairs: keys missing a tier plus keys with a tier too many."""
        return len(self.missing) + len(self.extra)


def diff_pairs(expected: Pairs, actual: Pairs) -> PairDiff:
    if expected == actual:  # the common case, compared in C
        return PairDiff()
    out = PairDiff()
    aget = actual.get
    for k, e in expected.items():
        a = aget(k, 0)
        if e != a:
            if e & ~a:
                out.missing[k] = e & ~a
            if a & ~e:
                out.extra[k] = a & ~e
                out.keep[k] = e
    for k, a in actual.items():
        if k not in expected:
            out.extra[k] = a
    return out


def repair_steps(diff: PairDiff) -> list[tuple[str, str | None, list[int]]]:
    """Index operations turning ``actual`` into ``expected``: ("removed", tier or None for
    every tier, keys) first, then ("stored", tier, keys)."""
    steps: list[tuple[str, str | None, list[int]]] = []
    gone = [k for k in diff.extra if not diff.keep.get(k)]
    if gone:
        steps.append(("removed", None, gone))
    for tier in TIERS:
        tb = TIER_BIT[tier]
        keys = [k for k, b in diff.extra.items() if b & tb and diff.keep.get(k)]
        if keys:
            steps.append(("removed", tier, keys))
    for tier in TIERS:
        tb = TIER_BIT[tier]
        keys = [k for k, b in diff.missing.items() if b & tb]
        if keys:
            steps.append(("stored", tier, keys))
    return steps
