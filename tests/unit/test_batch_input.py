"""Batch input validation: every error case names its line; valid files parse in order."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import scheduler.batch_input as batch_input_module
from core.model_context import ModelContexts
from scheduler.batch_input import (
    MAX_REPORTED_ERRORS,
    InputReport,
    iter_lines,
    iter_requests,
    validate_input,
)
from tests.unit.api.hostile_cases import (
    CHAT_ONLY_STRICT_CASES,
    CHAT_TEXT_CASES,
    LONE,
    PROMPT_TEXT_CASES,
    STRICT_CASES,
)
from tests.unit.engine.tiny_models import save_tokenizer

CHAT = "/v1/chat/completions"
MODEL = "tiny"


def request(custom_id: str | None = "r1", **overrides: Any) -> dict[str, Any]:
    """One valid chat request line as a dict."""
    item: dict[str, Any] = {
        "custom_id": custom_id, "method": "POST", "url": CHAT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 2},
    }
    if custom_id is None:
        del item["custom_id"]
    item.update(overrides)
    return item


def jsonl(*items: dict[str, Any] | str) -> io.BytesIO:
    """A file of lines: dicts are JSON-encoded, strings written as they are."""
    lines = [item if isinstance(item, str) else json.dumps(item) for item in items]
    return io.BytesIO(("\n".join(lines) + "\n").encode())


def validate(handle: io.BytesIO, **overrides: Any) -> InputReport:
    """validate_input with test defaults."""
    options: dict[str, Any] = {"endpoint": CHAT, "served_models": [MODEL], "max_requests": 100,
                               "max_line_bytes": 10_000}
    options.update(overrides)
    return validate_input(handle, **options)


def codes_and_lines(report: InputReport) -> list[tuple[str, int | None]]:
    """(code, line) per reported error."""
    return [(e["code"], e["line"]) for e in report.errors]


def test_valid_file_counts_requests_and_finds_the_model() -> None:
    report = validate(jsonl(request("a"), request("b"), "", request("c")))
    assert report.is_valid
    assert report.num_requests == 3
    assert report.model == MODEL


def test_malformed_json_names_its_line() -> None:
    report = validate(jsonl(request("a"), '{"custom_id": "b", ', request("c"), "[1, 2]"))
    assert codes_and_lines(report) == [("invalid_json_line", 2), ("invalid_json_line", 4)]


def test_missing_and_empty_custom_id() -> None:
    report = validate(jsonl(request(None), request("")))
    assert codes_and_lines(report) == [("missing_custom_id", 1), ("missing_custom_id", 2)]
    assert report.errors[0]["param"] == "custom_id"


def test_duplicate_custom_id_names_both_lines() -> None:
    report = validate(jsonl(request("a"), request("b"), request("a")))
    assert codes_and_lines(report) == [("duplicate_custom_id", 3)]
    assert "line 1" in report.errors[0]["message"]


def test_url_other_than_the_endpoint() -> None:
    report = validate(jsonl(request("a"), request("b", url="/v1/completions")))
    assert codes_and_lines(report) == [("invalid_url", 2)]


def test_method_other_than_post() -> None:
    report = validate(jsonl(request("a", method="GET")))
    assert codes_and_lines(report) == [("invalid_method", 1)]


def test_more_than_one_model() -> None:
    other = request("b")
    other["body"]["model"] = "other"
    report = validate(jsonl(request("a"), other), served_models=[MODEL, "other"])
    assert codes_and_lines(report) == [("mismatched_model", 2)]
    assert "line 1" in report.errors[0]["message"]


def test_unknown_model_is_reported_once() -> None:
    items = [request(str(i)) for i in range(3)]
    for item in items:
        item["body"]["model"] = "gpt-4o-mini"
    report = validate(jsonl(*items))
    assert codes_and_lines(report) == [("model_not_found", 1)]


def test_model_override_replaces_each_lines_model() -> None:
    item = request("a")
    item["body"]["model"] = "gpt-4o-mini"
    report = validate(jsonl(item), model_override=MODEL)
    assert report.is_valid and report.model == MODEL
    [parsed] = iter_requests(jsonl(item), endpoint=CHAT, max_line_bytes=10_000,
                             model_override=MODEL)
    assert parsed.body["model"] == MODEL


def test_text_content_parts_are_joined_for_the_worker() -> None:
    item = request("a")
    item["body"]["messages"] = [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    [parsed] = iter_requests(jsonl(item), endpoint=CHAT, max_line_bytes=10_000)
    assert parsed.body["messages"] == [{"role": "user", "content": "one\ntwo"}]


def test_stream_true_is_refused() -> None:
    item = request("a")
    item["body"]["stream"] = True
    report = validate(jsonl(request("x"), item))
    assert codes_and_lines(report) == [("invalid_stream", 2)]
    assert report.errors[0]["param"] == "body.stream"


def test_body_must_match_the_endpoint() -> None:
    report = validate(jsonl(request("a", body={"model": MODEL, "prompt": "hi"})))
    assert codes_and_lines(report) == [("missing_required_parameter", 1)]
    completions = request("b", url="/v1/completions", body={"model": MODEL, "messages": []})
    report = validate(jsonl(completions), endpoint="/v1/completions")
    assert codes_and_lines(report) == [("missing_required_parameter", 1)]


def test_more_requests_than_the_limit() -> None:
    report = validate(jsonl(*(request(str(i)) for i in range(5))), max_requests=3)
    assert codes_and_lines(report) == [("too_many_requests", 4)]


def test_line_over_the_byte_limit_is_skipped_not_loaded() -> None:
    long_item = request("b")
    long_item["body"]["messages"][0]["content"] = "x" * 5000
    report = validate(jsonl(request("a"), long_item, request("c")), max_line_bytes=1000)
    assert codes_and_lines(report) == [("line_too_long", 2)]
    # The line after the long one is still read as its own line.
    assert report.num_requests == 2


def test_empty_file() -> None:
    report = validate(io.BytesIO(b"\n\n"))
    assert codes_and_lines(report) == [("empty_file", None)]


def test_errors_are_capped_but_all_counted() -> None:
    report = validate(jsonl(*(["not json"] * (MAX_REPORTED_ERRORS + 5))), max_requests=1000)
    assert len(report.errors) == MAX_REPORTED_ERRORS
    assert report.num_errors == MAX_REPORTED_ERRORS + 5


def test_iter_lines_numbers_physical_lines() -> None:
    lines = list(iter_lines(io.BytesIO(b"a\n\nbbbbbbbb\nc"), max_line_bytes=4))
    assert lines == [(1, b"a\n"), (2, b"\n"), (3, None), (4, b"c")]


def test_iter_requests_resumes_after_skip_with_line_numbers() -> None:
    handle = jsonl(request("a"), "", request("b"), request("c"))
    parsed = list(iter_requests(handle, endpoint=CHAT, max_line_bytes=10_000, skip=1))
    assert [(r.custom_id, r.line) for r in parsed] == [("b", 3), ("c", 4)]


def test_iter_requests_refuses_an_unvalidated_long_line() -> None:
    with pytest.raises(ValueError, match="line 1"):
        list(iter_requests(io.BytesIO(b"x" * 50), endpoint=CHAT, max_line_bytes=10))


def assert_line_refused(report: InputReport, *, line: int, param: str) -> dict[str, Any]:
    """Exactly one error, on `line`, naming `param`; storable as UTF-8 JSON."""
    assert [(e["line"], e["param"]) for e in report.errors] == [(line, param)], report.errors
    json.dumps(report.errors, ensure_ascii=False).encode("utf-8")
    error: dict[str, Any] = report.errors[0]
    assert error["message"].startswith(f"line {line}")
    return error


@pytest.mark.parametrize(("patch", "param"), CHAT_TEXT_CASES + STRICT_CASES
                         + CHAT_ONLY_STRICT_CASES)
def test_chat_lines_get_the_checks_of_the_api(patch: dict[str, Any], param: str) -> None:
    """The API's hostile cases, as batch lines: refused at validation, the line named."""
    bad = request("bad")
    bad["body"] |= patch
    report = validate(jsonl(request("ok"), bad))
    assert_line_refused(report, line=2, param=f"body.{param}")


