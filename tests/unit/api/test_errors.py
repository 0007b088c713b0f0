"""The error shape: field names from pydantic locations, messages a user can act on."""

from __future__ import annotations

import json

import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.errors import (
    RateLimited,
    ServiceUnavailable,
    error_body,
    install_error_handlers,
    param_from_loc,
    validation_error,
)


def test_param_names_nested_fields_and_indexes() -> None:
    """Locations become OpenAI-style parameter paths."""
    assert param_from_loc(("body", "temperature")) == "temperature"
    assert param_from_loc(("body", "messages", 0, "content")) == "messages[0].content"
    assert param_from_loc(("query", "limit")) == "limit"
    assert param_from_loc(("body",)) is None


def test_union_member_tags_are_not_fields() -> None:
    """Pydantic's union member names are dropped from the path."""
    loc = ("body", "messages", 1, "content", "list[ContentPart]", 0, "type")
    assert param_from_loc(loc) == "messages[1].content[0].type"
    assert param_from_loc(("body", "messages", 0, "content", "str")) == "messages[0].content"


def test_missing_and_unknown_fields_read_like_openai() -> None:
    """Missing and unknown parameters get OpenAI's wording and codes."""
    missing = validation_error([{"type": "missing", "loc": ("body", "model"), "msg": "x"}])
    assert (missing.status_code, missing.param, missing.code) == (
        400, "model", "missing_required_parameter")
    assert missing.message == "Missing required parameter: 'model'."
    extra = validation_error([{"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "x"}])
    assert (extra.param, extra.code) == ("foo", "unknown_parameter")


def test_union_messages_are_merged_for_one_field() -> None:
    """Each union member's complaint about the same field is kept once."""
    errors = [
        {"type": "string_type", "loc": ("body", "x", "str"), "msg": "Input should be a string"},
        {"type": "list_type", "loc": ("body", "x", "list[str]"), "msg": "Input should be a list"},
    ]
    error = validation_error(errors)
    assert error.message == (
        "Invalid value for 'x': Input should be a string; or Input should be a list.")


def test_invalid_json_is_a_400() -> None:
    """A body that is not JSON is a bad request, not a field error."""
    error = validation_error([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode",
                               "ctx": {"error": "Expecting value"}}])
    assert (error.status_code, error.code) == (400, "invalid_json")


def test_retry_after_is_whole_seconds_and_never_zero() -> None:
    """429 and 503 tell clients how long to wait, rounded up."""
    assert RateLimited("slow down", retry_after_s=0.2).headers["Retry-After"] == "1"
    assert RateLimited("slow down", retry_after_s=2.5).headers["Retry-After"] == "3"
    unavailable = ServiceUnavailable("message broker")
    assert unavailable.status_code == 503
    assert "message broker" in unavailable.message
    assert unavailable.to_response().headers["Retry-After"] == "1"


def test_a_value_the_database_refuses_is_400_not_500() -> None:
    """PostgreSQL refuses a NUL in text (DataError): the request's fault, answered as such."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/nul")
    def nul() -> None:
        raise sqlalchemy.exc.DataError("SELECT 1", {}, ValueError("NUL (0x00) bytes"))

    response = TestClient(app, raise_server_exceptions=False).get("/nul")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_value"
    assert "NUL" in response.json()["error"]["message"]


def test_error_bodies_escape_text_utf8_cannot_carry() -> None:
    """A lone surrogate quoted in an error is sent as its escape, so the error is sent."""
    body = error_body("unknown field 'x\ud800y'", param="x\ud800y")
    assert body["error"]["param"] == "x\\ud800y"
    assert body["error"]["message"] == "unknown field 'x\\ud800y'"
    json.dumps(body, ensure_ascii=False).encode("utf-8")
