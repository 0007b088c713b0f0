"""bf16: teacher-forced logits within 0.1 of Hugging Face's, greedy output equal up to ties.

Runs on CPU here and on CUDA where there is one (flash attention and decode CUDA graphs
when flash-attn is installed). The model is a random-weight GQA Llama whose logits stay
within about ±5: bf16 keeps ~3 significant digits, so with a trained model's logits of ~25
(bf16 spacing 0.125 there) no implementation, Hugging Face's own included, stays within
0.1 of another — its incremental decode and its full-sequence forward differ by ~1.0 on
SmolLM2-135M. The reference logits are the ones Hugging Face chose each token from while
generating (prefill, then one decode step per token, as the engine runs).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine.checkpoints import make_seq, place, random_tokens
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams

LOGIT_TOLERANCE = 0.1
# Where the two pick different tokens, Hugging Face's top-2 margin is at most twice the
# logit tolerance; anything wider is a real departure.
TIE_MARGIN = 2 * LOGIT_TOLERANCE
VOCAB = 1000
PROMPT_LENS = [1, 5, 16, 17, 64, 129, 250, 300]
MAX_TOKENS = [24, 8, 24, 16, 24, 12, 24, 20]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, 4 query heads over 2 KV heads of 32; initializer 0.1 keeps logits ~±5."""
    path = tmp_path_factory.mktemp("bf16-llama")
    save_tiny_llama(path, initializer_range=0.1, hidden_size=128, num_hidden_layers=4,
                    vocab_size=VOCAB)  # fmt: skip
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_teacher_forced_logits_and_greedy_match_hugging_face(
    model_dir: Path, device: str
) -> None:
    from transformers import AutoModelForCausalLM

    hf_model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf_model = hf_model.to(device).eval()
    llm = LLM(str(model_dir), dtype="bfloat16", device=device, max_num_seqs=16,
              **({"num_kv_blocks": 512} if device == "cpu" else {}))  # fmt: skip
    rng = random.Random(0)
    prompts = [random_tokens(rng, n, VOCAB) for n in PROMPT_LENS]
    reference = [hf_greedy_logits(hf_model, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]

    # Teacher forcing through the runner, before the engine has used its pool: all prompts
    # prefilled in one step, then Hugging Face's tokens fed as batched decodes.
    runner = llm.engine.runner
    seqs = [make_seq(p, f"s{i}") for i, p in enumerate(prompts)]
    place(seqs, [len(p) + len(t) for p, (t, _) in zip(prompts, reference, strict=True)],
          runner.block_size)  # fmt: skip
    worst, num_rows = 0.0, 0
    active = list(range(len(seqs)))
    counts = [s.num_tokens for s in seqs]
    while active:
        batch = [seqs[i] for i in active]
        indices, logits = runner.compute_logits(batch, counts)
        assert indices == list(range(len(batch)))
        for row, i in enumerate(active):
            seq, (tokens, expected) = seqs[i], reference[i]
            seq.num_computed_tokens = seq.num_tokens
            step = seq.num_tokens - len(prompts[i])
            worst = max(worst, (logits[row].cpu() - expected[step]).abs().max().item())
            num_rows += 1
            if step + 1 < len(tokens):
                seq.append_token(tokens[step])
        active = [i for i in active if seqs[i].num_computed_tokens < seqs[i].num_tokens]
        counts = [1] * len(active)
    assert num_rows == sum(len(t) for t, _ in reference)
    assert worst <= LOGIT_TOLERANCE, f"largest logit difference {worst:.4f}"

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(prompts, params)
    for i, (out, (tokens, expected)) in enumerate(zip(outputs, reference, strict=True)):
        if out.token_ids == tokens:
            continue
        first = next(j for j, (a, b) in enumerate(zip(out.token_ids, tokens, strict=True))
                     if a != b)  # fmt: skip
        margin = expected[first].topk(2).values.diff().abs().item()
        assert margin < TIE_MARGIN, (
            f"request {i} departs from Hugging Face at token {first} (top-2 margin "
            f"{margin:.4f}): {out.token_ids} vs {tokens}"
        )
    assert llm.engine.stats().num_kv_blocks_used == 0


def hf_greedy_logits(
    model: Any, prompt: list[int], max_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Hugging Face's greedy tokens and the logits it chose each one from.

    EOS is ignored as the engine's `ignore_eos` does (it may be chosen, it does not stop):
    no EOS id at all, rather than `min_new_tokens`, which would forbid it.
    """
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, eos_token_id=-1,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)  # fmt: skip
    logits = torch.cat([step.float().cpu() for step in out.logits])  # (max_tokens, vocab)
    return out.sequences[0, len(prompt) :].tolist(), logits
