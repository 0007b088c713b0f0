"""Schema-constrained outputs closed within max_tokens (random-weight Llama, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.unit.engine.test_engine import make_llm, model_dir  # noqa: F401 - fixture
from tests.unit.engine.test_structured_engine import FINITE
from tests.unit.engine.tiny_models import byte_level_tokenizer
from workers.engine import LLM, SamplingParams
from workers.engine.grammar import GrammarCompiler
from workers.engine.grammar_budget import CLOSE_MARGIN, BudgetCloser

# Unbounded values a model can loop in: a string, an integer, an array of objects.
UNBOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "count": {"type": "integer"},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"], "additionalProperties": False}},
    },
    "required": ["name", "count", "items"],
    "additionalProperties": False,
}


def token_of(llm: LLM, text: str) -> int:
    [token_id] = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return int(token_id)


def constrained(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(json_schema=json.dumps(UNBOUNDED), temperature=0,
                          max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("loop_on", ["a", "7", "{"])
def test_a_looping_model_is_closed_within_max_tokens(model_dir: Path, loop_on: str) -> None:  # noqa: F811
    """Pushed to repeat a character inside a string, an integer or an array, the model
    still returns a whole, valid document of at most max_tokens, reported as length."""
    llm = make_llm(model_dir)
    bias = {token_of(llm, loop_on): 30.0}
    for max_tokens in (60, 97):
        [out] = llm.generate(["hello"], [constrained(max_tokens, logit_bias=bias)])
        assert out.finish_reason == "length", out.text
        assert len(out.token_ids) <= max_tokens
        jsonschema.validate(json.loads(out.text), UNBOUNDED)
        # The model's own tokens run until the way out only just fits.
        assert out.text.count(loop_on) > max_tokens // 3, out.text


def test_the_closed_output_follows_the_model_until_the_close(model_dir: Path) -> None:  # noqa: F811
    """Closing changes only the end: the tokens before it are the uncut run's."""
    llm = make_llm(model_dir)
    bias = {token_of(llm, "a"): 30.0}
    [short, long] = llm.generate(
        ["hello", "hello"], [constrained(50, logit_bias=bias), constrained(200, logit_bias=bias)]
    )
    way_out = '", "count": 0, "items": []}'  # one token per byte
    assert short.text.endswith(way_out), short.text
    model_part = short.text[: -len(way_out)]
    assert long.text.startswith(model_part)
    # The model had the budget until the way out (and the margin) only just fitted.
    assert len(model_part) + len(way_out) + CLOSE_MARGIN >= 50
    assert len(long.token_ids) > len(short.token_ids)


def test_ignore_eos_is_never_closed_early(model_dir: Path) -> None:  # noqa: F811
    """A client that asked for max_tokens tokens whatever the stop token gets them: the
    looping output runs to the budget, cut, as it did before budgets."""
    llm = make_llm(model_dir)
    bias = {token_of(llm, "a"): 30.0}
    [out] = llm.generate(["hello"], [constrained(40, logit_bias=bias, ignore_eos=True)])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 40
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_budget_with_no_way_out_is_cut_as_before(model_dir: Path) -> None:  # noqa: F811
    """Where no way out fits (3 tokens for `{"name":"","count":0,"items":[]}`), the text
    is the prefix it was, unparsable, and says length."""
    llm = make_llm(model_dir)
    [out] = llm.generate(["hello"], [constrained(3)])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_outputs_that_end_of_themselves_are_unchanged(model_dir: Path) -> None:  # noqa: F811
    """A document that ends within its budget (and the margin) stops as the model chose,
    whatever the budget; at a budget of just its length the budget takes the last tokens."""
    llm = make_llm(model_dir)
    finite = json.dumps(FINITE)
    [free] = llm.generate(["hi"], [SamplingParams(json_schema=finite, temperature=0,
                                                  max_tokens=1000)])
    assert free.finish_reason == "stop", free.text
    jsonschema.validate(json.loads(free.text), FINITE)
    natural = len(free.token_ids)
    budgets = [natural + CLOSE_MARGIN + 1, 150, natural]
    outs = llm.generate(["hi"] * 3, [SamplingParams(json_schema=finite, temperature=0,
                                                    max_tokens=n) for n in budgets])
    for out in outs[:2]:
        assert (out.finish_reason, out.token_ids) == ("stop", free.token_ids)
    assert outs[2].finish_reason == "length"
    assert len(outs[2].token_ids) <= natural
    jsonschema.validate(json.loads(outs[2].text), FINITE)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = byte_level_tokenizer()
    return GrammarCompiler(tokenizer, 300, [2])


