"""A second home for full prefix blocks outside the engine's KV pool.

The engine hands a `KVTier` the blocks it would otherwise lose (evicted from the pool's
cached-free LRU) and the blocks of prefixes it sees reused, and asks it for the blocks of a
new sequence's prefix that its pool misses; loaded blocks count as cached, so their
tokens are not computed again. A tier is a byte store keyed by chain hash: the engine
encodes a block's token ids and K/V itself (see `kv_tier_link`), so a tier needs nothing
of torch. Chain hashes are rooted in the request's `cache_salt`, so tenants salted apart
can never address each other's blocks.

Implementations: `HostKVTier` below (process memory: one engine's spill-over, e.g. from a
GPU pool to host RAM), and the Redis tier of the inference worker, shared by a model's
workers.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger(__name__)


class KVTier(Protocol):
    """Stores and returns encoded KV blocks by chain hash; misses are normal, never errors."""

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Keep (chain hash, payload) pairs; a tier may drop any of them (budget, outage)."""
        ...

    def load(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """The payload of each hash, None where the tier does not hold it."""
        ...


class HostKVTier:
    """A byte-budgeted, least-recently-used `KVTier` in this process's memory."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self._hash_to_payload: OrderedDict[bytes, bytes] = OrderedDict()
        # The engine thread stores and loads; a stats reader may look from another thread.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hash_to_payload)

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Keep each block, evicting the least recently used ones beyond `max_bytes`."""
        with self._lock:
            for block_hash, payload in blocks:
                if len(payload) > self.max_bytes:
                    logger.debug("a %d-byte block exceeds the host tier; not kept", len(payload))
                    continue
                old = self._hash_to_payload.pop(block_hash, None)
                if old is not None:
                    self.num_bytes -= len(old)
                self._hash_to_payload[block_hash] = payload
                self.num_bytes += len(payload)
            while self.num_bytes > self.max_bytes:
                _, evicted = self._hash_to_payload.popitem(last=False)
                self.num_bytes -= len(evicted)
                self.num_evictions += 1

    def load(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """The stored payloads (each hit becomes the most recently used), None for misses."""
        found: list[bytes | None] = []
        with self._lock:
            for block_hash in block_hashes:
                payload = self._hash_to_payload.get(block_hash)
                if payload is None:
                    self.num_misses += 1
                else:
                    self._hash_to_payload.move_to_end(block_hash)
                    self.num_hits += 1
                found.append(payload)
        return found
