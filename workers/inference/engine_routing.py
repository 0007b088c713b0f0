"""Which engine server a request goes to, and how long a failing server is left alone.

Responsible for:
- prefix affinity across the servers of one model: rendezvous (highest-random-weight)
  hashing of the job's affinity key (`JobMessage.affinity_key`, the key its Kafka
  partition was chosen by), so jobs that share a prompt head meet the same server's
  prefix cache, and a server going away moves only the keys it held;
- skipping servers that are backing off (their keys go to each key's next choice and come
  back when the server does);
- the back-off itself: exponential per failure in a row with jitter, or the server's own
  Retry-After.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

# A Retry-After is honoured up to this many seconds; beyond it a misconfigured server
# would park the worker's jobs for hours.
MAX_RETRY_AFTER_S = 600.0


@dataclass(slots=True)
class ServerState:
    """One engine server: its base URL, its share of the in-flight bound, its health."""

    url: str
    max_concurrency: int
    num_running: int = 0
    num_failures: int = 0  # in a row; a success resets it
    down_until: float = 0.0  # time.monotonic() before which no request is sent to it

    def is_up(self, now: float) -> bool:
        """Whether requests may go to it now."""
        return now >= self.down_until

    @property
    def has_room(self) -> bool:
        """Whether it runs fewer requests than it takes."""
        return self.num_running < self.max_concurrency

    def failed(self, delay_s: float, now: float) -> None:
        """Back off `delay_s` from `now` (one more failure in a row)."""
        self.num_failures += 1
        self.down_until = max(self.down_until, now + delay_s)

    def succeeded(self) -> None:
        """It answered: the next failure starts the back-off from the beginning."""
        self.num_failures = 0


def rendezvous_score(key: bytes, url: str) -> int:
    """The weight of `url` for `key`; the key goes to its heaviest server that is up."""
    digest = hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_server(key: bytes, servers: Sequence[ServerState], now: float) -> ServerState | None:
    """The server `key` belongs to among those up; None when every one is backing off.

    With servers A, B, C and a key ranked B > A > C, the key goes to B; while B is down
    it goes to A, and back to B after. Keys ranked A first never move when B goes.
    """
    up = [server for server in servers if server.is_up(now)]
    return max(up, key=lambda server: rendezvous_score(key, server.url), default=None)


def backoff_s(
    num_failures: int,
    *,
    base_s: float,
    max_s: float,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to leave a server alone after its `num_failures`-th failure in a row.

    The server's Retry-After when it gave one; else base * 2**(failures - 1), capped at
    max_s, drawn uniformly from its upper half so that workers backing off together do not
    come back together: base 0.5 gives 0.25-0.5, 0.5-1, 1-2 s... up to max_s/2-max_s.
    """
    if retry_after_s is not None:
        return min(max(retry_after_s, 0.0), MAX_RETRY_AFTER_S)
    ceiling = min(max_s, base_s * 2 ** max(num_failures - 1, 0))
    return (rng or random).uniform(ceiling / 2, ceiling)


def parse_retry_after(value: str | None, *, now_epoch: float | None = None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None if
    absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(float(text), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    now = time.time() if now_epoch is None else now_epoch
    return max(when.timestamp() - now, 0.0)
