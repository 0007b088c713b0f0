"""Paged KV-cache blocks: who owns which block, and which blocks can be reused.

Responsibilities:
- own block ids 0..num_blocks-1, their reference counts and the free pool;
- give each sequence a block table covering every position it is about to compute;
- automatic prefix caching: a full, computed block is registered under a chain hash
  (parent hash + its token ids, the chain rooted in the request's cache salt), so a later
  sequence with the same prefix shares it instead of recomputing it;
- keep freed cached blocks in LRU order, reusable until evicted (oldest first, O(1)
  removal from the middle on a hit);
- with a KV tier attached (`kv_link`): offload a cached block when it is first reused or
  evicted (or, write-through, once computed), and extend a sequence's pool hit with the
  blocks the tier holds, loaded into free blocks and then shared like any cached block;
- leave out of all of this a sequence whose request opted out (`use_prefix_cache`
  False): it reuses no cached block, loads nothing from the tier, and registers (so
  offloads) none of its own blocks, which go back to the plain free pool when freed;
- under sliding-window attention on every layer, give back a running sequence's leading
  blocks once no query of it can read them (`release_out_of_window`): a cached one stays
  in the prefix cache for others, its table entry stays in place (no kernel reads it);
- free everything a sequence holds, leaving no leak.

Block arithmetic, worked once for block_size = 4: a sequence of 10 tokens needs
ceil(10 / 4) = 3 blocks; position 9 lives in block_table[9 // 4] = block_table[2] at
offset 9 % 4 = 1. Only blocks 0 and 1 are full (10 // 4 = 2), so only they can be cached.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.sequence import Sequence

if TYPE_CHECKING:
    from workers.engine.kv_tier_link import KVTierLink

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Block:
    """One physical KV block: its reference count and, once full, its cache identity."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The tokens the hash was computed from, to verify a hit rather than trust the hash.
    token_ids: tuple[int, ...] = ()
    # The KV tier has (or was handed) this cached block: never offload it twice.
    is_offloaded: bool = False


