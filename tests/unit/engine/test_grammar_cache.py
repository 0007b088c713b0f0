"""Compiled grammars are cached within a bound: fresh schemas cannot grow a worker without
end (xgrammar's own default keeps every one)."""

from __future__ import annotations

import json

import pytest

from tests.unit.engine.tiny_models import byte_level_tokenizer
from workers.engine import grammar
from workers.engine.grammar import GrammarCompiler


def test_fresh_schemas_stay_within_the_cache_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 256 << 10
    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", limit)
    tokenizer = byte_level_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    sizes = []
    for k in range(40):
        schema = {"type": "string", "enum": [f"{k}-{i}" for i in range(200)]}
        state = compiler.new_state(json.dumps(schema))
        assert state.matcher.accept_string(f'"{k}-7"')
        sizes.append(compiler._compiler.get_cache_size_bytes())
    # Each compile adds to the cache: unbounded, 40 of them would pass the limit.
    assert sizes[0] > 0 and sizes[0] * 40 > 2 * limit
    assert max(sizes) <= limit * 1.5, sizes  # "may slightly exceed", says xgrammar
