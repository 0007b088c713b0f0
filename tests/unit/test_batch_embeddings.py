"""Batches for `/v1/embeddings`: lines checked as POST /v1/embeddings checks bodies."""

from __future__ import annotations

import io
import json
from typing import Any

from scheduler.batch_input import ENDPOINT_TO_KIND, InputReport, iter_requests, validate_input

EMBEDDINGS = "/v1/embeddings"
MODEL = "minilm"


def line(custom_id: str, **body: Any) -> str:
    """One embeddings request line."""
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS,
                       "body": {"model": MODEL, **body}})


def validate(*lines: str) -> InputReport:
    """validate_input for an embeddings batch of these lines."""
    return validate_input(io.BytesIO(("\n".join(lines) + "\n").encode()), endpoint=EMBEDDINGS,
                          served_models=[MODEL], max_requests=100, max_line_bytes=100_000)


def test_embedding_lines_become_embedding_jobs() -> None:
    """Strings, token ids and base64 lines are valid and fan out as `embedding` jobs."""
    lines = [line("a", input="one"), line("b", input=["x", "y"]),
             line("c", input=[[1, 2, 3]], encoding_format="base64")]
    report = validate(*lines)
    assert (report.is_valid, report.num_requests, report.model) == (True, 3, MODEL)
    assert ENDPOINT_TO_KIND[EMBEDDINGS] == "embedding"
    handle = io.BytesIO(("\n".join(lines) + "\n").encode())
    requests = list(iter_requests(handle, endpoint=EMBEDDINGS, max_line_bytes=100_000))
    assert [r.body["input"] for r in requests] == ["one", ["x", "y"], [[1, 2, 3]]]


def test_bad_embedding_lines_name_their_line_and_field() -> None:
    """Missing, empty or oversized input and a bad encoding are each reported."""
    report = validate(
        line("ok", input="fine"),
        line("missing"),
        line("empty", input=""),
        line("too-many", input=["x"] * 2049),
        line("format", input="x", encoding_format="hex"),
        line("chat", messages=[{"role": "user", "content": "hi"}], input="x"),
    )
    found = {(e["line"], e["param"]) for e in report.errors}
    assert found == {(2, "body.input"), (3, "body.input"), (4, "body.input"),
                     (5, "body.encoding_format"), (6, "body.messages")}
