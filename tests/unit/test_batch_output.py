"""Output and error file lines follow OpenAI's batch line format."""

from __future__ import annotations

import json

from storage.batch_jobs import BatchJobRow
from storage.batch_output import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    encode_job_line,
    encode_line,
    job_line,
    unfinished_line,
    unstarted_line_id,
)
from storage.models import JobStatus

COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}


def row(status: JobStatus, **overrides: object) -> BatchJobRow:
    """A job row with test defaults."""
    values: dict[str, object] = {"job_id": "job_abc", "custom_id": "req-7", "status": status,
                                 "result": None, "error": None}
    values.update(overrides)
    return BatchJobRow(**values)  # type: ignore[arg-type]


def test_success_line_wraps_the_completion() -> None:
    is_success, line = job_line(row(JobStatus.SUCCEEDED, result=COMPLETION),
                                stopped_code=BATCH_CANCELLED)
    assert is_success
    assert line == {
        "id": "batch_req_abc", "custom_id": "req-7",
        "response": {"status_code": 200, "request_id": "job_abc", "body": COMPLETION},
        "error": None,
    }


def test_failure_line_keeps_the_status_code_and_an_openai_error_body() -> None:
    error = {"status_code": 400, "message": "max_tokens too large", "param": "max_tokens",
             "code": "invalid_value"}
    is_success, line = job_line(row(JobStatus.FAILED, error=error), stopped_code=BATCH_EXPIRED)
    assert not is_success
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"] == {"error": {
        "message": "max_tokens too large", "type": "invalid_request_error",
        "param": "max_tokens", "code": "invalid_value"}}
    assert line["error"] is None and line["custom_id"] == "req-7"


def test_failure_without_a_status_code_is_a_server_error() -> None:
    _, line = job_line(row(JobStatus.FAILED, error={"message": "engine crashed"}),
                       stopped_code=BATCH_EXPIRED)
    assert line["response"]["status_code"] == 500
    assert line["response"]["body"]["error"]["type"] == "server_error"


def test_worker_error_objects_map_to_status_codes_by_type() -> None:
    error = {"message": "messages[0].content must be a string", "type": "invalid_request_error",
             "param": "messages", "code": None}
    _, line = job_line(row(JobStatus.FAILED, error=error), stopped_code=BATCH_EXPIRED)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"] == error


def test_unfinished_jobs_get_the_stop_reason() -> None:
    for status in (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLED):
        is_success, line = job_line(row(status), stopped_code=BATCH_EXPIRED)
        assert not is_success
        assert line["response"] is None
        assert line["error"]["code"] == BATCH_EXPIRED
        assert line["id"] == "batch_req_abc"


def test_unstarted_line_ids_are_stable_and_distinct() -> None:
    first = unstarted_line_id("batch_1", 3)
    assert first == unstarted_line_id("batch_1", 3)
    assert first != unstarted_line_id("batch_1", 4)
    line = unfinished_line(line_id=first, custom_id="x", code=BATCH_CANCELLED)
    assert line["error"]["code"] == "batch_cancelled"


def test_encoded_line_is_one_json_line() -> None:
    raw = encode_line({"custom_id": "é\nx", "n": 1})
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert json.loads(raw) == {"custom_id": "é\nx", "n": 1}


def test_a_stored_result_is_copied_into_its_line_as_the_same_json() -> None:
    """The result's JSON text goes into the line undecoded; the line reads back exactly as
    the one built from the decoded result, custom ids with quotes and newlines included."""
    for custom_id in ("req-7", 'say "hi"\nthere é'):
        stored = row(JobStatus.SUCCEEDED, custom_id=custom_id,
                     result_json=json.dumps(COMPLETION))
        decoded = row(JobStatus.SUCCEEDED, custom_id=custom_id, result=COMPLETION)
        is_success, raw = encode_job_line(stored, stopped_code=BATCH_EXPIRED)
        assert is_success and raw.endswith(b"\n") and raw.count(b"\n") == 1
        assert json.loads(raw) == job_line(decoded, stopped_code=BATCH_EXPIRED)[1]
    failed = row(JobStatus.FAILED, error={"message": "bad"}, result_json=None)
    assert encode_job_line(failed, stopped_code=BATCH_EXPIRED) == (
        False, encode_line(job_line(failed, stopped_code=BATCH_EXPIRED)[1]))
