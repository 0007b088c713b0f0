"""The semantic cache's structured checks refuse what an embedding blurs, and only that."""

from __future__ import annotations

import pytest

from workers.inference.semantic_checks import disagreements


@pytest.mark.parametrize(
    ("prompt", "cached", "check"),
    [
        ("What is the capital of France?", "What is the capital of Germany?", "names"),
        ("How many legs do 3 spiders have?", "How many legs do 4 spiders have?", "numbers"),
        ("What is 15% of 200?", "What is twenty percent of 200?", "numbers"),
        ("Who was the first president?", "Who was the second president?", "numbers"),
        ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
        ("Why doesn't ice sink?", "Why does ice sink?", "negation"),
        ("Is it safe to eat raw eggs?", "Is it unsafe to eat raw eggs?", "polarity"),
        ("How do I install numpy?", "How do I uninstall numpy?", "polarity"),
        ("What is the largest planet?", "What is the smallest planet?", "polarity"),
        ("Is the museum open on Monday?", "Is the museum open on Friday?", "dates"),
        ("Will it rain in Paris today?", "Will it rain in Paris tomorrow?", "dates"),
        ("How many grams are in a pound?", "How many ounces are in a pound?", "units"),
        ("Summarise the 2023 report.", "Summarise the 2024 report.", "numbers"),
        ("Translate 'good morning' to Italian.", "Translate 'good night' to Italian.",
         "names"),
        ("How long is the flight from London to New York?",
         "How long is the flight from New York to London?", "order"),
        ("Can I use baking soda instead of baking powder?",
         "Can I use baking powder instead of baking soda?", "order"),
    ],
)
def test_a_changed_fact_is_refused_by_its_check(prompt: str, cached: str, check: str) -> None:
    assert check in disagreements(prompt, cached)
    assert check in disagreements(cached, prompt)  # the checks are symmetric


@pytest.mark.parametrize(
    ("prompt", "cached"),
    [
        ("What is the capital of France?", "what's the capital city of France"),
        ("Explain photosynthesis briefly.", "Briefly explain photosynthesis."),
        ("How many legs do 3 spiders have?", "3 spiders: how many legs in total?"),
        ("Is it not safe to swim after eating?", "Is swimming after eating not safe?"),
        ("What is 15% of 200?", "How much is fifteen percent of 200?"),
        ("How many ounces make up one pound?", "How many ounces are in a pound?"),
        ("How do I reverse a list in Python?", "hey, how do I reverse a python list"),
        ("How much is California's minimum wage?", "What is the minimum wage in California?"),
        ("What year did the Berlin Wall fall?", "When did the Berlin Wall fall?"),
        ("What is the boiling point of water?", "At what temperature does water boil?"),
    ],
)
def test_paraphrases_with_the_same_facts_pass(prompt: str, cached: str) -> None:
    assert disagreements(prompt, cached) == []


def test_swapped_roles_are_refused_and_a_reworded_phrase_is_not() -> None:
    assert "order" in disagreements("Who beat Spain in the final?",
                                    "Who did Spain beat in the final?")
    assert "order" in disagreements("How do I move money from PayPal to my bank?",
                                    "How do I move money from my bank to PayPal?")
    assert disagreements("How do I reverse a list in Python?",
                         "How do I reverse a Python list?") == []
