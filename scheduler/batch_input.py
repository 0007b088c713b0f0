"""Streaming validation and parsing of a batch input file (OpenAI's JSONL request format).

Responsible for: reading lines with a bounded buffer (a line longer than the limit is
reported, never held whole), checking each line — JSON object within the nesting and
size bounds of `core.json_bounds` (checked before it is parsed), `custom_id` present,
valid text and unique, `method` POST, `url` equal to the batch endpoint, a `body` object
without `stream: true`, one known model across the file, at most `max_requests` lines,
and a body of the endpoint's request schema (the API's own: types, ranges, roles, valid
text) — and collecting errors with their line numbers in OpenAI's `errors.data` shape.
A well-formed line the API would still refuse (unsupported, longer than the model's
context) is not a batch error: `iter_requests(check_bodies=True)` hands it over with its
refusal, and its job fails alone (see `scheduler.batch_line_checks`). The validator
keeps only a 16-byte digest per custom_id, so 50,000 requests cost a few MB whatever the
file's size. Blank lines are skipped by both validation and fan-out, so request counts
agree between the two passes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from pydantic_core import PydanticCustomError

from core.json_bounds import json_bounds_error
from core.model_context import ModelContext, model_contexts
from core.request_checks import RequestRefused
from core.requests import check_key, printable
from core.responses_api import ECHOED_INSTRUCTIONS, to_chat_body
from scheduler.batch_line_checks import check_shape, refusal, storable

# Errors kept per batch: enough to fix a file, bounded however broken the file is.
MAX_REPORTED_ERRORS = 100
# The endpoints a batch may target, and the job kind each produces.
ENDPOINT_TO_KIND = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
                    "/v1/embeddings": "embedding", "/v1/responses": "response"}
# Kinds whose lines run as chat requests (a Responses body is turned into one when read).
CHAT_KINDS = ("chat.completion", "response")


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One valid input line: what becomes a job.

    `error` is set when the API would refuse the request (see `scheduler.batch_line_checks`):
    its job is stored failed with it and never sent to a worker.
    """

    line: int
    custom_id: str
    model: str
    body: dict[str, Any]
    error: dict[str, Any] | None = None


class InputLineError(ValueError):
    """One input line that cannot become a request."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def input_error(code: str, message: str, *, line: int | None, param: str | None = None
                ) -> dict[str, Any]:
    """One entry of OpenAI's `errors.data` (client text in it escaped, so it can be stored)."""
    return {"code": code, "line": line, "message": printable(message),
            "param": None if param is None else printable(param)}


