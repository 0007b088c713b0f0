"""The semantic cache's false-hit guard refuses what the embedding blurs."""

from __future__ import annotations

import pytest

from workers.inference.semantic_guard import may_share_answer


@pytest.mark.parametrize(
    ("prompt", "cached"),
    [
        ("What is the capital of France?", "What is the capital of Germany?"),
        ("How many legs do 3 spiders have?", "How many legs do 4 spiders have?"),
        ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?"),
        ("Summarise the 2023 report.", "Summarise the 2024 report."),
        ("Translate 'good morning' to Italian.", "Translate 'good night' to Italian."),
        ("Why doesn't ice sink?", "Why does ice sink?"),
    ],
)
def test_different_numbers_names_or_negations_are_refused(prompt: str, cached: str) -> None:
    assert not may_share_answer(prompt, cached)


@pytest.mark.parametrize(
    ("prompt", "cached"),
    [
        ("What is the capital of France?", "what's the capital city of France"),
        ("Explain photosynthesis briefly.", "Briefly explain photosynthesis."),
        ("How many legs do 3 spiders have?", "3 spiders: how many legs in total?"),
        ("Is it not safe to swim after eating?", "Is swimming after eating not safe?"),
    ],
)
def test_paraphrases_with_the_same_facts_may_share(prompt: str, cached: str) -> None:
    assert may_share_answer(prompt, cached)
