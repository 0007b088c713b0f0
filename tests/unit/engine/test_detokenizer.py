"""Detokenizer: multi-byte UTF-8, context-dependent spaces, stop strings across tokens."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.unit.engine.tiny_models import byte_level_tokenizer, metaspace_tokenizer
from workers.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE that splits multi-byte characters across tokens."""
    return byte_level_tokenizer()


def stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    """Feed tokens one at a time, collecting the deltas, then the final one."""
    deltas = []
    for token_id in ids:
        stopped = detok.add_tokens([token_id])
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            return deltas
    detok.flush()
    deltas.append(detok.take_delta(finished=True))
    return deltas


def test_multibyte_characters_are_never_split(byte_tok: PreTrainedTokenizerFast) -> None:
    """Characters spread over several tokens appear whole, once, in order."""
    text = "日本語 🙂 café naïve 🙃"
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids), "test needs split characters"
    prompt = byte_tok.encode("hello", add_special_tokens=False)
    deltas = stream(Detokenizer(byte_tok, prompt), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_leading_spaces_come_from_context() -> None:
    """SentencePiece-style tokens keep their space when decoded after the prompt."""
    tok = metaspace_tokenizer()
    prompt = tok.encode("hello", add_special_tokens=False)
    ids = tok.encode("hello world fox", add_special_tokens=False)[1:]
    assert tok.decode(ids[:1]) == "world"  # alone, the space is lost
    deltas = stream(Detokenizer(tok, prompt), ids)
    assert deltas[:2] == [" world", " fox"]
    assert "".join(deltas) == " world fox"


def test_stop_string_across_token_boundaries_is_trimmed(
    byte_tok: PreTrainedTokenizerFast,
) -> None:
    """A stop string spanning tokens ends the text just before it; deltas never leak it."""
    ids = byte_tok.encode(" the quick brown fox jumps", add_special_tokens=False)
    detok = Detokenizer(byte_tok, [], stop=["k br", "lazy"])
    deltas = stream(detok, ids)
    assert detok.stopped
    assert detok.text == " the quic"
    assert "".join(deltas) == " the quic"
    assert all("k" not in d for d in deltas)


def test_earliest_stop_string_wins_and_unmatched_text_is_released(
    byte_tok: PreTrainedTokenizerFast,
) -> None:
    """With several stop strings the earliest match counts; without a match all text flows."""
    ids = byte_tok.encode("over the lazy dog", add_special_tokens=False)
    detok = Detokenizer(byte_tok, [], stop=["dog", "the"])
    stream(detok, ids)
    assert detok.text == "over "
    free = Detokenizer(byte_tok, [], stop=["never appears"])
    assert "".join(stream(free, ids)) == "over the lazy dog"


def test_unfinished_deltas_hold_back_a_possible_stop_start(
    byte_tok: PreTrainedTokenizerFast,
) -> None:
    """While unfinished, the last len(stop)-1 characters wait; finishing releases them."""
    detok = Detokenizer(byte_tok, [], stop=["abc"])
    detok.add_tokens(byte_tok.encode("hello", add_special_tokens=False))
    assert detok.take_delta(finished=False) == "hel"
    assert detok.take_delta(finished=True) == "lo"


def test_special_tokens_are_skipped(byte_tok: PreTrainedTokenizerFast) -> None:
    """An eos token adds no text."""
    ids = [*byte_tok.encode("fox", add_special_tokens=False), byte_tok.eos_token_id]
    assert "".join(stream(Detokenizer(byte_tok, []), ids)) == "fox"


def test_long_streams_match_a_full_decode(byte_tok: PreTrainedTokenizerFast) -> None:
    """Hundreds of tokens streamed equal one decode of them all."""
    text = " ".join(["héllo wörld 日本語のテキスト 🙂 the lazy dog"] * 20)
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert "".join(stream(Detokenizer(byte_tok, [1, 2, 3]), ids)) == text
