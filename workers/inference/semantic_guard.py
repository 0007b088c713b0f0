"""Refusing semantic cache hits that an embedding blurs but a reader would not.

Sentence embeddings place "What is the capital of France?" and "What is the capital of
Germany?" close together (cosine ~0.9 with all-MiniLM-L6-v2), and "is it safe" beside
"is it not safe". Those are the wrong answers semantic caches are known for. A cached
answer may serve a new prompt only when both prompts carry the same:

- numbers (`3 apples` vs `4 apples`, dates, versions);
- names: capitalised words not at the start of a sentence, and words in quotes;
- negations (not, no, never, without, n't and the like).

The check is cheap and deliberately strict: it refuses some harmless paraphrases
("Paris" vs "the French capital"), which then simply run.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?", re.UNICODE)
_QUOTED = re.compile(r"[\"“”'‘’`]([^\"“”'‘’`]{1,80})[\"“”'‘’`]")
_SENTENCE_END = re.compile(r"[.!?:;\n]\s*$")
NEGATIONS = frozenset({
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
    "without", "cannot", "isnt", "arent", "wasnt", "werent", "dont", "doesnt", "didnt",
    "wont", "wouldnt", "shouldnt", "couldnt", "cant", "hasnt", "havent", "hadnt",
})


def may_share_answer(prompt: str, cached_prompt: str) -> bool:
    """True unless the prompts differ in their numbers, names or negations."""
    return _salient(prompt) == _salient(cached_prompt)


def _salient(text: str) -> tuple[frozenset[str], frozenset[str], int]:
    numbers = frozenset(n.replace(",", "") for n in _NUMBER.findall(text))
    names = {q.strip().casefold() for q in _QUOTED.findall(text)}
    negations = 0
    for match in _WORD.finditer(text):
        word = match.group(0)
        folded = word.casefold().replace("'", "").replace("’", "")
        if folded in NEGATIONS:
            negations += 1
        before = text[: match.start()]
        starts_sentence = not before.strip() or bool(_SENTENCE_END.search(before))
        if word[0].isupper() and not starts_sentence:
            names.add(folded)
    # Parity, not count: "not ... not" reads as an affirmation again, rarely as a third
    # meaning, and the count would refuse "I do not know, not at all" vs one "not".
    return numbers, frozenset(names), negations % 2
