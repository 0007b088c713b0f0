"""Bounds on client JSON, checked on the raw text before any parser recurses into it.

Python's `json` recurses once per nesting level: a body or batch line nested ~1,000 deep
raises RecursionError (not ValueError) from deep inside the parser, and everything that
walks the parsed value afterwards (validation, hashing, escaping) recurses again. So
every parser of client JSON (the API's bodies, each batch line) asks `json_bounds_error`
first; it never recurses and costs ~1 us for an ordinary request:

- fast path: the number of `[`/`{` bytes bounds the depth from above, and with the
  commas the number of values; a body under both limits needs nothing more (the text of
  a 1 KiB chat request holds a handful of brackets);
- otherwise the text is decoded as `json.loads` would decode it, its strings are cut
  out with a regex that cannot backtrack (an unterminated string runs to the end), and
  what is left (brackets and commas) gives the exact depth and value count.

Strings are bounded by the body or line size limit they arrive under.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

# Deepest nesting accepted: OpenAI request bodies nest ~6 levels (a JSON schema in
# `response_format` or a tool's parameters perhaps 20); Python's parser fails near 1,000.
MAX_JSON_DEPTH = 64
# Most values (scalars and containers) in one body: a 1 MiB embeddings request of token
# ids holds ~170,000; beyond this a body is a memory amplifier, not a request.
MAX_JSON_VALUES = 262_144

# A JSON string, or an unterminated one to the end of the text (never backtracks).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_STRUCTURE = re.compile(r"[^\[\]{},]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1, ",": 0}


def json_bounds_error(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH,
                      max_values: int = MAX_JSON_VALUES) -> str | None:
    """Why `raw` may not be parsed (too deep, too many values), or None when it may.

    Text that is not JSON at all passes if its brackets do: the parser refuses it then.
    """
    if isinstance(raw, bytes):
        num_opens = raw.count(b"[") + raw.count(b"{")
        num_commas = raw.count(b",")
    else:
        num_opens = raw.count("[") + raw.count("{")
        num_commas = raw.count(",")
    if num_opens <= max_depth and num_opens + num_commas < max_values:
        return None
    text = raw if isinstance(raw, str) else _decoded(raw)
    structure = _NOT_STRUCTURE.sub("", _STRING.sub("", text))
    depth = max(accumulate(map(_DEPTH_STEP.__getitem__, structure)), default=0)
    if depth > max_depth:
        return f"the JSON nests deeper than {max_depth} levels"
    num_values = structure.count(",") + structure.count("[") + structure.count("{") + 1
    if num_values > max_values:
        return f"the JSON holds more than {max_values} values"
    return None


def _decoded(raw: bytes) -> str:
    """`raw` as `json.loads` reads bytes (UTF-8, or UTF-16/32 by its first bytes).

    Undecodable bytes become U+FFFD here; the parser refuses them itself.
    """
    return raw.decode(json.detect_encoding(raw), errors="replace")
