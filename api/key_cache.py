"""Live API keys seen lately, so a request need not look its key up in the database.

Responsible for: remembering, per key hash, the tenant of a key the database called live,
for at most MAX_AGE_S; forgetting a key the moment this process revokes it (an ORM
`ApiKey.revoked_at` set, caught by a SQLAlchemy attribute event, whatever session or
code path did it); and refusing to re-learn a key revoked here within the last
MAX_AGE_S, so a lookup that read the row just before the revocation committed cannot put
it back. A key revoked by another process is refused here at most MAX_AGE_S later.
Unknown and revoked keys are never remembered: a new key works at once, and guessing
keys fills no memory.

Why: the lookup (a session, a SELECT joining api_keys and tenants, and the thread it
needs off the event loop) was about a fifth of the API's CPU per submission.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import event

from storage.models import ApiKey

T = TypeVar("T")

# Longest a live key is trusted without asking the database again, seconds: the delay
# before a key revoked by another process is refused here.
MAX_AGE_S = 1.0
# Keys remembered at most; past it the oldest half is dropped (a few SELECTs again).
MAX_KEYS = 10_000


class ApiKeyCache(Generic[T]):
    """Key hash → what authenticated it (the tenant), for MAX_AGE_S; see module docstring."""

    def __init__(self, *, max_age_s: float = MAX_AGE_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # key hash → (value, when it was read); insertion order is age order.
        self._hash_to_entry: dict[str, tuple[T, float]] = {}
        # key hash → when this process revoked it.
        self._hash_to_revoked_at: dict[str, float] = {}
        self._is_listening = False

    def get(self, key_hash: str) -> T | None:
        """The value read for this key hash within the last max_age_s, else None."""
        entry = self._hash_to_entry.get(key_hash)
        if entry is None:
            return None
        value, read_at = entry
        if self._clock() - read_at >= self.max_age_s:
            return None
        return value

    def put(self, key_hash: str, value: T, *, read_at: float) -> None:
        """Remember a live key, read from the database at `read_at` (this cache's clock).

        Skipped when the key was revoked here since shortly before that read: the read
        may have seen the row before the revocation committed.
        """
        with self._lock:
            revoked_at = self._hash_to_revoked_at.get(key_hash)
            if revoked_at is not None and read_at - revoked_at < self.max_age_s:
                return
            if len(self._hash_to_entry) >= self.max_keys:
                for stale in list(self._hash_to_entry)[: self.max_keys // 2]:
                    del self._hash_to_entry[stale]
            self._hash_to_entry.pop(key_hash, None)
            self._hash_to_entry[key_hash] = (value, read_at)

    def now(self) -> float:
        """This cache's clock: take it before the database read whose result is put."""
        return self._clock()

    def forget(self, key_hash: str) -> None:
        """Drop a key revoked in this process; it is not re-learned for max_age_s."""
        now = self._clock()
        with self._lock:
            self._hash_to_entry.pop(key_hash, None)
            self._hash_to_revoked_at = {
                h: t for h, t in self._hash_to_revoked_at.items() if now - t < self.max_age_s}
            self._hash_to_revoked_at[key_hash] = now

    def listen(self) -> None:
        """Forget keys as soon as this process revokes them (until `close`)."""
        if not self._is_listening:
            event.listen(ApiKey.revoked_at, "set", self._on_revoked_at_set)
            self._is_listening = True

    def close(self) -> None:
        """Stop listening for revocations."""
        if self._is_listening:
            event.remove(ApiKey.revoked_at, "set", self._on_revoked_at_set)
            self._is_listening = False

    def _on_revoked_at_set(self, target: ApiKey, value: Any, _old: Any, _initiator: Any) -> None:
        if value is not None and target.key_hash:
            self.forget(target.key_hash)
