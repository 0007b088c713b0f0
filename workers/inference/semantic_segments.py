"""What of a prompt the semantic cache embeds: the last user turn and its context, apart.

A conversation's answer is decided by its last user turn, read in the light of what came
before. Embedding the whole role-tagged conversation as one text fails twice: an encoder
such as all-MiniLM-L6-v2 reads only its first 256 word pieces, so in a long conversation
the last turn is cut off and every conversation behind the same system prompt looks
alike; and in a short one, a changed last turn moves the vector of the whole only a
little. So a prompt becomes two segments, each embedded on its own:

- `last`: the last user turn, never truncated: a turn longer than the encoder reads is
  embedded in pieces whose vectors are averaged;
- `context`: the earlier turns (role-tagged), of which the encoder reads the most recent
  part (its tail), since the nearest turns matter most;
- `system`: the system (and developer) messages, not embedded: a cached answer serves
  only prompts under the same system prompt, so it is part of the scope searched. (Embedded
  with the turns, a long system prompt would swamp them: two conversations behind the
  same 300-word instructions look alike whatever their turns say.)

A plain prompt (or a conversation of one user turn after at most a system prompt) has no
context. The vector the cache searches with is their weighted sum (`search_key`): the
last turn dominates, the context separates conversations that diverged earlier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Weights of the last turn and of the context in the search key.
LAST_TURN_WEIGHT = 0.8
CONTEXT_WEIGHT = 0.2
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class PromptSegments:
    """A prompt as the semantic cache reads it."""

    last: str
    context: str  # "" when there is none
    system: str = ""

    @property
    def has_context(self) -> bool:
        """Whether anything came before the last user turn."""
        return bool(self.context)

    @property
    def text(self) -> str:
        """The turns as one text (what the cache shows as the entry's prompt)."""
        return f"{self.context}\nuser: {self.last}" if self.context else self.last


@dataclass(frozen=True, slots=True)
class SegmentVectors:
    """Unit vectors of a prompt's segments (the context's is the last turn's when there
    is no context, so two plain prompts compare exactly as their texts do)."""

    last: np.ndarray
    context: np.ndarray
    has_context: bool

    @property
    def search_key(self) -> np.ndarray:
        """The unit vector the cache stores and searches with."""
        key = LAST_TURN_WEIGHT * self.last + CONTEXT_WEIGHT * self.context
        return _unit(key)


def segments_of(body: dict[str, Any]) -> PromptSegments:
    """The segments of a request body's `messages` or `prompt`."""
    messages = body.get("messages")
    if isinstance(messages, list):
        turns = [m for m in messages if isinstance(m, dict)]
        system = "\n".join(_content(m) for m in turns if m.get("role") in SYSTEM_ROLES)
        turns = [m for m in turns if m.get("role") not in SYSTEM_ROLES]
        last_user = max((i for i, m in enumerate(turns) if m.get("role") == "user"),
                        default=None)
        if last_user is None:
            return PromptSegments("", _tagged(turns), system)
        # Turns after the last user one (a prefilled assistant reply) stay context.
        rest = turns[:last_user] + turns[last_user + 1:]
        return PromptSegments(_content(turns[last_user]), _tagged(rest), system)
    prompt = body.get("prompt")
    return PromptSegments(prompt if isinstance(prompt, str) else "", "")


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):  # content parts: their text, joined as the API joins them
        text = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    # An assistant's tool calls are what its turn said: two conversations that called
    # different functions, or with other arguments, must not look alike.
    calls = [c.get("function") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    lines = [f"call {f.get('name')}({f.get('arguments')})" for f in calls if isinstance(f, dict)]
    return "\n".join([text, *lines]) if lines else text


def _tagged(turns: list[dict[str, Any]]) -> str:
    return "\n".join(f"{m.get('role', '')}: {_content(m)}" for m in turns)


def _unit(vector: np.ndarray) -> np.ndarray:
    flat = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(flat))
    return flat / norm if norm > 0 else flat


class SegmentEmbedder:
    """Embeds prompts' segments with an embedding runner, whole last turns, context tails."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._tokenizer = runner.tokenizer
        # Word pieces one input holds, besides [CLS] and [SEP].
        self._limit = int(runner.max_model_len) - 2

    def embed(self, prompts: list[PromptSegments]) -> list[SegmentVectors]:
        """Segment vectors per prompt, all pieces of all prompts in one runner call."""
        inputs: list[str | list[int]] = []
        spans = []  # per prompt: (first, count) of its last turn's pieces, context index
        for prompt in prompts:
            pieces = self._pieces(prompt.last)
            first = len(inputs)
            inputs.extend(pieces)
            context_index = None
            if prompt.has_context:
                context_index = len(inputs)
                inputs.append(self._tail(prompt.context))
            spans.append((first, len(pieces), context_index))
        outputs = self._runner.embed(inputs) if inputs else []
        vectors = [np.asarray(o.embedding.float().cpu().numpy(), dtype=np.float32)
                   for o in outputs]
        result = []
        for first, count, context_index in spans:
            last = _unit(np.mean(vectors[first:first + count], axis=0))
            context = last if context_index is None else _unit(vectors[context_index])
            result.append(SegmentVectors(last, context, context_index is not None))
        return result

    def _ids(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pieces(self, text: str) -> list[str | list[int]]:
        """The last turn whole, or in pieces the encoder reads whole when it is long."""
        ids = self._ids(text)
        if len(ids) <= self._limit:
            return [text if ids else " "]
        return [ids[i:i + self._limit] for i in range(0, len(ids), self._limit)]

    def _tail(self, text: str) -> str | list[int]:
        """The context, or its most recent `limit` word pieces when it is longer."""
        ids = self._ids(text)
        return text if len(ids) <= self._limit else ids[-self._limit:]
