"""Assembling a batch's output and error files from its jobs, streamed.

Responsible for: writing one line per request — succeeded jobs to the output file, every
other request to the error file (failed jobs; jobs stopped by a cancel or the completion
window; requests the fan-out never reached, read back from the input file) — then adding
the File rows. Jobs are read a page at a time and lines are written as they come, so a
50,000-request batch costs one page of rows in memory. Nothing is visible until both
files are complete: the rows are added in the caller's transaction together with the
batch's new status.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from scheduler.batch_input import iter_requests
from storage.batch_jobs import iter_batch_jobs
from storage.batch_output import (
    encode_job_line,
    encode_line,
    unfinished_line,
    unstarted_line_id,
)
from storage.batches import Batch
from storage.files import FilePurpose, FileStore, FileWriter, create_file, new_file_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResultFiles:
    """What assembling produced: file ids (None when a file would be empty) and counts."""

    output_file_id: str | None
    error_file_id: str | None
    num_output_bytes: int
    num_error_bytes: int
    num_completed: int
    num_failed: int


def write_result_files(
    session: Session, store: FileStore, batch: Batch, *, stopped_code: str,
    max_line_bytes: int,
) -> ResultFiles:
    """Write both files into the store; requests that never finished get `stopped_code`."""
    output_id, error_id = new_file_id(), new_file_id()
    num_completed = num_failed = 0
    with store.writer(output_id) as output, store.writer(error_id) as errors:
        for row in iter_batch_jobs(session, batch_id=batch.id):
            is_success, line = encode_job_line(row, stopped_code=stopped_code)
            (output if is_success else errors).write(line)
            if is_success:
                num_completed += 1
            else:
                num_failed += 1
        if batch.num_enqueued < batch.num_requests:
            num_failed += _write_unstarted(store, batch, errors, stopped_code=stopped_code,
                                           max_line_bytes=max_line_bytes)
        num_output_bytes = output.commit() if num_completed else 0
        num_error_bytes = errors.commit() if num_failed else 0
    logger.info("batch %s: %d output line(s), %d error line(s)", batch.id, num_completed,
                num_failed)
    return ResultFiles(
        output_file_id=output_id if num_completed else None,
        error_file_id=error_id if num_failed else None,
        num_output_bytes=num_output_bytes, num_error_bytes=num_error_bytes,
        num_completed=num_completed, num_failed=num_failed,
    )


def _write_unstarted(store: FileStore, batch: Batch, errors: FileWriter, *, stopped_code: str,
                     max_line_bytes: int) -> int:
    """Error lines for the requests after the fan-out cursor; returns how many."""
    num_lines = 0
    with store.open(batch.input_file_id) as handle:
        for request in iter_requests(handle, endpoint=batch.endpoint,
                                     max_line_bytes=max_line_bytes,
                                     model_override=batch.model_override,
                                     skip=batch.num_enqueued):
            line_id = unstarted_line_id(batch.id, request.line)
            errors.write(encode_line(unfinished_line(line_id=line_id,
                                                     custom_id=request.custom_id,
                                                     code=stopped_code)))
            num_lines += 1
    return num_lines


def add_result_file_rows(session: Session, batch: Batch, files: ResultFiles) -> None:
    """Add the File rows for committed result files and point the batch at them."""
    for file_id, num_bytes, suffix in (
        (files.output_file_id, files.num_output_bytes, "output"),
        (files.error_file_id, files.num_error_bytes, "error"),
    ):
        if file_id is not None:
            create_file(session, file_id=file_id, tenant_id=batch.tenant_id,
                        filename=f"{batch.id}_{suffix}.jsonl",
                        purpose=FilePurpose.BATCH_OUTPUT.value, num_bytes=num_bytes,
                        expires_after_s=batch.output_expires_after_s)
    batch.output_file_id = files.output_file_id
    batch.error_file_id = files.error_file_id
    batch.num_completed = files.num_completed
    batch.num_failed = files.num_failed
