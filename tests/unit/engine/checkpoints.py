"""Random-weight Hugging Face checkpoints and hand-placed sequences for model-side tests.

Checkpoints are written with `save_pretrained` into temporary directories (nothing comes
from a hub). `place` gives sequences block tables drawn from a shuffled pool, so that
consecutive positions land in scattered blocks, as they do under a real block manager.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def save_llama(path: Path, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A tiny random Llama saved as safetensors; returns the Hugging Face model (fp32)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    model.save_pretrained(path)
    return model


def save_qwen2(path: Path, seed: int = 0, **overrides: Any) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 (q/k/v biases) saved as safetensors; returns the HF model."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # Qwen2 initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Hugging Face logits (len(tokens), vocab) for one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float()


def random_tokens(rng: random.Random, n: int, vocab: int = 256) -> list[int]:
    """n token ids avoiding the special ids 0..2."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def place(seqs: list[Sequence], final_lens: list[int], block_size: int, seed: int = 0) -> int:
    """Give each sequence blocks for its final length from a shuffled pool; returns pool size."""
    needed = [-(-n // block_size) for n in final_lens]
    ids = list(range(sum(needed)))
    random.Random(seed).shuffle(ids)
    for seq, n in zip(seqs, needed, strict=True):
        seq.block_table, ids = ids[:n], ids[n:]
    return sum(needed)


def make_seq(tokens: list[int], name: str = "r", **params: Any) -> Sequence:
    """A waiting sequence over `tokens` with greedy defaults."""
    params.setdefault("temperature", 0.0)
    return Sequence(name, tokens, SamplingParams(**params))
