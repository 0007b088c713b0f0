"""A running batch's finished lines, before its output file exists (our extension).

`GET /v1/batches/{batch_id}/output` answers, as JSONL, the output-file line of every
request of the batch that has succeeded so far; `GET /v1/batches/{batch_id}/errors` the
error-file line of every one that failed so far. Both come in input order (the order of
the file's lines) and in exactly the shape the final files will have
(`storage.batch_output`), so a client can read them while the batch runs, and read
again later for more: lines already answered keep their place, new ones fill in between.
Requests still queued or running are left out, as are ones cancelled on their own while
the batch runs (their line's code depends on how the batch ends). The output and error
files written when the batch ends are unchanged; these read the jobs table, a page at a
time, so each call costs a scan of the batch's jobs.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api.deps import ResourcesDep, SessionDep, TenantDep
from api.errors import NotFound
from api.resources import Resources
from storage.batch_jobs import iter_batch_jobs
from storage.batch_output import REQUEST_CANCELLED, encode_job_line
from storage.batches import get_batch
from storage.models import JobStatus

router = APIRouter(tags=["batches"])

JSONL = "application/jsonl"


@router.get("/v1/batches/{batch_id}/output")
def batch_output_so_far(batch_id: str, session: SessionDep, tenant: TenantDep,
                        resources: ResourcesDep) -> StreamingResponse:
    """The output-file lines of the batch's requests that succeeded so far, in input order."""
    return _lines(batch_id, session, tenant.id, resources, status=JobStatus.SUCCEEDED)


@router.get("/v1/batches/{batch_id}/errors")
def batch_errors_so_far(batch_id: str, session: SessionDep, tenant: TenantDep,
                        resources: ResourcesDep) -> StreamingResponse:
    """The error-file lines of the batch's requests that failed so far, in input order."""
    return _lines(batch_id, session, tenant.id, resources, status=JobStatus.FAILED)


def _lines(batch_id: str, session: SessionDep, tenant_id: str, resources: Resources, *,
           status: JobStatus) -> StreamingResponse:
    batch = get_batch(session, batch_id=batch_id, tenant_id=tenant_id)
    if batch is None:
        raise NotFound(f"No such batch: '{batch_id}'.", param="batch_id")
    return StreamingResponse(_read(resources, batch_id, status), media_type=JSONL,
                             headers={"X-Batch-Status": batch.status.value})


def _read(resources: Resources, batch_id: str, status: JobStatus) -> Iterator[bytes]:
    """The lines, a page of jobs per query, in a session of their own (the route's ends
    when it returns, before the body is sent)."""
    with resources.sessions() as session:
        for row in iter_batch_jobs(session, batch_id=batch_id):
            if row.status is status:
                yield encode_job_line(row, stopped_code=REQUEST_CANCELLED)[1]
