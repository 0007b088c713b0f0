"""KV tier: prefix blocks kept beyond the pool and loaded back, outputs unchanged."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.kv_tier import HostKVTier
from workers.engine.kv_tier_link import KVTierLink

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight model, saved once for the module."""
    path = tmp_path_factory.mktemp("tiny-llama-kv-tier")
    save_tiny_llama(path, seed=11)
    return path


def make_llm(model_dir: Path, num_kv_blocks: int = 256, **kwargs: object) -> LLM:
    """A CPU fp32 engine with 16-token blocks."""
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK,
               num_kv_blocks=num_kv_blocks, skip_tokenizer_init=True, **kwargs)  # fmt: skip


def greedy(max_tokens: int, salt: str | None = None) -> SamplingParams:
    """Greedy to exactly max_tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)


def tokens(rng: random.Random, n: int) -> list[int]:
    """n random token ids of the tiny vocabulary."""
    return [rng.randrange(3, 300) for _ in range(n)]


def test_a_second_engine_loads_a_reused_prefix_instead_of_computing_it(model_dir: Path) -> None:
    """Engine A offloads a prefix on its first reuse; engine B, cold, loads its 8 blocks."""
    rng = random.Random(1)
    prefix = tokens(rng, 8 * BLOCK)
    prompts = [prefix + tokens(rng, 5) for _ in range(3)]
    reference = make_llm(model_dir).generate(prompts, greedy(6))
    tier = HostKVTier(max_bytes=1 << 30)
    a = make_llm(model_dir)
    link_a = a.engine.attach_kv_tier(tier)
    assert [o.token_ids for o in a.generate(prompts[:2], greedy(6))] == [
        o.token_ids for o in reference[:2]]  # fmt: skip
    assert link_a.counters.num_offloaded_blocks == 8 and len(tier) == 8
    b = make_llm(model_dir)
    link_b = b.engine.attach_kv_tier(tier)
    got = b.generate([prompts[2]], greedy(6))
    assert got[0].token_ids == reference[2].token_ids
    assert got[0].num_cached_tokens == 8 * BLOCK
    assert link_b.counters.num_loaded_blocks == 8
    # B computed only the 5 own tokens and the 6 decode steps' inputs beyond the prefix.
    assert b.engine.stats().num_computed_tokens == 5 + 5
    assert b.engine.stats().num_kv_blocks_used == 0


def test_a_tier_never_crosses_cache_salts(model_dir: Path) -> None:
    """Tenant B's identical prompt misses tenant A's blocks: the chain roots differ."""
    rng = random.Random(2)
    prompt = tokens(rng, 4 * BLOCK + 3)
    tier = HostKVTier(max_bytes=1 << 30)
    a = make_llm(model_dir)
    a.engine.attach_kv_tier(tier, write_through=True)
    a.generate([prompt], greedy(2, salt="tenant-a"))
    assert len(tier) == 4
    b = make_llm(model_dir)
    link_b = b.engine.attach_kv_tier(tier)
    other = b.generate([prompt], greedy(2, salt="tenant-b"))
    assert other[0].num_cached_tokens == 0 and link_b.counters.num_loaded_blocks == 0
    same = make_llm(model_dir)
    same.engine.attach_kv_tier(tier)
    assert same.generate([prompt], greedy(2, salt="tenant-a"))[0].num_cached_tokens == 4 * BLOCK
    assert tier.num_misses >= 4


def test_write_through_stores_a_prefix_within_its_only_step(model_dir: Path) -> None:
    """One-token requests have one step: their blocks reach the tier before it ends."""
    tier = HostKVTier(max_bytes=1 << 30)
    llm = make_llm(model_dir)
    llm.engine.attach_kv_tier(tier, write_through=True)
    llm.generate([list(range(3, 3 + 3 * BLOCK + 1))], greedy(1))
    assert len(tier) == 3


def test_outputs_are_identical_with_the_tier_under_pool_pressure(model_dir: Path) -> None:
    """A tight pool evicts and reloads prefixes through the tier; no token changes, no leak."""
    rng = random.Random(3)
    stems = [tokens(rng, rng.randint(2 * BLOCK, 6 * BLOCK)) for _ in range(5)]
    prompts = [rng.choice(stems) + tokens(rng, rng.randint(1, 20)) for _ in range(30)]
    params = [greedy(rng.randint(1, 8)) for _ in prompts]
    reference = make_llm(model_dir, enable_prefix_caching=False).generate(prompts, params)
    tight = make_llm(model_dir, num_kv_blocks=24, max_num_batched_tokens=96)
    link = tight.engine.attach_kv_tier(HostKVTier(max_bytes=1 << 30))
    for _ in range(2):  # the second round finds most prefixes only in the tier
        got = tight.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    assert link.counters.num_loaded_blocks > 0
    bm = tight.engine.scheduler.block_manager
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert len(bm.free_block_ids) + len(bm.cached_free_block_ids) == bm.num_blocks
    assert all(bm.blocks[i].block_hash == h for h, i in bm.hash_to_block_id.items())


def test_host_tier_keeps_its_byte_budget_least_recently_used_first() -> None:
    """Over budget, the block used longest ago goes first; a load counts as a use."""
    tier = HostKVTier(max_bytes=30)
    tier.store([(b"a", b"x" * 10), (b"b", b"y" * 10), (b"c", b"z" * 10)])
    assert tier.load([b"a"]) == [b"x" * 10]
    tier.store([(b"d", b"w" * 10)])
    assert tier.load([b"a", b"b", b"c", b"d"]) == [b"x" * 10, None, b"z" * 10, b"w" * 10]
    assert tier.num_bytes == 30 and tier.num_evictions == 1
    with pytest.raises(ValueError, match="max_bytes"):
        HostKVTier(max_bytes=0)


def test_payloads_of_another_layout_are_misses() -> None:
    """A block written by a float16 pool is not read into a float32 one."""
    tier = HostKVTier(max_bytes=1 << 20)
    half = torch.ones(2, 2, 4, BLOCK, 1, 8, dtype=torch.float16)
    writer = KVTierLink(tier, half)
    writer.offload(1, b"h", tuple(range(BLOCK)))
    writer.flush()
    assert len(writer.load([b"h"])) == 1
    assert KVTierLink(tier, half.float()).load([b"h"]) == []
    reader = KVTierLink(tier, torch.zeros_like(half))
    reader.write([3], reader.load([b"h"]))
    assert torch.equal(reader.pool[:, :, 3], half[:, :, 1])


def test_an_fp8_pool_offloads_and_loads_its_blocks_bit_for_bit() -> None:
    """e4m3 blocks go out and come back as the same bytes, and are no float16 pool's."""
    tier = HostKVTier(max_bytes=1 << 20)
    pool = torch.randn(2, 2, 4, BLOCK, 1, 8, generator=torch.Generator().manual_seed(0))
    fp8 = pool.to(FP8_KV)
    writer = KVTierLink(tier, fp8)
    writer.offload(1, b"h", tuple(range(BLOCK)))
    writer.flush()
    assert KVTierLink(tier, torch.zeros_like(pool, dtype=torch.float16)).load([b"h"]) == []
    reader = KVTierLink(tier, torch.zeros_like(fp8))
    reader.write([3], reader.load([b"h"]))
    assert torch.equal(reader.pool[:, :, 3].view(torch.uint8), fp8[:, :, 1].view(torch.uint8))


