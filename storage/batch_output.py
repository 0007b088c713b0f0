"""Lines of a batch's output and error files, in OpenAI's format.

Every request of a batch ends as exactly one line, in one of the two files:

    {"id": "batch_req_…", "custom_id": "…",
     "response": {"status_code": 200, "request_id": "job_…", "body": {chat.completion}},
     "error": null}

A request that ran and failed keeps `response` (its status code and an OpenAI error body);
a request that never ran — the batch expired or was cancelled first — has `response: null`
and `error: {code, message}`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from storage.batch_jobs import BatchJobRow
from storage.models import JobStatus

BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"
# A job of a running batch cancelled on its own (POST /v1/jobs/{id}/cancel).
REQUEST_CANCELLED = "request_cancelled"
_UNFINISHED_MESSAGES = {
    BATCH_EXPIRED: "This request could not be executed before the completion window expired.",
    BATCH_CANCELLED: "This request was not executed because the batch was cancelled.",
    REQUEST_CANCELLED: "This request was cancelled before it finished.",
}


def request_line_id(job_id: str) -> str:
    """The line's `id`: `batch_req_` + the job id's random part."""
    return "batch_req_" + job_id.removeprefix("job_")


def unstarted_line_id(batch_id: str, line: int) -> str:
    """A stable `id` for a request that never became a job."""
    digest = hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}"


def success_line(row: BatchJobRow) -> dict[str, Any]:
    """The output-file line of a succeeded job."""
    return {
        "id": request_line_id(row.job_id),
        "custom_id": row.custom_id,
        "response": {"status_code": 200, "request_id": row.job_id, "body": row.result},
        "error": None,
    }


def failure_line(row: BatchJobRow) -> dict[str, Any]:
    """The error-file line of a job that ran and failed."""
    error = dict(row.error or {})
    status_code = error.pop("status_code", None)
    if not isinstance(status_code, int):
        # Workers store the API's error object: a request problem is a 400, else a 500.
        status_code = 400 if error.get("type") == "invalid_request_error" else 500
    body = {
        "error": {
            "message": str(error.get("message") or "the request failed"),
            "type": error.get("type") or ("invalid_request_error" if status_code < 500
                                         else "server_error"),
            "param": error.get("param"),
            "code": error.get("code"),
        }
    }
    return {
        "id": request_line_id(row.job_id),
        "custom_id": row.custom_id,
        "response": {"status_code": status_code, "request_id": row.job_id, "body": body},
        "error": None,
    }


def unfinished_line(*, line_id: str, custom_id: str, code: str) -> dict[str, Any]:
    """The error-file line of a request the batch stopped before it finished."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": _UNFINISHED_MESSAGES[code]},
    }


def job_line(row: BatchJobRow, *, stopped_code: str) -> tuple[bool, dict[str, Any]]:
    """(is_success, line) for a job; a cancelled job gets `stopped_code` as its error."""
    if row.status == JobStatus.SUCCEEDED:
        return True, success_line(row)
    if row.status == JobStatus.FAILED:
        return False, failure_line(row)
    return False, unfinished_line(line_id=request_line_id(row.job_id), custom_id=row.custom_id,
                                  code=stopped_code)


def encode_job_line(row: BatchJobRow, *, stopped_code: str) -> tuple[bool, bytes]:
    """`job_line` encoded; a succeeded job's stored result JSON (`row.result_json`) is copied
    into the line as it is rather than decoded and encoded again."""
    if row.status != JobStatus.SUCCEEDED or row.result_json is None:
        is_success, line = job_line(row, stopped_code=stopped_code)
        return is_success, encode_line(line)
    head = encode_line({"id": request_line_id(row.job_id), "custom_id": row.custom_id})
    request_id = json.dumps(row.job_id)
    return True, (head[:-2] + f',"response":{{"status_code":200,"request_id":{request_id},'
                  f'"body":{row.result_json}}},"error":null}}\n'.encode())


def encode_line(item: dict[str, Any]) -> bytes:
    """One JSONL line, newline included."""
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
