"""A bounded cache of results computed from texts, keyed by each text's digest.

`functools.lru_cache` keeps its arguments: a cache of 256 schema checks kept 256 whole
schema texts (100 distinct ~0.9 MB schemas grew the API by ~180 MB). Keyed by a 16-byte
BLAKE2b digest, an entry costs its key and its result however long the text was, and a
text repeated on every line of a batch file is still computed once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# 128 bits: a collision between two clients' texts is not a thing to plan for.
DIGEST_SIZE = 16


class DigestCache(Generic[T]):
    """The results for the last `max_entries` distinct (kind, text) pairs; thread-safe."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._digest_to_result: OrderedDict[bytes, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str, compute: Callable[[], T], *, kind: str = "") -> T:
        """The result for `text` (of `kind`), from the cache or from `compute()`."""
        digest = hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=DIGEST_SIZE,
                                 person=kind.encode()[:16]).digest()
        with self._lock:
            if digest in self._digest_to_result:
                self._digest_to_result.move_to_end(digest)
                return self._digest_to_result[digest]
        result = compute()  # outside the lock: two threads may compute one text twice
        with self._lock:
            self._digest_to_result[digest] = result
            if len(self._digest_to_result) > self.max_entries:
                self._digest_to_result.popitem(last=False)
        return result

    def __len__(self) -> int:
        return len(self._digest_to_result)