def test_a_request_off_the_prefix_cache_computes_everything_and_skips_the_tier(
    model_dir: Path,
) -> None:
    """`use_prefix_cache=False`: its prompt is computed whole though the pool and the tier
    both hold it, the tier is neither read nor written, and greedy output is unchanged."""
    rng = random.Random(4)
    prompt = tokens(rng, 6 * BLOCK + 3)
    off = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, use_prefix_cache=False)
    tier = HostKVTier(max_bytes=1 << 30)
    llm = make_llm(model_dir)
    link = llm.engine.attach_kv_tier(tier, write_through=True)
    (cached,) = llm.generate([prompt], greedy(4))
    assert len(tier) == 6 and link.counters.num_offloaded_blocks == 6
    computed_before = llm.engine.stats().num_computed_tokens
    (uncached,) = llm.generate([prompt + [5]], off)
    assert uncached.num_cached_tokens == 0
    # The whole 100-token prompt, then 3 decode inputs.
    assert llm.engine.stats().num_computed_tokens - computed_before == len(prompt) + 1 + 3
    assert link.counters.num_offloaded_blocks == 6 and len(tier) == 6
    assert llm.engine.stats().num_kv_blocks_used == 0
    cold = make_llm(model_dir)
    cold_link = cold.engine.attach_kv_tier(tier)
    hits, misses = tier.num_hits, tier.num_misses
    (again,) = cold.generate([prompt], off)
    assert (tier.num_hits, tier.num_misses) == (hits, misses)
    assert cold_link.counters.num_loaded_blocks == 0 and again.num_cached_tokens == 0
    assert again.token_ids == cached.token_ids
    assert cold.engine.scheduler.block_manager.hash_to_block_id == {}
    reference = make_llm(model_dir, enable_prefix_caching=False).generate([prompt + [5]],
                                                                          greedy(4))
    assert uncached.token_ids == reference[0].token_ids
