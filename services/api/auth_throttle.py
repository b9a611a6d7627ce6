"""Throttling of failed authentication per client address (the admin API's brute-force brake).

Invariants:
- An address with ``limit`` failed authentications within the last ``window_s`` seconds is
  blocked until the oldest of them is ``window_s`` old: :meth:`AuthThrottle.retry_after`
  says for how long, and the caller answers 429 without looking at the token. Requests made
  while blocked are not counted, so an address regains ``limit`` tries per window.
- Only failures are recorded; an address without failures is never blocked, whatever other
  addresses do.
- Memory is bounded: at most ``max_addresses`` addresses are tracked, each with at most
  ``limit`` timestamps; past that the address that failed least recently is forgotten.
- ``limit`` 0 turns throttling off.

The address is the TCP peer's: ``X-Forwarded-For`` is not trusted (a client could write any
address there). Behind a reverse proxy every client shares the proxy's address, and so its
budget of failures.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable


class AuthThrottle:
    def __init__(
        self,
        limit: int = 20,
        window_s: float = 60.0,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max(1, max_addresses)
        self._clock = clock
        # address -> times of its recent failures (oldest first); least recently failed first
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it is not blocked."""
        if self.limit <= 0:
            return 0.0
        times = self._failures.get(address)
        if times is None or len(times) < self.limit:
            return 0.0
        wait = times[0] + self.window_s - self._clock()
        return wait if wait > 0 else 0.0

    def failed(self, address: str) -> None:
        """Record one failed authentication from ``address``."""
        if self.limit <= 0:
            return
        now = self._clock()
        times = self._failures.get(address)
        if times is None:
            times = self._failures[address] = deque(maxlen=self.limit)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(address)
        while times and now - times[0] >= self.window_s:
            times.popleft()
        times.append(now)

    def tracked(self) -> int:
        return len(self._failures)
