"""What the semantic cache embeds of a prompt: the last user turn whole, the context apart."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.embedding_runner import EmbeddingRunner
from workers.inference.semantic_segments import SegmentEmbedder, segments_of


def test_a_conversation_splits_into_system_context_and_last_user_turn() -> None:
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "I'm writing Python."},
        {"role": "assistant", "content": "Good."},
        {"role": "user", "content": [{"type": "text", "text": "How do I read a file?"}]},
        {"role": "assistant", "content": "You"},  # a prefilled reply stays context
    ]}
    segments = segments_of(body)
    assert segments.last == "How do I read a file?"
    assert segments.system == "Be brief."
    assert segments.context == "user: I'm writing Python.\nassistant: Good.\nassistant: You"
    assert segments.has_context


def test_a_prompt_or_a_single_turn_has_no_context() -> None:
    assert segments_of({"prompt": "Hi"}).has_context is False
    single = segments_of({"messages": [{"role": "system", "content": "S"},
                                       {"role": "user", "content": "Hi"}]})
    assert (single.last, single.context, single.system) == ("Hi", "", "S")


@pytest.fixture(scope="module")
def embedder() -> SegmentEmbedder:
    return SegmentEmbedder(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1))


def test_the_end_of_a_long_last_turn_still_moves_its_vector(embedder: SegmentEmbedder) -> None:
    """MiniLM reads 256 word pieces; a last turn of ~600 is embedded in pieces, so a
    question changed at its very end is a different vector, not a truncated twin."""
    filler = "Here is some background about my garden and the weather this year. " * 40
    first, second = embedder.embed([
        segments_of({"prompt": filler + "Which roses should I plant?"}),
        segments_of({"prompt": filler + "How do I repair a bicycle tyre?"}),
    ])
    assert float(first.last @ second.last) < 0.999
    assert first.has_context is False
    assert np.allclose(first.search_key, first.last, atol=1e-6)


def test_the_context_keeps_its_most_recent_turns(embedder: SegmentEmbedder) -> None:
    """A context past 256 word pieces is read from its tail: the earliest turn does not
    count, the latest does."""
    old = [{"role": "user", "content": "Tell me about the sea. " * 60},
           {"role": "assistant", "content": "The sea is large. " * 60}]

    def ask(first: str, latest: str) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": first}, *old,
                             {"role": "user", "content": latest},
                             {"role": "assistant", "content": "Sure."},
                             {"role": "user", "content": "What should I pack?"}]}

    base, earliest_changed, latest_changed = embedder.embed([
        segments_of(ask("I go skiing.", "I go to Norway.")),
        segments_of(ask("I go diving.", "I go to Norway.")),
        segments_of(ask("I go skiing.", "I go to Egypt.")),
    ])
    assert float(base.context @ earliest_changed.context) == pytest.approx(1.0, abs=1e-5)
    assert float(base.context @ latest_changed.context) < 0.999
    assert float(base.last @ latest_changed.last) == pytest.approx(1.0, abs=1e-5)
