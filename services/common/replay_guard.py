"""Freshness and uniqueness of signed bus messages (the envelope of services.common.signing).

A valid signature proves the api sent a message once; this guard decides whether it may be
acted on *now*. A live signed message is accepted only when:

- fresh: issued no more than ``max_age_s`` ago (else ``stale``) and no more than
  ``max_skew_s`` ahead of this clock (else ``future``: a clock out of sync, or a forgery);
- new: its nonce was not accepted before within the window (else ``replayed``);
- in order: its sequence is above the last accepted from the same signer instance on the same
  subject (else ``out_of_order``). Per subject, because a router handles each subscription on
  its own (a drain and a policy notice signed in one order may be handled in the other), and
  per instance, because two api replicas sharing one key count separately. This also stops a
  captured drain replayed after an uncordon the router saw, even when the router never saw the
  drain itself (so its nonce is not in the cache).

Both caches are bounded: nonces expire when their message turns stale (a replay after that is
``stale``), and beyond ``max_nonces`` / ``max_streams`` the oldest entries are dropped (only
legitimate messages enter them, so only a burst of real api traffic can push one out; the
freshness window still applies).

Invariant: :meth:`ReplayGuard.check` records a message only when it accepts it; a rejected
message changes nothing, so a flood of replays cannot evict legitimate entries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from services.common.signing import Envelope

DEFAULT_MAX_AGE_S = 300.0
DEFAULT_MAX_SKEW_S = 30.0


class ReplayGuard:
    def __init__(
        self,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        *,
        max_nonces: int = 200_000,
        max_streams: int = 65_536,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_age_s <= 0 or max_skew_s < 0:
            raise ValueError("max_age_s must be > 0 and max_skew_s >= 0")
        self.max_age_ms = int(max_age_s * 1000)
        self.max_skew_ms = int(max_skew_s * 1000)
        self.max_nonces = max_nonces
        self.max_streams = max_streams
        self.clock = clock
        self._nonces: OrderedDict[str, int] = OrderedDict()  # nonce -> turns stale at (ms)
        # (signer, instance, subject) -> last accepted seq, least recently used first
        self._last_seq: OrderedDict[tuple[str, str, str], int] = OrderedDict()

    def check(self, subject: str, env: Envelope) -> str:
        """ "" and recorded when ``env`` (already verified) may be acted on now, else why not."""
        now_ms = int(self.clock() * 1000)
        if env.issued_at_ms > now_ms + self.max_skew_ms:
            return "future"
        if env.issued_at_ms < now_ms - self.max_age_ms:
            return "stale"
        self._expire(now_ms)
        if env.nonce in self._nonces:
            return "replayed"
        key = (env.signer, env.instance, subject)
        last = self._last_seq.get(key)
        if last is not None and env.seq <= last:
            return "out_of_order"
        self._nonces[env.nonce] = env.issued_at_ms + self.max_age_ms
        while len(self._nonces) > self.max_nonces:
            self._nonces.popitem(last=False)
        self._note_seq(key, env.seq)
        return ""

    def note_stored(self, subject: str, env: Envelope) -> None:
        """A stored message accepted without the freshness window (the POLICY stream's newest
        notice at start): later live messages from its instance must come after it."""
        key = (env.signer, env.instance, subject)
        self._note_seq(key, max(env.seq, self._last_seq.get(key, 0)))

    def last_seq(self, signer: str, instance: str, subject: str) -> int | None:
        return self._last_seq.get((signer, instance, subject))

    def _note_seq(self, key: tuple[str, str, str], seq: int) -> None:
        self._last_seq[key] = seq
        self._last_seq.move_to_end(key)
        while len(self._last_seq) > self.max_streams:
            self._last_seq.popitem(last=False)

    def _expire(self, now_ms: int) -> None:
        # insertion order is close to issue order (one api, a few replicas with synced clocks):
        # dropping from the front until an unexpired entry keeps the cache near its live size
        nonces = self._nonces
        while nonces:
            nonce, stale_at = next(iter(nonces.items()))
            if stale_at >= now_ms:
                break
            del nonces[nonce]