def iter_lines(handle: BinaryIO, *, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, content) per line; content None for a line over the limit.

    Reads with `readline(limit)`, so an over-long line is skipped piece by piece rather
    than loaded.
    """
    number = 0
    while True:
        chunk = handle.readline(max_line_bytes + 1)
        if not chunk:
            return
        number += 1
        if len(chunk) <= max_line_bytes or chunk.endswith(b"\n"):
            yield number, chunk
            continue
        while chunk and not chunk.endswith(b"\n"):
            chunk = handle.readline(max_line_bytes + 1)
        yield number, None


def parse_request(raw: bytes, *, line: int, endpoint: str, model_override: str | None,
                  join_content: bool = True) -> BatchRequest:
    """Parse one non-blank line; InputLineError naming what is wrong.

    `join_content` joins chat content parts into one string, as the worker takes them;
    validation keeps them apart so that an error can name the part.
    """
    too_complex = json_bounds_error(raw)
    if too_complex is not None:
        raise InputLineError("invalid_json_line", f"line {line}: {too_complex}")
    try:
        item = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputLineError("invalid_json_line",
                             f"line {line} is not valid JSON: {e}") from e
    if not isinstance(item, dict):
        raise InputLineError("invalid_json_line", f"line {line} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputLineError("missing_custom_id",
                             f"line {line} has no custom_id (a non-empty string)",
                             param="custom_id")
    try:
        check_key(custom_id)
    except PydanticCustomError as e:
        raise InputLineError("invalid_custom_id", f"line {line}: custom_id {e.message()}",
                             param="custom_id") from e
    method = item.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        raise InputLineError("invalid_method",
                             f"line {line}: method must be POST, got {method!r}", param="method")
    if item.get("url") != endpoint:
        raise InputLineError(
            "invalid_url",
            f"line {line}: url {item.get('url')!r} differs from the batch endpoint {endpoint!r}",
            param="url",
        )
    body = item.get("body")
    if not isinstance(body, dict):
        raise InputLineError("invalid_body", f"line {line}: body must be a JSON object",
                             param="body")
    if body.get("stream"):
        raise InputLineError("invalid_stream",
                             f"line {line}: stream: true is not supported in a batch",
                             param="body.stream")
    if ENDPOINT_TO_KIND.get(endpoint) == "response":
        try:
            chat = to_chat_body(body)
        except RequestRefused as e:
            raise InputLineError(e.code, f"line {line}: {e.message}",
                                 param=f"body.{e.param}" if e.param else "body") from e
        if isinstance(body.get("instructions"), str):
            chat[ECHOED_INSTRUCTIONS] = body["instructions"]  # as the API's own route keeps it
        body = chat
    if ENDPOINT_TO_KIND.get(endpoint) in CHAT_KINDS:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise InputLineError("missing_required_parameter",
                                 f"line {line}: body.messages must be a non-empty list",
                                 param="body.messages")
        if join_content:
            body = _joined_body(body)
    elif ENDPOINT_TO_KIND.get(endpoint) == "embedding":
        if "input" not in body:
            raise InputLineError("missing_required_parameter",
                                 f"line {line}: body.input is missing", param="body.input")
    elif "prompt" not in body:
        raise InputLineError("missing_required_parameter", f"line {line}: body.prompt is missing",
                             param="body.prompt")
    model = model_override or body.get("model")
    if not isinstance(model, str) or not model:
        raise InputLineError("missing_required_parameter", f"line {line}: body.model is missing",
                             param="body.model")
    if model_override:
        body = {**body, "model": model_override}
    return BatchRequest(line=line, custom_id=custom_id, model=model, body=body)


def _joined_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body whose messages' text content parts are joined, as the worker takes them."""
    return {**body, "messages": [_joined_content(m) for m in body["messages"]]}


