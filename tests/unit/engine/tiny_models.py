"""Small, offline test assets: tokenizers trained on the spot and a random-weight Llama.

Nothing here touches a hub. The byte-level tokenizer splits multi-byte UTF-8 characters
across tokens (as GPT-2-style tokenizers do); the metaspace one renders a token's leading
space only in context (as SentencePiece does). Both are real `transformers` fast tokenizers.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "hello world héllo wörld 日本語のテキスト 🙂🙃 naïve café",
    "the quick brown fox jumps over the lazy dog",
    "User: what is the capital of France? Assistant: Paris.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
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
