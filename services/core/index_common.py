"""What both prefix indexes share: the tier bits and the queries written only in terms of
each index's own primitives (``tiers_of``, ``find_matches``, ``_tiers``, ``_slot_of``,
``evicted``).

:class:`services.core.index.PyPrefixIndex` (the pure-Python reference) and
:class:`services.core.cindex.CPrefixIndex` (the compiled core) both inherit
:class:`IndexQueries`, so these answers cannot drift between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

TIER_BIT: dict[str, int] = {"gpu": 1, "cpu": 2, "disk": 4}


class IndexQueries:
    """Mixin: queries over an index's primitives; no state of its own."""

    _tiers: dict[int, int]
    _slot_of: dict[str, int]
    evicted: list[int]

    def tiers_of(self, worker: str, key: int) -> tuple[str, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def find_matches(self, keys: Sequence[int]) -> dict[str, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def tier_of(self, worker: str, key: int) -> str | None:
        """The fastest tier ``worker`` holds ``key`` on (gpu > cpu > disk), or None."""
        tiers = self.tiers_of(worker, key)
        return tiers[0] if tiers else None

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def find_matches_by_tier(self, keys: Sequence[int]) -> dict[str, tuple[int, int, int, int]]:
        """Per worker: (matched blocks, of which on gpu, on cpu, on disk) — a block on several
        tiers counts once, on its fastest tier."""
        out: dict[str, tuple[int, int, int, int]] = {}
        tiers = self._tiers
        for w, n in self.find_matches(keys).items():
            sh = 3 * self._slot_of[w]
            g = c = dk = 0
            for k in keys[:n]:
                cur = tiers.get(k, 0) >> sh & 7 or 1 if tiers else 1
                if cur & 1:
                    g += 1
                elif cur & 2:
                    c += 1
                else:
                    dk += 1
            out[w] = (n, g, c, dk)
        return out