def _joined_content(message: object) -> object:
    """A message whose text content parts are joined into one string (as the API does)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        return message  # the worker refuses non-text parts, as a per-request error
    return {**message, "content": "\n".join(str(p.get("text") or "") for p in parts)}


@dataclass(slots=True)
class InputReport:
    """What validation found: the request count and model, or the errors."""

    num_requests: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_errors: int = 0

    @property
    def is_valid(self) -> bool:
        """True when the batch may be fanned out."""
        return self.num_errors == 0


class InputValidator:
    """Checks a file line by line; `finish()` returns the InputReport."""

    def __init__(self, *, endpoint: str, served_models: Iterable[str], max_requests: int,
                 model_override: str | None = None) -> None:
        self.endpoint = endpoint
        self.served_models = frozenset(served_models)
        self.max_requests = max_requests
        self.model_override = model_override
        self.report = InputReport()
        # custom_id digest → the line that first used it.
        self._digest_to_line: dict[bytes, int] = {}
        self._model_line: int | None = None

    def add_error(self, code: str, message: str, *, line: int | None,
                  param: str | None = None) -> None:
        """Record an error (only the first MAX_REPORTED_ERRORS are kept, all are counted)."""
        self.report.num_errors += 1
        if len(self.report.errors) < MAX_REPORTED_ERRORS:
            self.report.errors.append(input_error(code, message, line=line, param=param))

    def feed(self, line: int, raw: bytes | None, *, max_line_bytes: int) -> None:
        """Check one line (None: longer than `max_line_bytes`)."""
        if raw is None:
            self.add_error("line_too_long", f"line {line} is longer than {max_line_bytes} bytes",
                           line=line)
            return
        if not raw.strip():
            return
        self.report.num_requests += 1
        if self.report.num_requests == self.max_requests + 1:
            self.add_error("too_many_requests",
                           f"line {line}: a batch holds at most {self.max_requests} requests",
                           line=line)
        try:
            request = parse_request(raw, line=line, endpoint=self.endpoint,
                                    model_override=self.model_override, join_content=False)
        except InputLineError as e:
            self.add_error(e.code, str(e), line=line, param=e.param)
            return
        self._check_custom_id(request)
        self._check_model(request)
        if request.model in self.served_models:
            try:
                check_shape(request.body, kind=ENDPOINT_TO_KIND[self.endpoint])
            except RequestRefused as e:
                self.add_error(e.code, f"line {line}: {e.message}", line=line,
                               param=f"body.{e.param}" if e.param else "body")

    def _check_custom_id(self, request: BatchRequest) -> None:
        digest = hashlib.blake2b(request.custom_id.encode(), digest_size=16).digest()
        first_line = self._digest_to_line.setdefault(digest, request.line)
        if first_line != request.line:
            self.add_error("duplicate_custom_id",
                           f"line {request.line}: custom_id {request.custom_id!r} "
                           f"is already used on line {first_line}",
                           line=request.line, param="custom_id")

    def _check_model(self, request: BatchRequest) -> None:
        if self.report.model is None:
            self.report.model, self._model_line = request.model, request.line
            if request.model not in self.served_models:
                self.add_error("model_not_found",
                               f"line {request.line}: model {request.model!r} is not served "
                               f"here; use one of {', '.join(sorted(self.served_models))}",
                               line=request.line, param="body.model")
        elif request.model != self.report.model:
            self.add_error("mismatched_model",
                           f"line {request.line}: model {request.model!r} differs from "
                           f"{self.report.model!r} on line {self._model_line}; "
                           "a batch uses one model",
                           line=request.line, param="body.model")

    def finish(self) -> InputReport:
        """The report; an empty file is an error too."""
        if self.report.num_requests == 0 and self.report.num_errors == 0:
            self.add_error("empty_file", "the input file holds no requests", line=None)
        return self.report


def validate_input(handle: BinaryIO, *, endpoint: str, served_models: Iterable[str],
                   max_requests: int, max_line_bytes: int,
                   model_override: str | None = None) -> InputReport:
    """Read the whole file once and report what is wrong with it, line by line."""
    validator = InputValidator(endpoint=endpoint, served_models=served_models,
                               max_requests=max_requests, model_override=model_override)
    for line, raw in iter_lines(handle, max_line_bytes=max_line_bytes):
        validator.feed(line, raw, max_line_bytes=max_line_bytes)
    return validator.finish()


def iter_requests(handle: BinaryIO, *, endpoint: str, max_line_bytes: int,
                  model_override: str | None = None, skip: int = 0,
                  check_bodies: bool = False, models_dir: Path | None = None
                  ) -> Iterator[BatchRequest]:
    """The requests of a validated file in order, after the first `skip` of them.

    With `check_bodies`, each carries the API's refusal of it, if any (`error`), checked
    against the model's context where `models_dir` holds the model.
    """
    contexts = model_contexts(Path(models_dir)) if models_dir is not None else None
    # Looked up once per model for the whole file: a model with no directory here (an
    # embedding model carried by its package, one served from a worker's own path) is
    # never cached by `ModelContexts`, and looking again stat'ed the disk for every line.
    context_of: dict[str, ModelContext | None] = {}
    index = 0
    for line, raw in iter_lines(handle, max_line_bytes=max_line_bytes):
        if raw is None:
            raise ValueError(f"line {line} is over the limit: validate the file first")
        if not raw.strip():
            continue
        index += 1
        if index <= skip:
            continue
        if not check_bodies:
            yield parse_request(raw, line=line, endpoint=endpoint, model_override=model_override)
            continue
        request = parse_request(raw, line=line, endpoint=endpoint,
                                model_override=model_override, join_content=False)
        if request.model not in context_of:
            context_of[request.model] = (contexts.get(request.model) if contexts is not None
                                         else None)
        error = refusal(request.body, kind=ENDPOINT_TO_KIND[endpoint],
                        context=context_of[request.model])
        if error is not None:
            yield replace(request, body=storable(request.body), error=error)
        elif ENDPOINT_TO_KIND[endpoint] in CHAT_KINDS:
            yield replace(request, body=_joined_body(request.body))
        else:
            yield request
