"""What a bridge knows it does not know: engine history it could not replay. Pure, no I/O.

A bridge's view of its engine's cache is complete only when it applied every engine batch
since the engine's cache was last empty (the engine's start, or an engine AllBlocksCleared).
When batches are gone for good -- the bridge started after the engine had published and the
replay buffer no longer holds the first batches, or a gap was longer than the buffer, or the
engine has no replay at all -- the blocks they stored may stay in the engine's cache while
being in neither the bridge's view nor the index. The ledger records that loss; the bridge's
dump carries it (``EngineHistoryLost``), so ``kvgate index verify`` answers "unknown" with the
reason instead of "equal" (services.kv_indexer.verifier.qualify_check).

Invariants:
- :attr:`lost` is None exactly while the view is complete: it is set by :meth:`note_loss`,
  and cleared by :meth:`forget` (the bridge dropped its view for a new engine process; the
  caller notes a new loss if that process's replay does not start at seq 0) and by
  :meth:`after_batch` once the engine emptied its cache after the loss (everything it holds
  since then was seen);
- ``unkeyed_blocks`` / ``unknown_hashes`` count, since the first loss, the Rekeyer's blocks
  dropped for an unknown parent and removals of hashes it never saw: evidence, a lower bound,
  of what the view lacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import msgspec

from services.common.schemas import EngineHistoryLost
from services.kv_indexer.bridges.rekey import Rekeyer

LossReason = Literal["lost_history", "unrecovered_gap"]


@dataclass
class HistoryLedger:
    lost: EngineHistoryLost | None = None
    _unkeyed_at: int = 0  # the Rekeyer's counters when the first loss was noted
    _unknown_at: int = 0
    _clears_at: int = 0

    def note_loss(
        self,
        reason: LossReason,
        first_lost_seq: int,
        last_lost_seq: int,
        view_from_seq: int,
        rekeyer: Rekeyer,
        *,
        kv_seq: int = -1,
        detail: str = "",
    ) -> EngineHistoryLost:
        """Engine batches ``first_lost_seq..last_lost_seq`` will never be applied; a second
        loss before the view is whole again widens the first (earliest first seq, the
        latest view start) and counts on from it."""
        prev = self.lost
        if prev is None:
            self._unkeyed_at = rekeyer.unkeyed_blocks
            self._unknown_at = rekeyer.unknown_hashes
            self.lost = EngineHistoryLost(
                reason=reason,
                first_lost_seq=max(0, first_lost_seq),
                last_lost_seq=max(0, last_lost_seq),
                view_from_seq=max(0, view_from_seq),
                kv_seq=kv_seq,
                since=time.time(),
                detail=detail,
            )
        else:
            self.lost = msgspec.structs.replace(
                prev,
                reason=reason,
                first_lost_seq=max(0, min(prev.first_lost_seq, first_lost_seq)),
                last_lost_seq=max(0, last_lost_seq),
                view_from_seq=max(0, view_from_seq),
                losses=prev.losses + 1,
                detail=detail or prev.detail,
            )
        self._clears_at = rekeyer.engine_clears
        return self.lost

    def forget(self) -> None:
        """The view was dropped (a new engine process): nothing of the old one is owed."""
        self.lost = None

    def after_batch(self, rekeyer: Rekeyer) -> bool:
        """Call after each engine batch is applied: True when it cleared a loss (the engine
        emptied its whole cache after it, so the view is complete again)."""
        if self.lost is not None and rekeyer.engine_clears != self._clears_at:
            self.lost = None
            return True
        return False

    def report(self, rekeyer: Rekeyer) -> EngineHistoryLost | None:
        """The loss with its evidence counted up to now (None: the view is complete)."""
        lost = self.lost
        if lost is None:
            return None
        return msgspec.structs.replace(
            lost,
            unkeyed_blocks=max(0, rekeyer.unkeyed_blocks - self._unkeyed_at),
            unknown_hashes=max(0, rekeyer.unknown_hashes - self._unknown_at),
        )
