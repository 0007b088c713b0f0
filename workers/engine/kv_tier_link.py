"""Moves full prefix blocks between the engine's KV pool and a `KVTier`.

Responsibilities:
- encode a block as one self-describing payload: its token ids (so a hit is verified
  against the sequence's tokens, never trusted on its hash alone) and its K and V for every
  layer in the pool's own dtype; refuse payloads written for another pool layout;
- queue blocks to offload and copy them out of the pool in one gather at `flush()`, which
  the engine calls before each forward pass: an evicted block's K/V stay intact until the
  next forward (or the next load) overwrites them, so they are read exactly then;
- load payloads into pool blocks the block manager chose, flushing first;
- never let the tier fail a step: a tier error is logged and counts as a miss.

Pool layout (see ModelRunner._new_pool): (2, layers, num_blocks, block_size, Hkv, D);
one block is pool[:, :, block_id], shape (2, layers, block_size, Hkv, D).
"""

from __future__ import annotations

import logging
import struct
from array import array
from dataclasses import dataclass, field

import torch

from workers.engine.kv_dtypes import FP8_KV
from workers.engine.kv_tier import KVTier

logger = logging.getLogger(__name__)

_MAGIC = b"BKV1"
_HEAD = struct.Struct("<4sHI")  # magic, layout length, number of tokens


@dataclass(slots=True)
class LoadedBlock:
    """A block found in the tier: the tokens it was computed from and its K/V bytes."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    kv_bytes: bytes


@dataclass(slots=True)
class KVTierCounters:
    """What the link moved since start, in blocks and bytes."""

    num_offloaded_blocks: int = 0
    num_loaded_blocks: int = 0
    num_offloaded_bytes: int = 0
    num_loaded_bytes: int = 0
    num_tier_errors: int = 0


@dataclass(slots=True)
class _Pending:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    token_ids: list[tuple[int, ...]] = field(default_factory=list)


class KVTierLink:
    """The engine side of a KV tier: pool ⇄ payloads (see the module docstring)."""

    def __init__(self, tier: KVTier, pool: torch.Tensor, *, write_through: bool = False) -> None:
        if pool.dim() != 6 or pool.shape[0] != 2:
            raise ValueError(f"pool must be (2, layers, blocks, block_size, Hkv, D), got "
                             f"{tuple(pool.shape)}")  # fmt: skip
        self.tier = tier
        self.pool = pool
        # Store every block as soon as it is computed, not only on reuse or eviction:
        # more traffic, but a worker elsewhere finds a prefix the moment it exists.
        self.write_through = write_through
        self.block_shape = (2, pool.shape[1], *pool.shape[3:])
        self.counters = KVTierCounters()
        self._layout = f"{str(pool.dtype).removeprefix('torch.')}:{self.block_shape}".encode()
        self._kv_nbytes = pool[:, :, 0].numel() * pool.element_size()
        self._pending = _Pending()

    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Queue a full, computed block for the tier; its K/V are read at the next flush."""
        self._pending.block_ids.append(block_id)
        self._pending.block_hashes.append(block_hash)
        self._pending.token_ids.append(token_ids)

    def flush(self) -> None:
        """Copy every queued block out of the pool and hand them to the tier at once."""
        pending, self._pending = self._pending, _Pending()
        if not pending.block_ids:
            return
        ids = torch.tensor(pending.block_ids, device=self.pool.device)
        # (2, L, n, bs, H, D) -> (n, 2, L, bs, H, D): one contiguous run of bytes per block.
        blocks = self.pool.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        raw = blocks.view(torch.uint8).view(len(pending.block_ids), -1).numpy()
        payloads = [
            (block_hash, self._encode(tokens, raw[i].tobytes()))
            for i, (block_hash, tokens) in enumerate(
                zip(pending.block_hashes, pending.token_ids, strict=True))
        ]  # fmt: skip
        try:
            self.tier.store(payloads)
        except Exception:  # a tier must never fail a step; its own code reports why
            self.counters.num_tier_errors += 1
            logger.warning("KV tier store failed; %d blocks not kept", len(payloads),
                           exc_info=True)  # fmt: skip
            return
        self.counters.num_offloaded_blocks += len(payloads)
        self.counters.num_offloaded_bytes += sum(len(p) for _, p in payloads)

    def load(self, block_hashes: list[bytes]) -> list[LoadedBlock]:
        """The leading run of `block_hashes` the tier holds in this pool's layout."""
        if not block_hashes:
            return []
        try:
            payloads = self.tier.load(block_hashes)
        except Exception:  # as in flush: a miss, not a failed step
            self.counters.num_tier_errors += 1
            logger.warning("KV tier load failed; computing the prefix instead", exc_info=True)
            return []
        found: list[LoadedBlock] = []
        for block_hash, payload in zip(block_hashes, payloads, strict=True):
            block = None if payload is None else self._decode(block_hash, payload)
            if block is None:
                break
            found.append(block)
        return found

    def write(self, block_ids: list[int], blocks: list[LoadedBlock]) -> None:
        """Put loaded blocks' K/V into the given pool blocks (after any queued offloads)."""
        if not block_ids:
            return
        self.flush()  # a queued block may be one of `block_ids`: read it before overwriting
        data = b"".join(b.kv_bytes for b in blocks)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        values = raw.view(self.pool.dtype).view(len(blocks), *self.block_shape)
        ids = torch.tensor(block_ids, device=self.pool.device)
        pool = self.pool
        if pool.dtype == FP8_KV:  # the CPU has no fp8 index_copy_: the same bytes as uint8
            pool, values = pool.view(torch.uint8), values.view(torch.uint8)
        # (n, 2, L, bs, H, D) -> (2, L, n, bs, H, D), the pool's block axis third.
        pool.index_copy_(2, ids, values.permute(1, 2, 0, 3, 4, 5).to(pool.device))
        self.counters.num_loaded_blocks += len(blocks)
        self.counters.num_loaded_bytes += len(data)

    def _encode(self, token_ids: tuple[int, ...], kv_bytes: bytes) -> bytes:
        head = _HEAD.pack(_MAGIC, len(self._layout), len(token_ids))
        return head + self._layout + array("q", token_ids).tobytes() + kv_bytes

    def _decode(self, block_hash: bytes, payload: bytes) -> LoadedBlock | None:
        """The block, or None for a payload of another layout (dtype, shape) or corrupt."""
        if len(payload) < _HEAD.size:
            return None
        magic, layout_len, num_tokens = _HEAD.unpack_from(payload)
        start = _HEAD.size + layout_len
        kv_start = start + 8 * num_tokens
        if (magic != _MAGIC or payload[_HEAD.size : start] != self._layout
                or len(payload) - kv_start != self._kv_nbytes):  # fmt: skip
            logger.debug("KV tier payload of another layout or corrupt; ignored")
            return None
        tokens = array("q")
        tokens.frombytes(payload[start:kv_start])
        return LoadedBlock(block_hash, tuple(tokens), payload[kv_start:])
