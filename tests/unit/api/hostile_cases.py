"""Hostile request bodies, shared by the API tests and the batch-line tests.

Each case is a patch to a valid chat or text request and the field the refusal must
name. Bodies are sent as JSON text with `ensure_ascii` (`"x\\ud800y"`), the way a client
smuggles a lone surrogate through JSON; `send_json` does that.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

LONE = "x\ud800y"


def encode(body: dict[str, Any]) -> bytes:
    """JSON bytes that a UTF-8 encoder accepts whatever the strings hold (escapes, NaN)."""
    return json.dumps(body, ensure_ascii=True).encode("ascii")


def send_json(client: TestClient, path: str, body: dict[str, Any],
              headers: dict[str, str]) -> Any:
    """POST `body` as escaped JSON; the client's response."""
    return client.post(path, content=encode(body),
                       headers=headers | {"Content-Type": "application/json"})


# (patch, param): lone surrogates wherever a client can put text.
CHAT_TEXT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": LONE}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": LONE}, "stop[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", LONE]}, "stop[1]"),
    ({"messages": [{"role": "user", "content": "hi"}], "user": LONE}, "user"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_key": LONE}, "cache_key"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_key": "a\x00b"}, "cache_key"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {LONE: 1.0}},
     "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], LONE: 1}, "x\\ud800y"),
]
# Metadata is not part of a batch line's body (a batch has its own), so API only.
JOB_TEXT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"metadata": {"k": LONE}}, "metadata.k"),
    ({"metadata": {LONE: "v"}}, "metadata"),
]
PROMPT_TEXT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": LONE}, "prompt"),
    ({"prompt": "hi", "stop": [LONE]}, "stop[0]"),
    ({"prompt": "hi", "suffix": LONE}, "suffix"),
]

# (patch, param): types and values OpenAI refuses, applied to a valid request.
STRICT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1e30}, "max_tokens"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": "7"}, "seed"),
    ({"n": "1"}, "n"),
    ({"top_k": 2.0}, "top_k"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]
CHAT_ONLY_STRICT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
]
