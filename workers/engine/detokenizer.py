"""Incremental detokenization of one request, with stop strings.

Responsibilities:
- turn a growing list of token ids into text one token at a time, never emitting half of a
  multi-byte UTF-8 character (byte-level tokenizers split "é" or an emoji across tokens);
- find stop strings, also when they span token boundaries, and trim them off the text;
- hand out text deltas that never contain characters a stop string could still claim.

How the offsets work: the text of new tokens is the decode of a small window minus the
decode of the window's already-emitted head, so that tokenizers which render a token
differently depending on its left neighbour (SentencePiece's leading space) still give the
right text. Example, ids [a b c] emitted and d arriving: prefix window [a..c) → "Hel" is
subtracted from [a..d] → "Hello", giving "lo"; had "Hello" ended in U+FFFD (an incomplete
character) nothing would be emitted until the next token completes it.
"""

from __future__ import annotations

from typing import Any

from workers.engine.tokenizing import decoder_of

# Prompt tokens kept as left context for the first output token.
_CONTEXT_TOKENS = 5


class Detokenizer:
    """Turns one request's output token ids into text, incrementally."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = decoder_of(tokenizer)
        self.stop = list(stop or [])
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self._num_emitted_chars = 0
        self.stopped = False
        # Characters that might still turn out to be the start of a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append newly sampled tokens; True when a stop string has just been found."""
        for token_id in token_ids:
            if self.stopped:
                break
            self._ids.append(token_id)
            self._append_text(self._decode_new(final=False))
        return self.stopped

    def flush(self) -> None:
        """Emit whatever is pending (e.g. a trailing incomplete character) at the end."""
        if not self.stopped:
            self._append_text(self._decode_new(final=True))

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; unfinished, it keeps back a possible stop-string start."""
        end = len(self.text) if finished or self.stopped else len(self.text) - self._holdback
        if end <= self._num_emitted_chars:
            return ""
        delta = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def _decode_new(self, *, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""  # nothing visible yet, or an incomplete UTF-8 sequence: wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window small: only a few tokens of left context are ever needed.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return full_text[len(prefix_text) :]

    def _append_text(self, new_text: str) -> None:
        if not new_text:
            return
        # A stop string may start up to len(stop) - 1 characters before the new text.
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text
        if not self.stop:
            return
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