def walk_from(compiler: GrammarCompiler, schema: dict[str, Any], prefix: str) -> str:
    """The text of the way out after `prefix` (accepted byte by byte)."""
    state = compiler.new_state(json.dumps(schema))
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    for token_id in ids:
        assert state.matcher.accept_token(token_id), prefix
    closer = compiler._closer
    in_string, escaped = closer.in_string_after(False, False, ids)
    path = closer.walk(state.matcher, in_string, escaped, limit=200)
    assert path is not None
    return str(tokenizer.decode(path))


@pytest.mark.parametrize("prefix", [
    '{"name": "ab',
    '{"name": "a\\"b\\\\',
    '{"name": "x", "count": 12',
    '{"name": "x", "count": -',
    '{"name": "x", "count": 1, "items": [{"id": 3, "ok": tr',
    '{"name": "x", "count": 1, "items": [{"id": 3',
    '{"name": "x", "count": 1, "items": [{',
    '{"na',
])
def test_the_way_out_closes_strings_and_containers_and_fills_required_keys(
    compiler: GrammarCompiler, prefix: str
) -> None:
    document = prefix + walk_from(compiler, UNBOUNDED, prefix)
    jsonschema.validate(json.loads(document), UNBOUNDED)


def test_the_way_out_is_short(compiler: GrammarCompiler) -> None:
    """Minimal values, not the longest tokens: the empty document's way out is the
    smallest document the schema allows."""
    smallest = '{"name": "", "count": 0, "items": []}'
    assert walk_from(compiler, UNBOUNDED, "") == smallest
    state = compiler.new_state(json.dumps(UNBOUNDED))
    closer = compiler._closer
    assert closer.walk(state.matcher, False, False, limit=10) is None
    tokens = len(byte_level_tokenizer().encode(smallest, add_special_tokens=False))
    assert closer.schema_distance("k", state.matcher, 100) == tokens
    assert closer.schema_distance("k", state.matcher, 20) is None


def test_the_lexer_follows_escapes() -> None:
    closer = BudgetCloser([b'"', b"\\", b"a", b"\\\\"], 4, [])
    assert closer.in_string_after(False, False, [0, 2]) == (True, False)
    assert closer.in_string_after(False, False, [0, 1, 0]) == (True, False)  # "\" stays open
    assert closer.in_string_after(False, False, [0, 3, 0]) == (False, False)  # "\\" closes
    assert closer.in_string_after(False, False, [0, 1]) == (True, True)


def test_a_way_out_the_walk_cannot_find_is_given_up_once(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pattern whose longest-token way out never ends (`ab` for ever, never `c`): the walk
    stops at WALK_LIMIT whatever the budget, and the schema is not walked again."""
    schema = {"type": "object", "properties": {"code": {"type": "string",
                                                        "pattern": "^(ab)*c$"}},
              "required": ["code"], "additionalProperties": False}
    state = compiler.new_state(json.dumps(schema))
    closer = compiler._closer
    assert closer.walk(state.matcher, False, False, limit=10**6) is None
    walks: list[int] = []
    real_walk = closer.walk

    def counted_walk(*args: Any, **kw: Any) -> list[int] | None:
        walks.append(1)
        return real_walk(*args, **kw)

    monkeypatch.setattr(closer, "walk", counted_walk)
    for _ in range(3):
        assert closer.schema_distance("pattern", state.matcher, 10**6) is None
    assert walks == [1]
