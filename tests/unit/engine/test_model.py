"""Teacher-forced logits of our decoder, run through the paged pool, equal Hugging Face's.

CPU, fp32, random weights. Sequences start one step apart, so most steps mix prefill
chunks (some reading an earlier chunk back from the pool) with decodes of other sequences.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine.checkpoints import (
    hf_logits,
    make_seq,
    place,
    random_tokens,
    save_llama,
    save_qwen2,
)
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.sequence import Sequence

ATOL = 1e-4  # fp32 end to end; observed differences are ~1e-6
PROMPT_LENS = [1, 7, 16, 17, 40, 90]
NUM_FORCED = 6  # decode steps per sequence, each fed a fixed ("teacher") token


def make_runner(model_dir: Path, block_size: int, num_kv_blocks: int = 512) -> ModelRunner:
    """A CPU fp32 runner with the torch attention backend."""
    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
    )
    return ModelRunner(config)


def run_teacher_forced(
    runner: ModelRunner, hf_model: Any, prompt_lens: list[int], chunk: int, seed: int = 0
) -> int:
    """Drive staggered chunked prefills and forced decodes; assert every logits row.

    Returns the number of rows compared.
    """
    rng = random.Random(seed)
    vocab = runner.hf_config.vocab_size
    full = [random_tokens(rng, n + NUM_FORCED, vocab) for n in prompt_lens]
    seqs = [
        make_seq(tokens[:n], f"s{i}")
        for i, (tokens, n) in enumerate(zip(full, prompt_lens, strict=True))
    ]
    place(seqs, [len(t) for t in full], runner.block_size, seed)
    reference = [hf_logits(hf_model, tokens) for tokens in full]
    active: list[int] = []
    compared = 0
    step = 0
    while step < len(seqs) or active:
        if step < len(seqs):
            active.append(step)  # one new arrival per step
        batch = [seqs[i] for i in active]
        counts = [min(chunk, s.num_tokens - s.num_computed_tokens) for s in batch]
        indices, logits = runner.compute_logits(batch, counts)
        for seq, n in zip(batch, counts, strict=True):
            seq.num_computed_tokens += n
        for row, j in enumerate(indices):
            i = active[j]
            seq = seqs[i]
            expected = reference[i][seq.num_tokens - 1]
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)
            compared += 1
            if seq.num_tokens < len(full[i]):
                seq.append_token(full[i][seq.num_tokens])
        active = [i for i in active if seqs[i].num_computed_tokens < len(full[i])]
        step += 1
    return compared


@pytest.mark.parametrize("block_size", [1, 16])
def test_llama_logits_match_hugging_face(tmp_path: Path, block_size: int) -> None:
    """Prefill chunks and decode steps through the pool give HF's logits, GQA included."""
    hf_model = save_llama(tmp_path)
    runner = make_runner(tmp_path, block_size, num_kv_blocks=1024 if block_size == 1 else 64)
    compared = run_teacher_forced(runner, hf_model, PROMPT_LENS, chunk=13)
    # One row at the end of each prompt, then one per forced token.
    assert compared == len(PROMPT_LENS) * (NUM_FORCED + 1)


def test_qwen2_biases_match_hugging_face(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases are loaded into the fused projection and applied."""
    hf_model = save_qwen2(tmp_path)
    runner = make_runner(tmp_path, block_size=16)
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert runner.model.layers[0].self_attn.o_proj.bias is None
    run_teacher_forced(runner, hf_model, [5, 33, 64], chunk=20)


def test_tied_embeddings_and_llama3_rope_match_hugging_face(tmp_path: Path) -> None:
    """Tied input/output embeddings and llama3 rope scaling over long positions."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf_model = save_llama(tmp_path, tie_word_embeddings=True, rope_parameters=rope)
    runner = make_runner(tmp_path, block_size=16)
    assert runner.model.lm_head is None
    run_teacher_forced(runner, hf_model, [200, 3], chunk=64)


def test_attention_bias_llama_and_explicit_head_dim(tmp_path: Path) -> None:
    """Llama with attention_bias (o_proj too) and a head_dim not hidden/heads."""
    hf_model = save_llama(tmp_path, attention_bias=True, head_dim=24)
    runner = make_runner(tmp_path, block_size=16)
    assert runner.model.layers[0].self_attn.o_proj.bias is not None
    run_teacher_forced(runner, hf_model, [9, 30], chunk=8)


def test_only_sequences_reaching_their_end_get_logits(tmp_path: Path) -> None:
    """A mid-prompt chunk yields no logits row; the runner never changes sequences."""
    save_llama(tmp_path)
    runner = make_runner(tmp_path, block_size=16)
    first, second = make_seq(list(range(3, 43)), "a"), make_seq(list(range(3, 13)), "b")
    place([first, second], [40, 10], 16)
    indices, logits = runner.compute_logits([first, second], [16, 10])
    assert indices == [1]
    assert logits.shape == (1, 256) and logits.dtype == torch.float32
    assert first.num_computed_tokens == 0 and first.num_tokens == 40
    sampled = runner.execute([first, second], [16, 10])
    assert sampled[0] is None and sampled[1] is not None


def test_bad_schedule_raises(tmp_path: Path) -> None:
    """Scheduling past the tokens, nothing, or beyond the block table is refused."""
    save_llama(tmp_path)
    runner = make_runner(tmp_path, block_size=4)
    seq = make_seq(list(range(3, 13)), "a")
    seq.block_table = [0, 1]  # covers 8 of the 10 positions
    with pytest.raises(ValueError, match="block_table"):
        runner.execute([seq], [10])
    seq.block_table = [0, 1, 2]
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        runner.execute([seq], [11])
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        runner.execute([seq], [0])
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        runner.execute([seq, seq], [1])
    # Decodes (one token each) are packed apart: the same checks hold for them.
    ok = make_seq(list(range(3, 7)), "ok")
    ok.block_table = [3]
    seq.num_computed_tokens = 9
    seq.block_table = [0, 1]  # position 9 lies past it
    with pytest.raises(ValueError, match="block_table"):
        runner.execute([ok, seq], [4, 1])
    seq.block_table = [0, 1, 2]
    seq.num_computed_tokens = 10  # nothing left to compute
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        runner.execute([ok, seq], [4, 1])
    assert runner.execute([], []) == []


def test_decode_batch_mixes_lengths_without_cross_talk(tmp_path: Path) -> None:
    """Decodes of very different lengths (several padded groups) match single-sequence runs."""
    hf_model = save_llama(tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_kv_blocks=512)
    rng = random.Random(7)
    lengths = [2, 3, 9, 30, 31, 70, 150, 151]
    prompts = [random_tokens(rng, n) for n in lengths]
    seqs: list[Sequence] = [make_seq(p, f"s{i}") for i, p in enumerate(prompts)]
    place(seqs, lengths, 4)
    for seq in seqs:  # prefill all but the last token, one sequence at a time
        runner.compute_logits([seq], [seq.num_tokens - 1])
        seq.num_computed_tokens = seq.num_tokens - 1
    order = [5, 0, 7, 2, 6, 1, 4, 3]  # scrambled: the runner sorts decodes itself
    indices, logits = runner.compute_logits([seqs[i] for i in order], [1] * len(order))
    assert indices == list(range(len(order)))
    for row, i in enumerate(order):
        torch.testing.assert_close(
            logits[row], hf_logits(hf_model, prompts[i])[-1], atol=ATOL, rtol=0
        )