def chain_hash(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Hash of one full block given the hash of everything before it."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def root_hash(cache_salt: str | None, rope_long: bool = False) -> bytes:
    """The parent hash of a sequence's first block; the salt keeps tenants apart, and a
    longrope model's long mode keeps its KV apart from the short mode's."""
    mode = b":rope-long" if rope_long else b""
    return hashlib.sha256(b"salt:" + (cache_salt or "").encode() + mode).digest()


class BlockManager:
    """Allocates KV blocks to sequences and shares full blocks through the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Never-cached free blocks are handed out first, so cached ones live longer.
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Freed blocks that still hold a cached prefix, least recently used first.
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block_id: dict[bytes, int] = {}
        # Per request: chain hashes of its full blocks (a pure function of its tokens) and
        # how many leading blocks of its table are already registered in the cache.
        self._block_hashes: dict[str, list[bytes]] = {}
        self._num_registered_blocks: dict[str, int] = {}
        self.kv_link: KVTierLink | None = None
        # Per waiting request: blocks of its prefix already asked of the tier, so a
        # sequence that waits several steps asks once (reset when it is preempted).
        self._num_tier_checked_blocks: dict[str, int] = {}
        # Per request: leading blocks of its table already given back (outside the window).
        self._num_released_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (including evictable cached ones)."""
        return len(self.free_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chain hashes of the sequence's first `num_full_blocks` blocks."""
        return self._hashes(seq, num_full_blocks)[:num_full_blocks]

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """The memo of the sequence's block hashes, extended to at least `num_full_blocks`."""
        hashes = self._block_hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        assert num_full_blocks * bs <= seq.num_tokens
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq.params.cache_salt, seq.rope_long)
            hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def uses_prefix_cache(self, seq: Sequence) -> bool:
        """Whether the sequence may reuse cached blocks and leave its own for others (not
        one that asks for its prompt's logprobs: a cached block's positions never reach
        the model)."""
        return (self.enable_prefix_caching and seq.params.use_prefix_cache
                and seq.params.prompt_logprobs is None)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids caching the longest prefix of `seq`, leaving at least one token to compute.

        The last token is always recomputed because the model must run on it to sample;
        so for 16 tokens and block_size 16 nothing is reused ((16 - 1) // 16 = 0 blocks),
        while 17 tokens reuse one block.
        """
        if not self.uses_prefix_cache(seq) or seq.num_tokens == 0:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._hashes(seq, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block_id.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                logger.warning("prefix-cache hash collision on block %d; not reused", block_id)
                break
            hits.append(block_id)
        if self.kv_link is not None and len(hits) < max_blocks:
            hits += self._load_from_tier(seq, hashes[:max_blocks], hits)
        return hits

    def _load_from_tier(self, seq: Sequence, hashes: list[bytes], hits: list[int]) -> list[int]:
        """Blocks after the pool hit `hits` that the tier holds, loaded into free blocks.

        They join the cached-free LRU (most recent end) as if computed here, so admission
        revives them like any hit. The pool hit itself is never evicted to make room.
        """
        assert self.kv_link is not None
        if self._num_tier_checked_blocks.get(seq.request_id, 0) >= len(hashes):
            return []  # asked at an earlier step; what it gave then is in the pool or gone
        for block_id in hits:  # most recently used: evicted after everything else
            if block_id in self.cached_free_block_ids:
                self.cached_free_block_ids.move_to_end(block_id)
        # Loading turns free blocks into cached-free ones, so at most this many can come
        # in without evicting the hit: e.g. 5 free, 2 of them the hit's -> 3.
        num_spare = self.num_free_blocks - sum(self.blocks[b].ref_count == 0 for b in hits)
        first = len(hits)
        wanted = hashes[first : first + num_spare]
        if not wanted:
            return []  # the pool is full of running work: ask again at a later step
        bs = self.block_size
        loaded = []
        for i, block in enumerate(self.kv_link.load(wanted), start=first):
            if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                logger.warning("KV tier block of another prefix under hash %s; not used",
                               block.block_hash.hex()[:16])  # fmt: skip
                break
            if block.block_hash in self.hash_to_block_id:
                break  # the pool still caches this later block: the rest computes anew
            loaded.append(block)
        if len(loaded) < len(wanted) or first + len(wanted) == len(hashes):
            self._num_tier_checked_blocks[seq.request_id] = len(hashes)
        block_ids = []
        for block in loaded:
            block_id = self._take_block()
            self.blocks[block_id].ref_count = 0
            self.cached_free_block_ids[block_id] = None
            self._cache(self.blocks[block_id], block.block_hash, block.token_ids)
            self.blocks[block_id].is_offloaded = True
            block_ids.append(block_id)
        self.kv_link.write(block_ids, loaded)
        return block_ids

    def next_block_hash(self, seq: Sequence, num_cached_blocks: int) -> bytes | None:
        """Hash of the first block after a cache hit of `num_cached_blocks`, if cacheable."""
        if not self.uses_prefix_cache(seq):
            return None
        if (num_cached_blocks + 1) * self.block_size > seq.num_tokens - 1:
            return None
        return self._hashes(seq, num_cached_blocks + 1)[num_cached_blocks]

    def hashes_completed_by(self, seq: Sequence, num_new_tokens: int) -> list[bytes]:
        """Hashes of the blocks that become full once `num_new_tokens` more are computed."""
        if not self.uses_prefix_cache(seq):
            return []
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        last = (seq.num_computed_tokens + num_new_tokens) // bs
        return self._hashes(seq, last)[first:last]

    def can_admit(
        self, cached_block_ids: list[int], num_new_tokens: int, num_reserved: int
    ) -> bool:
        """Whether an admission with this cache hit leaves at least `num_reserved` blocks free."""
        cost = self._admission_cost(cached_block_ids, num_new_tokens)
        return self.num_free_blocks - cost >= num_reserved

    def admit(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int) -> None:
        """Give a waiting sequence its cached prefix plus room for `num_new_tokens` more.

        Sets `block_table`, `num_computed_tokens` and `num_cached_tokens`.
        Example, block_size 4, 11-token prompt, 2 cached blocks, num_new_tokens 3:
        the hit covers positions 0..7; positions 8..10 need ceil(11 / 4) - 2 = 1 new block.
        """
        assert not seq.block_table, "admitting a sequence that already holds blocks"
        assert self._admission_cost(cached_block_ids, num_new_tokens) <= self.num_free_blocks
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free_block_ids[block_id]
            block.ref_count += 1
            self._offload(block)  # a reused prefix is worth keeping beyond this pool
        seq.block_table = list(cached_block_ids)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self._num_registered_blocks[seq.request_id] = len(cached_block_ids)
        self._grow(seq, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend a running sequence's table to cover `num_new_tokens` more; False if full."""
        needed = self._num_new_blocks(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        self._grow(seq, num_new_tokens)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache.

        When another block already caches the same chain (two sequences computed the same
        prefix side by side), the existing entry wins and this copy stays private.
        """
        if not self.uses_prefix_cache(seq):
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered_blocks.get(seq.request_id, 0)
        if num_full <= start:
            return
        bs = self.block_size
        hashes = self._hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.hash_to_block_id:
                self._cache(block, hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                if self.kv_link is not None and self.kv_link.write_through:
                    self._offload(block)
        self._num_registered_blocks[seq.request_id] = num_full

    def release_out_of_window(self, seq: Sequence, window: int) -> int:
        """Give back the sequence's leading blocks that lie wholly before every window it
        can still attend with; returns how many were given back this time.

        Its next query sits at position num_computed_tokens and sees keys from
        num_computed_tokens - window + 1 on, later queries fewer. Example, block_size 4,
        window 6, 13 tokens computed: keys from 8 on stay readable, so blocks 0 and 1
        (positions 0..7) go back. Call it after cache_computed_blocks, so a full block is
        registered in the prefix cache (and stays reusable there) before it is released.
        """
        first_visible = max(0, seq.num_computed_tokens - window + 1)
        num_dead = min(first_visible // self.block_size, len(seq.block_table))
        done = self._num_released_blocks.get(seq.request_id, 0)
        for block_id in seq.block_table[done:num_dead]:
            self._release(block_id)
        if num_dead > done:
            self._num_released_blocks[seq.request_id] = num_dead
        return max(0, num_dead - done)

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds and reset its progress."""
        # Release the tail first: when the pool runs short, a prefix's last blocks are
        # evicted before its first ones, which more sequences are likely to share.
        done = self._num_released_blocks.pop(seq.request_id, 0)
        for block_id in reversed(seq.block_table[done:]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered_blocks.pop(seq.request_id, None)
        self._num_tier_checked_blocks.pop(seq.request_id, None)

    def _release(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes back to a free pool."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_block_ids.append(block_id)
            else:
                self.cached_free_block_ids[block_id] = None

    def forget(self, seq: Sequence) -> None:
        """Drop the per-request memo once the sequence has left the engine for good."""
        self.free(seq)
        self._block_hashes.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds."""
        while self.cached_free_block_ids:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self.free_block_ids.append(block_id)

    def _admission_cost(self, cached_block_ids: list[int], num_new: int) -> int:
        # Cached hits sitting in the free LRU leave the free pool when taken.
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        num_tokens = len(cached_block_ids) * self.block_size + num_new
        return revived + self.num_blocks_for(num_tokens) - len(cached_block_ids)

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self._num_new_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._take_block())

    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
            self._offload(self.blocks[block_id])  # last chance: its K/V go at the next flush
            self._uncache(self.blocks[block_id])
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def _cache(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.hash_to_block_id[block_hash] = block.block_id

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        if self.hash_to_block_id.get(block.block_hash) == block.block_id:
            del self.hash_to_block_id[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.is_offloaded = False

    def _offload(self, block: Block) -> None:
        """Hand a cached block to the KV tier once in its cached life."""
        if self.kv_link is None or block.is_offloaded or block.block_hash is None:
            return
        block.is_offloaded = True
        self.kv_link.offload(block.block_id, block.block_hash, block.token_ids)
