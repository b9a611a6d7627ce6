"""The prompt work a router sent each worker over the last few seconds, as ``kv_aware``'s
conversation term reads it: a worker whose conversations are between turns looks idle to the
queue and in-flight counts, but their next turns will come back to it.

Pure state, no I/O. Invariant: ``work.get(w, 0)`` is the sum of the tokens of the window's
entries for ``w`` (to within float rounding), and ``starts`` / ``continued`` count the window's
entries of each kind; entries leave the window ``window_s`` seconds after they were recorded (at
the next :meth:`expire`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_TURNS_AHEAD = 99.0  # RecentWork.turns_ahead's bound (a share of continuations of 0.99)


@dataclass(slots=True)
class RecentWork:
    """Per worker, the uncached prompt tokens of the requests sent to it within the last
    ``window_s`` seconds. A request that *continued* a prefix only that worker holds (a
    conversation's next turn) counts its tokens in full; one that *started* a new prefix counts
    them x the window's share of continuations (:meth:`continued_share`), so a fleet whose
    prefixes never come back (no reuse) carries no conversation load at all, and one where
    nearly every request is a next turn counts a new conversation nearly in full."""

    window_s: float
    entries: deque = field(default_factory=deque)  # (t, worker, tokens, continued)
    work: dict[str, float] = field(default_factory=dict)
    starts: int = 0
    continued: int = 0

    def expire(self, now: float) -> None:
        """Drop the entries older than the window."""
        old = now - self.window_s
        entries, work = self.entries, self.work
        while entries and entries[0][0] < old:
            _, wid, tokens, cont = entries.popleft()
            left = work.get(wid, 0.0) - tokens
            if left > 1e-9:
                work[wid] = left
            else:  # (float drift below a token: nothing left)
                work.pop(wid, None)
            if cont:
                self.continued -= 1
            else:
                self.starts -= 1

    def continued_share(self) -> float:
        """The window's continuations over its requests (0 for an empty window)."""
        n = self.starts + self.continued
        return self.continued / n if n else 0.0

    def turns_ahead(self) -> float:
        """How many more requests a prefix started now can be expected to bring: if each
        request is continued with the window's share ``s`` of continuations, ``s / (1 - s)``
        (geometric; at most ``MAX_TURNS_AHEAD``, for a window of continuations only)."""
        s = self.continued_share()
        return min(s / (1.0 - s), MAX_TURNS_AHEAD) if s < 1.0 else MAX_TURNS_AHEAD

    def record(self, now: float, wid: str, uncached: int, continued: bool) -> None:
        """A request sent to ``wid`` with ``uncached`` prompt tokens to compute there."""
        tokens = float(uncached) if continued else uncached * self.continued_share()
        self.entries.append((now, wid, tokens, continued))
        if tokens > 0.0:
            self.work[wid] = self.work.get(wid, 0.0) + tokens
        if continued:
            self.continued += 1
        else:
            self.starts += 1
