"""What both prefix indexes share: the tier bits and the queries written only in terms of
each index's own primitives (``tiers_of``, ``find_matches``, ``_tiers``, ``_slot_of``,
``evicted``), and loading a snapshot in steps into a fresh index that a live one then adopts.

:class:`services.core.index.PyPrefixIndex` (the pure-Python reference) and
:class:`services.core.cindex.CPrefixIndex` (the compiled core) both inherit
:class:`IndexQueries`, so these answers cannot drift between the two.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.core.index import IndexState

TIER_BIT: dict[str, int] = {"gpu": 1, "cpu": 2, "disk": 4}


LOAD_STEP_ROWS = 1 << 20  # (key, worker) rows a load step takes (~40 ms of the compiled core)


class IndexQueries:
    """Mixin: queries over an index's primitives; no state of its own."""

    max_blocks: int | None

    def load_steps(self, state: IndexState, rows: int = LOAD_STEP_ROWS) -> Iterator[None]:
        """:meth:`load_state` as a generator of steps (the content complete once exhausted);
        an index that cannot split the work loads in one step."""
        self.load_state(state)  # type: ignore[attr-defined]
        yield

    def adopt(self, other: IndexQueries) -> None:
        """Take ``other``'s content, in O(1), as if it had been loaded here: the end of a load
        into a fresh index (:meth:`load_steps`) while this one kept answering. ``other``, an
        index of the same kind and cap, is not to be used after."""
        if type(other) is not type(self) or other.max_blocks != self.max_blocks:
            raise ValueError("adopt needs an index of the same kind and cap")
        vars(self).update(vars(other))

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
