"""BlockManager: block tables, reference counts, prefix cache, LRU reuse, no leaks."""

from __future__ import annotations

import pytest

from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

_counter = iter(range(1_000_000))


def make_seq(tokens: list[int], salt: str | None = None, *,
             use_prefix_cache: bool = True) -> Sequence:
    """A fresh sequence with a unique request id."""
    n = next(_counter)
    params = SamplingParams(cache_salt=salt, use_prefix_cache=use_prefix_cache)
    return Sequence(f"r{n}", tokens, params, arrival_order=n)


def admit_and_compute(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit with whatever the cache offers, then mark the whole sequence computed."""
    cached = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    assert bm.can_admit(cached, num_new, 0)
    bm.admit(seq, cached, num_new)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return cached


def test_block_table_covers_positions_and_free_returns_everything() -> None:
    """10 tokens in blocks of 4 take ceil(10/4) = 3 blocks; freeing gives all back."""
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    bm.admit(seq, [], 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    seq.num_computed_tokens = 10
    seq.append_token(99)
    # Position 10 still fits block 2 (offset 2); positions 11 and 12 need a fourth block.
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 3
    assert bm.append_slots(seq, 3) and len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_append_slots_refuses_without_partial_allocation() -> None:
    """When the pool cannot cover the request, nothing is taken."""
    bm = BlockManager(3, 2)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6])
    bm.admit(a, [], 4)
    bm.admit(b, [], 2)
    b.num_computed_tokens = 2
    assert not bm.append_slots(b, 4)  # needs 2 more blocks, 0 free
    assert len(b.block_table) == 1 and bm.num_free_blocks == 0


def test_full_blocks_are_shared_and_last_token_recomputed() -> None:
    """A second sequence reuses the first's full blocks, never its whole length."""
    bm = BlockManager(16, 4)
    first = make_seq(list(range(20)))
    admit_and_compute(bm, first)
    assert len(bm.hash_to_block_id) == 5  # 20 // 4 full blocks registered

    same = make_seq(list(range(20)))
    cached = admit_and_compute(bm, same)
    # (20 - 1) // 4 = 4 blocks: the last block is recomputed so the model can sample.
    assert cached == first.block_table[:4]
    assert same.num_cached_tokens == 16
    assert [bm.blocks[b].ref_count for b in cached] == [2, 2, 2, 2]

    diverging = make_seq([*range(17), 500, 501, 502])
    assert bm.find_cached_prefix(diverging) == first.block_table[:4]
    other_start = make_seq([7, *range(1, 20)])
    assert bm.find_cached_prefix(other_start) == []


def test_one_block_prompt_is_fully_recomputed() -> None:
    """A prompt exactly one block long finds no reusable block: its token must run."""
    bm = BlockManager(8, 4)
    admit_and_compute(bm, make_seq([1, 2, 3, 4]))
    again = make_seq([1, 2, 3, 4])
    assert bm.find_cached_prefix(again) == []
    assert admit_and_compute(bm, make_seq([1, 2, 3, 4, 5])) != []


def test_duplicate_computation_keeps_one_cache_entry_and_leaks_nothing() -> None:
    """Two sequences that computed the same block side by side: the first entry wins."""
    bm = BlockManager(8, 4)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    bm.admit(a, [], 9)
    bm.admit(b, [], 9)
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_computed_blocks(seq)
    assert bm.hash_to_block_id[bm.block_hashes(a, 1)[0]] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert len(bm.cached_free_block_ids) == 2  # a's two full blocks stay reusable


def test_cache_salt_keeps_tenants_apart() -> None:
    """Equal tokens under different salts share nothing; under the same salt they do."""
    bm = BlockManager(16, 4)
    admit_and_compute(bm, make_seq(list(range(12)), salt="tenant-a"))
    assert bm.find_cached_prefix(make_seq(list(range(12)), salt="tenant-b")) == []
    assert bm.find_cached_prefix(make_seq(list(range(12)))) == []
    assert len(bm.find_cached_prefix(make_seq(list(range(12)), salt="tenant-a"))) == 2


def test_hit_is_verified_against_stored_tokens() -> None:
    """A block whose stored tokens differ from the request's is not reused."""
    bm = BlockManager(8, 4)
    first = make_seq(list(range(9)))
    admit_and_compute(bm, first)
    # Stand in for a hash collision: the entry exists but holds other tokens.
    bm.blocks[first.block_table[1]].token_ids = (40, 41, 42, 43)
    assert bm.find_cached_prefix(make_seq(list(range(9)))) == first.block_table[:1]


def test_freed_cached_blocks_are_reused_in_lru_order() -> None:
    """Never-cached blocks go first; then the least recently used cached block, tail first."""
    bm = BlockManager(6, 2)
    old = make_seq([1, 2, 3, 4, 5])  # blocks [1,2] [3,4] [5]
    admit_and_compute(bm, old)
    old_blocks = list(old.block_table)
    bm.free(old)
    # Its two full blocks stay cached; the partial third went back as plain free.
    assert list(bm.cached_free_block_ids) == [old_blocks[1], old_blocks[0]]
    filler = make_seq([9] * 8)  # 4 blocks: the 4 plain free ones (incl. old's partial)
    bm.admit(filler, [], 8)
    assert set(filler.block_table).isdisjoint(old_blocks[:2])
    assert len(bm.hash_to_block_id) == 2
    # One more block must evict: the tail [3,4] goes before the head [1,2].
    filler.num_computed_tokens = 8
    assert bm.append_slots(filler, 2) is True
    assert filler.block_table[-1] == old_blocks[1]
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == [old_blocks[0]]


def test_hit_on_free_cached_block_leaves_the_lru_from_the_middle() -> None:
    """Touching a cached free block removes it from the LRU; freeing puts it back last."""
    bm = BlockManager(12, 2)
    seqs = [make_seq([k, k, k]) for k in (1, 2, 3)]
    for seq in seqs:
        admit_and_compute(bm, seq)
    for seq in seqs:
        bm.free(seq)
    lru = list(bm.cached_free_block_ids)
    again = make_seq([2, 2, 2])
    cached = bm.find_cached_prefix(again)
    assert cached == [lru[1]]
    bm.admit(again, cached, 1)
    assert list(bm.cached_free_block_ids) == [lru[0], lru[2]]
    assert bm.blocks[lru[1]].ref_count == 1
    bm.free(again)
    assert list(bm.cached_free_block_ids) == [lru[0], lru[2], lru[1]]


def test_admission_cost_counts_revived_cached_blocks() -> None:
    """Reviving a freed cached block uses a free block just like a new one."""
    bm = BlockManager(4, 2)
    first = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, first)
    bm.free(first)
    second = make_seq([1, 2, 3, 4, 5, 6, 7])
    cached = bm.find_cached_prefix(second)
    assert len(cached) == 2
    # 2 revived + ceil(7/2) - 2 = 2 new blocks: exactly the pool, none left to reserve.
    assert bm.can_admit(cached, 3, 0) and not bm.can_admit(cached, 3, 1)


