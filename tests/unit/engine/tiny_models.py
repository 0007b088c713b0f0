"""Small, offline test assets: tokenizers trained on the spot and a random-weight Llama.

Nothing here touches a hub. The byte-level tokenizer splits multi-byte UTF-8 characters
across tokens (as GPT-2-style tokenizers do); the metaspace one renders a token's leading
space only in context (as SentencePiece does). Both are real `transformers` fast tokenizers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "hello world héllo wörld 日本語のテキスト 🙂🙃 naïve café",
    "the quick brown fox jumps over the lazy dog",
    "User: what is the capital of France? Assistant: Paris.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 20

# Qwen3's switch as its template has it: `enable_thinking: false` (a request's
# chat_template_kwargs) closes an empty thinking block before the answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: decode(['▁world']) is 'world', in context ' world'."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """Write the byte-level tokenizer into a model directory and return it."""
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(model_dir)
    return tokenizer


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A 2-layer GQA Llama small enough for a 2-core CPU.

    `initializer_range` is far above Llama's 0.02 so that random weights give clearly
    separated logits: with near ties, fp32 reordering noise alone could flip an argmax and
    a parity failure would say nothing about the engine.
    """
    settings: dict[str, Any] = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.5,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_tiny_llama(model_dir: Path, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """Write a random-weight Llama (safetensors) plus tokenizer into `model_dir`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    return model


def hf_greedy_steps(
    model: Any, prompt: list[int], max_tokens: int, *, pad_token_id: int = 0
) -> tuple[list[int], list[float]]:
    """Hugging Face greedy continuation of one prompt, and each step's top-2 logit margin."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad_token_id,
        )
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), margins


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Hugging Face greedy continuation of one prompt, and its smallest top-2 logit margin."""
    tokens, margins = hf_greedy_steps(model, prompt, max_tokens)
    return tokens, min(margins)