@pytest.mark.parametrize(("patch", "param"), PROMPT_TEXT_CASES + [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "logprobs": "0"}, "logprobs"),
])
def test_completion_lines_get_the_checks_of_the_api(patch: dict[str, Any], param: str) -> None:
    """Text lines too, on the /v1/completions endpoint."""
    line = request("c", url="/v1/completions", body={"model": MODEL} | patch)
    report = validate(jsonl(line), endpoint="/v1/completions")
    assert_line_refused(report, line=1, param=f"body.{param}")


def test_robot_role_and_negative_max_tokens_fail_validation() -> None:
    """Both once ran up to the worker; now the batch fails with both lines named."""
    robot = request("a")
    robot["body"]["messages"] = [{"role": "robot", "content": "beep"}]
    negative = request("b")
    negative["body"]["max_tokens"] = -1
    report = validate(jsonl(robot, negative, request("c")))
    assert [(e["line"], e["param"], e["code"]) for e in report.errors] == [
        (1, "body.messages[0].role", "invalid_value"), (2, "body.max_tokens", "invalid_value")]


def refusals(handle: io.BytesIO, *, endpoint: str = CHAT, models_dir: Path | None = None
             ) -> list[dict[str, Any] | None]:
    """Each request's refusal as fan-out sees it (None: it goes to a worker)."""
    return [r.error for r in iter_requests(handle, endpoint=endpoint, max_line_bytes=10_000,
                                           check_bodies=True, models_dir=models_dir)]


