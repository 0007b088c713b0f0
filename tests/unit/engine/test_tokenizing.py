"""The backend shortcuts give exactly what the transformers calls give: the same ids for
every text and option, the same text for every id list, and they step aside (the
transformers call runs) where the backend alone would differ."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tokenizers import PreTokenizedString
from tokenizers.pre_tokenizers import PreTokenizer
from transformers import PreTrainedTokenizerFast

from tests.unit.engine.tiny_models import byte_level_tokenizer, metaspace_tokenizer
from workers.engine.tokenizing import decoder_of, encode_ids, encode_ids_batch, texts_encoder_of

TEXTS = [
    "", "hello world", "  leading and trailing  ", "<s> a </s> b</s>", "<pad><unk>x",
    "héllo 日本語 \U0001F600 tabs\tand\nlines", "don't , stop . here ?", "0123456789" * 30,
]
TOKENIZERS: list[Callable[[], PreTrainedTokenizerFast]] = [
    byte_level_tokenizer, metaspace_tokenizer]


@pytest.mark.parametrize("make", TOKENIZERS, ids=["byte-level", "metaspace"])
@pytest.mark.parametrize("special", [True, False])
def test_ids_and_text_are_the_transformers_calls(
    make: Callable[[], PreTrainedTokenizerFast], special: bool
) -> None:
    """Encoding with and without special tokens; decoding skipping them or not, whole
    id lists and windows cut anywhere (mid-character too)."""
    tokenizer = make()
    decode = decoder_of(tokenizer)
    for text in TEXTS:
        expected_ids = tokenizer(text, add_special_tokens=special).input_ids
        assert encode_ids(tokenizer, text, add_special_tokens=special) == expected_ids
        ids = tokenizer(text).input_ids
        for window in (ids, ids[1:], ids[:-1], ids[2:5]):
            assert decode(window, special) == tokenizer.decode(window,
                                                               skip_special_tokens=special)


@pytest.mark.parametrize("make", TOKENIZERS, ids=["byte-level", "metaspace"])
def test_a_batch_encodes_as_each_text_alone(make: Callable[[], PreTrainedTokenizerFast]) -> None:
    """encode_ids_batch gives each text's encode_ids (special tokens added), also where the
    backend carries an option the call resets and the call runs instead."""
    tokenizer = make()
    assert encode_ids_batch(tokenizer, TEXTS) == [encode_ids(tokenizer, t) for t in TEXTS]
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    try:
        assert encode_ids_batch(tokenizer, TEXTS) == [tokenizer(t).input_ids for t in TEXTS]
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_encode_steps_aside_when_the_backend_carries_options_the_call_resets() -> None:
    """Truncation left on the backend, or special tokens split: the call's ids still."""
    tokenizer = byte_level_tokenizer()
    text = TEXTS[5] + " </s> " + TEXTS[6]
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    try:
        assert encode_ids(tokenizer, text) == tokenizer(text).input_ids
        assert len(encode_ids(tokenizer, text)) > 3
    finally:
        tokenizer.backend_tokenizer.no_truncation()
    plain = encode_ids(tokenizer, "a </s> b")
    tokenizer.split_special_tokens = True  # the call would set this on the backend
    split = encode_ids(tokenizer, "a </s> b")
    assert split == tokenizer("a </s> b").input_ids
    assert split != plain


@pytest.mark.parametrize("make", TOKENIZERS, ids=["byte-level", "metaspace"])
def test_texts_encode_as_the_call_encodes_whatever_the_shared_backend_carries(
    make: Callable[[], PreTrainedTokenizerFast]
) -> None:
    """One text and many; truncation and padding left on the shared backend (as a saved
    tokenizer.json carries them) reach neither the call nor the shortcut; special tokens
    split when the tokenizer says so."""
    tokenizer = make()
    encode = texts_encoder_of(tokenizer)
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    tokenizer.backend_tokenizer.enable_padding(length=40)
    for texts in ([TEXTS[7]], TEXTS, [*TEXTS, *TEXTS[::-1]]):
        expected = tokenizer(texts, add_special_tokens=False).input_ids
        assert encode(texts) == expected
        assert any(len(ids) > 40 for ids in expected), "long enough to show truncation"
    plain = encode(["a </s> b"])
    tokenizer.split_special_tokens = True
    split = encode(["a </s> b"])
    assert split == tokenizer(["a </s> b"], add_special_tokens=False).input_ids
    assert split != plain


class _SpaceSplitter:
    """A pre-tokenizer written in Python: a backend holding one cannot be serialized."""

    def pre_tokenize(self, pretok: PreTokenizedString) -> None:
        pretok.split(lambda _, piece: piece.split(" ", "isolated"))


def test_texts_encode_through_the_call_when_the_backend_cannot_be_copied() -> None:
    tokenizer = byte_level_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = PreTokenizer.custom(_SpaceSplitter())
    with pytest.raises(Exception, match="(?i)custom"):
        tokenizer.backend_tokenizer.to_str()
    assert texts_encoder_of(tokenizer)(TEXTS) == tokenizer(
        TEXTS, add_special_tokens=False).input_ids


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers() -> None:
    """Cleaning up spaces (" ," -> ",") is transformers' own step: the backend alone
    would keep them, so the decoder is the tokenizer's."""
    tokenizer = metaspace_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    # transformers skips the clean-up for BPE models unless told otherwise.
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer("don't , stop . here ?").input_ids
    backend_text = tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoder_of(tokenizer)(ids, True) == expected
    assert backend_text != expected, "the example should show what the clean-up does"
