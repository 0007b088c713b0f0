"""`core.digest_cache`: results kept by a digest of their text, never the text itself."""

from __future__ import annotations

import sys
from functools import partial

import pytest

from core import structured_outputs
from core.digest_cache import DIGEST_SIZE, DigestCache


def test_a_text_is_computed_once_until_evicted() -> None:
    cache: DigestCache[int] = DigestCache(max_entries=2)
    calls: list[str] = []

    def compute(text: str) -> int:
        calls.append(text)
        return len(text)

    for text in ("aa", "aa", "bbb", "aa", "c", "bbb"):
        assert cache.get(text, partial(compute, text)) == len(text)
    # "aa" was used after "bbb", so "c" evicted "bbb", which was computed again.
    assert calls == ["aa", "bbb", "c", "bbb"]
    assert len(cache) == 2


def test_kinds_do_not_share_results() -> None:
    cache: DigestCache[str] = DigestCache(max_entries=4)
    assert cache.get("{}", lambda: "schema", kind="schema") == "schema"
    assert cache.get("{}", lambda: "tag", kind="tag") == "tag"
    assert cache.get("{}", lambda: "again", kind="schema") == "schema"


def test_schema_checks_keep_no_schema_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ~1 MB schema checked leaves a 16-byte key and a short result behind (the cache
    of 256 whole texts grew the API by ~180 MB over 100 such schemas)."""
    cache: DigestCache[str | None] = DigestCache(max_entries=256)
    monkeypatch.setattr(structured_outputs, "_compile_problems", cache)
    monkeypatch.setattr(structured_outputs, "_compiled_problem", lambda *a: "no good")
    for i in range(3):
        schema = {"type": "string", "description": f"{i}" + "x" * 1_000_000}
        assert structured_outputs.compile_problem(schema) == "no good"
    entries = list(cache._digest_to_result.items())
    assert len(entries) == 3
    assert all(len(key) == DIGEST_SIZE and value == "no good" for key, value in entries)
    assert sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in entries) < 1000