def test_prefix_caching_off_never_shares() -> None:
    """With caching disabled nothing is registered or found."""
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, seq)
    assert bm.hash_to_block_id == {}
    bm.free(seq)
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert len(bm.free_block_ids) == 8


class _RecordingLink:
    """Stands in for a KVTierLink: records what the block manager asks of the tier."""

    write_through = True

    def __init__(self) -> None:
        self.loads: list[list[bytes]] = []
        self.offloads: list[bytes] = []

    def load(self, block_hashes: list[bytes]) -> list[object]:
        self.loads.append(block_hashes)
        return []

    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        self.offloads.append(block_hash)

    def write(self, block_ids: list[int], blocks: list[object]) -> None:
        assert not block_ids


def test_a_request_off_the_prefix_cache_neither_reuses_nor_publishes_blocks() -> None:
    """use_prefix_cache=False: the cached prefix is not found, the tier not asked, and the
    sequence's own full blocks are neither registered nor offloaded; they go back plain."""
    bm = BlockManager(16, 4)
    link = _RecordingLink()
    bm.kv_link = link  # type: ignore[assignment]  # the manager only calls these methods
    first = make_seq(list(range(13)))
    admit_and_compute(bm, first)
    num_offloaded = len(link.offloads)
    assert len(bm.hash_to_block_id) == 3 and num_offloaded == 3  # write-through
    loads_before = len(link.loads)

    off = make_seq(list(range(13)) + [77, 78, 79, 80], use_prefix_cache=False)
    assert bm.find_cached_prefix(off) == []
    assert bm.next_block_hash(off, 0) is None
    assert bm.hashes_completed_by(off, off.num_tokens) == []
    assert admit_and_compute(bm, off) == []
    assert off.num_cached_tokens == 0 and len(off.block_table) == 5
    assert set(off.block_table).isdisjoint(first.block_table)
    assert len(bm.hash_to_block_id) == 3  # its 4 full blocks were not registered
    assert len(link.loads) == loads_before and len(link.offloads) == num_offloaded
    off_blocks = list(off.block_table)
    bm.free(off)
    assert all(bm.blocks[b].block_hash is None for b in off_blocks)
    assert set(off_blocks) <= set(bm.free_block_ids) and not bm.cached_free_block_ids
    # The same prompt with the cache on still finds the first sequence's blocks only.
    assert bm.find_cached_prefix(make_seq(list(range(13)) + [77, 78, 79, 80])) == \
        first.block_table[:3]


def test_reset_prefix_cache_and_bad_sizes() -> None:
    """Resetting drops every unheld cached block; sizes must be positive."""
    bm = BlockManager(4, 2)
    seq = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, seq)
    bm.free(seq)
    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {} and len(bm.free_block_ids) == 4
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_blocks_before_the_window_go_back_and_stay_cached() -> None:
    """block_size 4, window 6, 13 tokens computed: keys from 8 on stay readable, so blocks
    0 and 1 go back (their cached copies stay hits for another sequence); freeing the
    sequence later releases only what it still holds."""
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(13)))
    admit_and_compute(bm, seq)
    assert bm.num_used_blocks == 4
    assert bm.release_out_of_window(seq, 6) == 2
    assert bm.num_used_blocks == 2 and len(seq.block_table) == 4  # the table keeps its shape
    assert bm.release_out_of_window(seq, 6) == 0  # nothing twice
    twin = make_seq(list(range(13)))
    assert bm.find_cached_prefix(twin) == seq.block_table[:3]  # released blocks still hit
    bm.free(seq)
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_a_window_wider_than_the_sequence_releases_nothing() -> None:
    """Window 12 over 13 computed tokens: the next query sees keys 2.., block 0 stays."""
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(13)))
    admit_and_compute(bm, seq)
    assert bm.release_out_of_window(seq, 12) == 0
    assert bm.num_used_blocks == 4
