"""Automatic prefix caching through the engine: computed once, same outputs as without."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight model, saved once for the module."""
    path = tmp_path_factory.mktemp("tiny-llama-prefix")
    save_tiny_llama(path, seed=3)
    return path


def make_llm(model_dir: Path, caching: bool) -> LLM:
    """A CPU fp32 engine with 16-token blocks."""
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK,
               num_kv_blocks=1024, enable_prefix_caching=caching,
               skip_tokenizer_init=True)  # fmt: skip


def greedy(max_tokens: int, salt: str | None = None) -> SamplingParams:
    """Greedy to exactly max_tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)


def test_sixteen_requests_share_a_256_token_prefix(model_dir: Path) -> None:
    """The shared prefix is computed once; from the second request on, 16 blocks are hits."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 300) for _ in range(256)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
               for _ in range(16)]  # fmt: skip
    params = greedy(8)
    cached_llm, plain_llm = make_llm(model_dir, True), make_llm(model_dir, False)
    cached = cached_llm.generate(prompts, params)
    plain = plain_llm.generate(prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [o.num_cached_tokens for o in cached] == [0] + [256] * 15
    assert all(o.num_cached_tokens == 0 for o in plain)
    on, off = cached_llm.engine.stats(), plain_llm.engine.stats()
    assert on.num_prefix_cache_hit_tokens == 15 * 256
    assert off.num_computed_tokens - on.num_computed_tokens == 15 * 256
    assert on.num_kv_blocks_used == 0


def test_fully_cached_prompts_still_recompute_their_last_token(model_dir: Path) -> None:
    """Repeating prompts of exactly one and two blocks: same output, last block recomputed."""
    rng = random.Random(6)
    one_block = [rng.randrange(3, 300) for _ in range(BLOCK)]
    two_blocks = [rng.randrange(3, 300) for _ in range(2 * BLOCK)]
    plain = make_llm(model_dir, False).generate([one_block, two_blocks], greedy(6))
    llm = make_llm(model_dir, True)
    for _ in range(3):
        again = llm.generate([one_block, two_blocks], greedy(6))
        assert [o.token_ids for o in again] == [o.token_ids for o in plain]
    # (16 - 1) // 16 = 0 blocks reusable; (32 - 1) // 16 = 1 block.
    assert [o.num_cached_tokens for o in again] == [0, BLOCK]


def test_outputs_are_identical_with_and_without_caching_under_pressure(model_dir: Path) -> None:
    """Overlapping prompts on a tight pool: eviction and reuse never change a token."""
    rng = random.Random(7)
    stems = [[rng.randrange(3, 300) for _ in range(rng.randint(16, 100))] for _ in range(4)]
    prompts = [rng.choice(stems)[: rng.randint(1, 100)] + [rng.randrange(3, 300)
               for _ in range(rng.randint(0, 16))] for _ in range(24)]  # fmt: skip
    params = [greedy(rng.randint(1, 10)) for _ in prompts]
    tight = LLM(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=20,
                max_num_batched_tokens=96, skip_tokenizer_init=True)  # fmt: skip
    reference = make_llm(model_dir, False).generate(prompts, params)
    for _ in range(2):  # the second round starts from a warm, partly evicted cache
        got = tight.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    stats = tight.engine.stats()
    assert stats.num_prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
    assert stats.num_kv_blocks_used == 0


def test_cache_salt_keeps_tenants_apart(model_dir: Path) -> None:
    """Equal prompts under different salts share nothing; under one salt they do."""
    prompt = list(range(3, 3 + 3 * BLOCK + 1))
    llm = make_llm(model_dir, True)
    first = llm.generate(prompt, greedy(2, salt="a"))[0]
    other = llm.generate(prompt, greedy(2, salt="b"))[0]
    same = llm.generate(prompt, greedy(2, salt="a"))[0]
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 3 * BLOCK
    assert first.token_ids == other.token_ids == same.token_ids
