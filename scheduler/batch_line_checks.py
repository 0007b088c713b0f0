"""A batch line's body checked as the API checks a request: its shape, then what it asks for.

Two verdicts, as OpenAI's Batch API gives them:
- a body that does not match the endpoint's request schema (a wrong type, an unknown role
  or field, `max_tokens: -1`, text that is not valid Unicode) is a malformed line: the
  batch fails at validation with the line and field named (`check_shape`), as it does for
  a line that is not JSON;
- a well-formed request this deployment will not run (several choices, tools, a prompt and
  `max_tokens` longer than the model's context) fails on its own: its job is stored failed,
  with the status and error body `POST /v1/jobs` would answer (`refusal`), shows in the
  batch's error file, and never reaches a worker. The other lines run.

The rules are the API's own (`core.requests`, `core.request_checks`), so a line and a
request with the same body get the same answer.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from core.embedding_requests import EmbeddingRequest
from core.model_context import ModelContext
from core.request_checks import RequestRefused, check_request, describe_errors, parse_body
from core.requests import printable
from core.responses_api import ECHOED_INSTRUCTIONS, as_responses_refusal

logger = logging.getLogger(__name__)


def check_shape(body: dict[str, Any], *, kind: str) -> None:
    """RequestRefused (status 400) naming the first field of `body` that fails the schema."""
    body = _as_chat(body, kind)
    if kind == "embedding":
        try:
            EmbeddingRequest.model_validate(body)
        except ValidationError as e:
            param, message, code = describe_errors(e.errors(include_url=False))
            raise RequestRefused(message, param=param, code=code) from e
        return
    try:
        parse_body(body, is_chat=kind in ("chat.completion", "response"))
    except RequestRefused as e:
        raise as_responses_refusal(e) if kind == "response" else e from None


def refusal(body: dict[str, Any], *, kind: str, context: ModelContext | None
            ) -> dict[str, Any] | None:
    """The stored error of a line the API would refuse (None: it may run).

    The error is OpenAI's error object plus the `status_code` the API would answer; a
    body that fails the schema here too (a file validated by an older release) is refused
    the same way rather than sent to a worker.
    """
    if kind == "embedding":
        return None  # the embedding worker checks inputs against its own model
    body = _as_chat(body, kind)
    try:
        request = parse_body(body, is_chat=kind in ("chat.completion", "response"))
        check_request(request, context)
    except RequestRefused as e:
        return (as_responses_refusal(e) if kind == "response" else e).error_object()
    except Exception as e:  # noqa: BLE001 - one line's defect must not fail the whole batch
        logger.exception("a batch line could not be checked")
        return {"message": f"the request could not be checked: {type(e).__name__}: {e}",
                "type": "server_error", "param": None, "code": "request_not_checked",
                "status_code": 500}
    return None


def _as_chat(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The chat request a line's body runs as: a Responses line keeps its `instructions`
    beside it only for the `response` to echo (its system message runs them)."""
    if kind == "response" and ECHOED_INSTRUCTIONS in body:
        return {k: v for k, v in body.items() if k != ECHOED_INSTRUCTIONS}
    return body


def storable(value: Any) -> Any:
    """`value` with every string (and key) escaped where UTF-8 cannot carry it.

    A refused line's body is kept on its failed job; its text may be what was refused.
    """
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value
