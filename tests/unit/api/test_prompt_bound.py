"""The context check's shortcut: a prompt's UTF-8 length bounds its tokens, so a prompt
that fits by that bound is not tokenized; the bound never undercounts, and a tokenizer
whose normalizer can lengthen text gets no bound (its prompts are counted)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizers import normalizers, processors
from transformers import PreTrainedTokenizerFast

from core.model_context import ModelContext
from core.request_checks import RequestRefused, check_context
from core.requests import JobCreate
from tests.unit.engine.tiny_models import byte_level_tokenizer, metaspace_tokenizer

SPECIAL_STRINGS = ["<s>", "</s>", "<pad>", "<unk>"]
FIXED_TEXTS = [
    "", " ", "  x", "1", "\n\n\t", "hello world", "<s> a </s> b", "</s></s></s>",
    "héllo 日本語 \U0001F600 tabs\tand\nlines", "\u0300" * 12, "ﷺ", "\U0001F468\u200d\U0001F469",
]


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Mixed scripts, combining marks, emoji, control characters and special tokens."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x300, 0x36F), (0x3040, 0x30FF),
              (0x4E00, 0x4FFF), (0x600, 0x6FF), (0x1F300, 0x1F64F), (0xFB50, 0xFDFF)]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.05:
                parts.append(rng.choice(SPECIAL_STRINGS))
            else:
                low, high = rng.choice(ranges)
                parts.append(chr(rng.randint(low, high)))
        texts.append("".join(parts))
    return texts


def with_bos(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The tokenizer with a post-processor that puts BOS in front (as Llama's does)."""
    bos_id = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    return tokenizer


@pytest.mark.parametrize("make", [
    byte_level_tokenizer, metaspace_tokenizer,
    lambda: with_bos(byte_level_tokenizer()), lambda: with_bos(metaspace_tokenizer()),
], ids=["byte-level", "metaspace", "byte-level+bos", "metaspace+bos"])
def test_the_bound_is_never_below_the_count(
    make: Callable[[], PreTrainedTokenizerFast],
) -> None:
    context = ModelContext(name="m", max_model_len=4096, tokenizer=make())
    slack = []
    for text in FIXED_TEXTS + random_texts(400):
        body = {"prompt": text}
        count, bound = context.count_prompt_tokens(body), context.prompt_tokens_at_most(body)
        assert count is not None and bound is not None
        assert count <= bound, (text, count, bound)
        slack.append(bound - count)
    assert min(slack) <= 1, "no text came near the bound: the test would not see an undercount"


def test_a_normalizer_that_can_lengthen_text_leaves_no_bound() -> None:
    """NFKC spells U+FDFA out as 18 characters: three bytes would undercount it."""
    tokenizer = metaspace_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.NFKC()
    context = ModelContext(name="m", max_model_len=4096, tokenizer=tokenizer)
    count = context.count_prompt_tokens({"prompt": "ﷺ"})
    assert count is not None and count > len("ﷺ".encode()) + 2
    assert context.prompt_tokens_at_most({"prompt": "ﷺ"}) is None
    assert ModelContext(name="m", max_model_len=64).prompt_tokens_at_most({"prompt": "x"}) is None


def test_chat_messages_have_no_bound() -> None:
    context = ModelContext(name="m", max_model_len=4096, tokenizer=byte_level_tokenizer())
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert context.prompt_tokens_at_most(body) is None


def test_prompts_that_fit_by_the_bound_are_not_counted_and_the_rest_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64-token context: 20 bytes fit by the bound; 80 bytes of words need the count
    (and fit: the tokenizer merges them); 80 single-byte tokens do not fit and are
    refused, as before."""
    context = ModelContext(name="m", max_model_len=64, tokenizer=byte_level_tokenizer())
    counted: list[str] = []
    count = ModelContext._count

    def spy(self: ModelContext, text: str, *, add_special_tokens: bool) -> int:
        counted.append(text)
        return count(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(ModelContext, "_count", spy)

    def check(prompt: str, max_tokens: int) -> None:
        check_context(JobCreate(model="m", prompt=prompt, max_tokens=max_tokens), context)

    check("the quick brown fox.", max_tokens=40)
    assert counted == []
    words = "the quick brown fox " * 4
    check(words, max_tokens=4)
    assert counted == [words]
    with pytest.raises(RequestRefused) as refused:
        check("\x01" * 80, max_tokens=1)
    assert refused.value.code == "context_length_exceeded"