@pytest.mark.parametrize(("endpoint", "patch", "param"), [
    (CHAT, {"n": 129}, "n"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools[0]"),
    (CHAT, {"logit_bias": {"a": 1}}, "logit_bias"),
    (CHAT, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
])
def test_lines_the_api_would_refuse_fail_alone_with_its_answer(
    endpoint: str, patch: dict[str, Any], param: str,
) -> None:
    """Well-formed but unsupported: not a batch error; the line carries the API's 400."""
    body = {"model": MODEL, "max_tokens": 2} | patch
    if endpoint == CHAT and "messages" not in patch:
        body["messages"] = [{"role": "user", "content": "hi"}]
    bad = request("bad", url=endpoint, body=body)
    assert validate(jsonl(bad), endpoint=endpoint).is_valid
    [error] = refusals(jsonl(bad), endpoint=endpoint)
    assert error is not None
    assert (error["param"], error["status_code"], error["type"]) == (
        param, 400, "invalid_request_error")


def test_a_refused_lines_body_is_kept_storable_and_valid_lines_are_joined() -> None:
    """Fan-out gets the worker's body for a good line and an escaped one for a refused line."""
    good = request("a")
    good["body"]["messages"] = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                             {"type": "text", "text": "y"}]}]
    bad = request("b", body=request()["body"] | {"n": 129, "user": "caf\u00e9"})
    [ok, refused] = list(iter_requests(jsonl(good, bad), endpoint=CHAT, max_line_bytes=10_000,
                                       check_bodies=True))
    assert ok.error is None and ok.body["messages"][0]["content"] == "x\ny"
    assert refused.error is not None and refused.error["param"] == "n"
    json.dumps(refused.body, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("custom_id", [LONE, "a\x00b"])
def test_custom_id_must_be_valid_text(custom_id: str) -> None:
    """A surrogate or NUL in custom_id: the line is refused, the error can be stored."""
    report = validate(jsonl(request("ok"), request(custom_id)))
    assert codes_and_lines(report) == [("invalid_custom_id", 2)]
    assert_line_refused(report, line=2, param="custom_id")


def test_unserved_model_with_bad_text_is_named_safely() -> None:
    """A surrogate in the model name is reported (escaped) as an unknown model."""
    item = request("a")
    item["body"]["model"] = LONE
    report = validate(jsonl(item))
    error = assert_line_refused(report, line=1, param="body.model")
    assert "\\ud800" in error["message"]


def test_lines_are_checked_against_the_models_context(tmp_path: Path) -> None:
    """With models_dir, max_tokens and prompt length are refused as the API refuses them."""
    model_dir = tmp_path / MODEL
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"max_position_embeddings": 32}')
    save_tokenizer(model_dir)
    too_many = request("a")
    too_many["body"]["max_tokens"] = 10**9
    too_long = request("b")
    too_long["body"]["messages"][0]["content"] = "the quick brown fox " * 20
    lines = (request("ok"), too_many, too_long)
    assert validate(jsonl(*lines)).is_valid  # well-formed: no batch error
    ok, many, long = refusals(jsonl(*lines), models_dir=tmp_path)
    assert ok is None
    assert many is not None and (many["param"], many["code"]) == ("max_tokens", "invalid_value")
    assert long is not None
    assert (long["param"], long["code"]) == ("messages", "context_length_exceeded")
    assert refusals(jsonl(*lines)) == [None, None, None]  # the model is not on this machine


def test_a_model_not_on_this_machine_is_looked_up_once_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A miss is not cached by ModelContexts: without a per-file memo every line of a
    10,000-line embeddings batch stat'ed the disk again."""
    lookups: list[str] = []
    real_find = batch_input_module.model_contexts(tmp_path).get

    def counting_get(name: str, **kwargs: Any) -> Any:
        lookups.append(name)
        return real_find(name, **kwargs)

    monkeypatch.setattr(ModelContexts, "get", lambda self, name, **kw: counting_get(name, **kw))
    lines = [request(f"r{i}") for i in range(50)]
    assert refusals(jsonl(*lines), models_dir=tmp_path) == [None] * 50
    assert lookups == [MODEL]


def test_a_line_whose_check_fails_unexpectedly_fails_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A defect met while checking one line (here a RecursionError) refuses that line with
    a server error; the batch and its other lines go on."""
    import scheduler.batch_line_checks as checks

    real_check = checks.check_request

    def check(request: Any, context: Any) -> None:
        if request.user == "deep":
            raise RecursionError("maximum recursion depth exceeded")
        real_check(request, context)

    monkeypatch.setattr(checks, "check_request", check)
    deep = request("deep", body=request()["body"] | {"user": "deep"})
    assert validate(jsonl(request("a"), deep, request("c"))).is_valid
    [first, refused, last] = refusals(jsonl(request("a"), deep, request("c")))
    assert first is None and last is None
    assert refused is not None
    assert (refused["status_code"], refused["type"], refused["code"]) == (
        500, "server_error", "request_not_checked")
    assert "RecursionError" in refused["message"]
