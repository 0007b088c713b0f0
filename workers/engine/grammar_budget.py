"""Closing a schema-constrained output within its token budget.

A model that loops inside a value (a string repeating itself, an integer of hundreds of
digits) reaches max_tokens mid-document, and the client gets text that does not parse. A
sequence under a JSON schema therefore measures, as its budget runs low, how many tokens
the shortest way out of its current state takes: a walk of the grammar on a copy of its
matcher that closes the open string, then the open containers, and gives the required
properties still missing their smallest values. Once that walk only just fits in the
tokens left, the sequence follows it token by token and ends with a whole document.
finish_reason stays "length": the budget, not the model, ended it, and the last values may
be cut short or minimal.

The walk prefers, where the grammar allows them: a stop token (the document is whole);
inside a string its closing quote; outside, a closing bracket or a separator, then the
shortest values (`""`, `0`, `[]`, `false`, ...), then an opening quote (a key the grammar
requires); else the longest token the grammar allows (the rest of a forced key, a
pattern's characters). Whether the walk is inside a string is read from the bytes, which
the grammar keeps well-formed JSON.

When to measure is chosen so that few walks run: the first distance comes from the
schema's empty document (cached per schema), and the next walk runs when half of the slack
between the tokens left and the last distance is spent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

# Tokens between the measured way out and the tokens left at which the walk is taken; the
# model's own token in the same step can lengthen the way out by a little.
CLOSE_MARGIN = 2
# The longest way out walked. Each step of a walk is a mask fill on the thread every engine
# step waits for, and a walk that cannot end (a `pattern` the longest-token fallback never
# completes) would otherwise run to the budget, thousands of fills, for each request.
WALK_LIMIT = 256
_SCHEMA_DISTANCES = 1024  # per-schema distances of the empty document kept

# Separators come before the values: where the grammar allows one, the value before it
# is whole, and a digit would only lengthen the number being written.
_CLOSERS = (b"}", b"]", b",", b":")
_SHORT_VALUES = (b'""', b"0", b"[]", b"{}", b"false", b"null", b"true", b"[", b"{")


def _in_string_after(in_string: bool, escaped: bool, data: bytes) -> tuple[bool, bool]:
    """The JSON lexer's (inside a string, after a backslash) state after `data`."""
    for byte in data:
        if escaped:
            escaped = False
        elif in_string and byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # quote
            in_string = not in_string
    return in_string, escaped


class BudgetCloser:
    """The vocabulary's structural tokens, and the walk out of a matcher's state."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._decoded = list(decoded_vocab[:vocab_size])
        self._decoded += [b""] * (vocab_size - len(self._decoded))
        ids_of: dict[bytes, int] = {}
        for token_id, data in enumerate(self._decoded):
            ids_of.setdefault(data, token_id)  # the first id of a duplicated text
        self._stop = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._quote = ids_of.get(b'"')
        # Outside a string: close, separate, the shortest value, then a key's opening quote.
        self._outside = [ids_of[b] for b in (*_CLOSERS, *_SHORT_VALUES, b'"') if b in ids_of]
        self._lengths = np.array([len(d) for d in self._decoded], dtype=np.int64)
        self._schema_distance: OrderedDict[str, int | None] = OrderedDict()

    def walk(self, matcher: Any, in_string: bool, escaped: bool, limit: int) -> list[int] | None:
        """The tokens of the way out of `matcher`'s state, at most `limit` (and WALK_LIMIT)
        of them before the document may end; None if there is none that short. The matcher
        is not moved."""
        limit = min(limit, WALK_LIMIT)
        fork = matcher.fork()
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        words = bitmask[0].numpy()
        path: list[int] = []
        while True:
            fork.fill_next_token_bitmask(bitmask)
            if self.stop_token(words) is not None:
                return path
            if len(path) >= limit:
                return None
            token_id = self._pick(words, in_string)
            if token_id is None or not fork.accept_token(token_id):
                return None
            in_string, escaped = _in_string_after(in_string, escaped, self._decoded[token_id])
            path.append(token_id)

    def stop_token(self, words: np.ndarray) -> int | None:
        """A stop token the row's bitmask allows, if any."""
        return next((t for t in self._stop if self._allowed(words, t)), None)

    def schema_distance(self, schema: str, matcher: Any, limit: int) -> int | None:
        """The length of the way out of a fresh matcher for `schema`, walked once per
        schema (while cached); None where it is longer than `limit` or WALK_LIMIT."""
        if schema in self._schema_distance:
            self._schema_distance.move_to_end(schema)
            known = self._schema_distance[schema]
        else:
            path = self.walk(matcher, False, False, WALK_LIMIT)
            known = None if path is None else len(path)
            self._schema_distance[schema] = known
            while len(self._schema_distance) > _SCHEMA_DISTANCES:
                self._schema_distance.popitem(last=False)
        return known if known is not None and known <= limit else None

    def in_string_after(self, in_string: bool, escaped: bool,
                        token_ids: list[int]) -> tuple[bool, bool]:
        """The lexer state after the texts of `token_ids`."""
        for token_id in token_ids:
            in_string, escaped = _in_string_after(in_string, escaped, self._decoded[token_id])
        return in_string, escaped

    @staticmethod
    def _allowed(words: np.ndarray, token_id: int) -> bool:
        return bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)

    def _pick(self, words: np.ndarray, in_string: bool) -> int | None:
        preferred = ([] if self._quote is None else [self._quote]) if in_string else self._outside
        for token_id in preferred:
            if self._allowed(words, token_id):
                return token_id
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        if allowed.size == 0:
            return None
        return int(allowed[np.argmax(self._lengths[allowed])])
