"""OpenAI-compatible Files API: upload (streamed), list, retrieve, download, delete.

The objects and field names are OpenAI's (`openai.types.FileObject`, `FileDeleted`), so
the official client works unchanged. Uploads are parsed as they arrive and written to the
file store chunk by chunk (api.uploads); downloads stream from an open handle. Neither
direction holds a file in memory. A full store answers 507 and any other failure of it
503, with nothing of the upload left behind; a download's name goes out per RFC 6266.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Iterator
from typing import Annotated, Any, BinaryIO, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api.deps import ResourcesDep, SessionDep, SettingsDep, TenantDep
from api.errors import (
    SERVER_ERROR,
    APIError,
    Conflict,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    validation_error,
)
from api.pagination import invalid_cursor, list_page
from api.resources import Resources
from api.schemas import ExpiresAfter
from api.uploads import DEFAULT_FILENAME, UploadError, read_multipart
from storage.batches import is_file_in_use
from storage.files import (
    CHUNK_BYTES,
    File,
    FilePurpose,
    FileStore,
    FileTooLarge,
    create_file,
    delete_file,
    file_object,
    get_file,
    list_files,
    new_file_id,
)

logger = logging.getLogger(__name__)

router = APIRouter(tags=["files"])

# OpenAI's bounds for `GET /v1/files?limit=`.
MAX_LIST_LIMIT = 10_000
# How the official client flattens `expires_after={anchor, seconds}` into form fields.
EXPIRES_AFTER_FIELDS = {"anchor": "expires_after[anchor]", "seconds": "expires_after[seconds]"}


class InsufficientStorage(APIError):
    """507: the file store has no room for the upload; nothing of it was kept."""

    status_code = 507
    type = SERVER_ERROR
    code = "insufficient_storage"


class FileTooLargeError(APIError):
    """413: the upload passed `max_file_bytes`."""

    status_code = 413
    code = "file_too_large"


@router.post("/v1/files")
async def upload_file(request: Request, tenant: TenantDep, settings: SettingsDep,
                      resources: ResourcesDep) -> dict[str, Any]:
    """Store a `purpose=batch` file sent as multipart/form-data; returns the file object.

    An optional `expires_after[anchor]=created_at` and `expires_after[seconds]` make the
    file expire (read as deleted) that long after its creation.
    """
    file_id = new_file_id()
    try:
        store = FileStore.from_settings(settings)
        with store.writer(file_id, max_bytes=settings.max_file_bytes) as writer:
            try:
                form = await read_multipart(request.headers.get("content-type"),
                                            request.stream(), writer)
            except UploadError as e:
                raise InvalidRequest(str(e), param=e.param, code="invalid_upload") from e
            except FileTooLarge as e:
                raise FileTooLargeError(
                    f"The file is larger than {settings.max_file_bytes} bytes, the most "
                    "this deployment accepts.", param="file") from e
            except ClientDisconnect as e:
                raise InvalidRequest("The upload was interrupted.",
                                     code="upload_interrupted") from e
            purpose = form.fields.get("purpose")
            if purpose != FilePurpose.BATCH.value:
                raise InvalidRequest(f"purpose must be 'batch' (the only one served here), "
                                     f"got {purpose!r}.", param="purpose", code="invalid_value")
            expires_after = _expires_after(form.fields)
            expires_after_s = expires_after.seconds if expires_after else None
            num_bytes = await run_in_threadpool(writer.commit)
    except OSError as e:  # the writer removed its part file on the way out
        raise storage_error(e) from e
    filename = form.filename or DEFAULT_FILENAME
    try:
        return await run_in_threadpool(_add_row, resources, file_id=file_id,
                                       tenant_id=tenant.id, filename=filename,
                                       num_bytes=num_bytes,
                                       expires_after_s=expires_after_s)
    except BaseException:
        store.delete(file_id)
        raise


def storage_error(error: OSError) -> APIError:
    """507 when the file store is out of space (or quota), 503 for any other failure of it.

    The client is told which; the path and the system's words stay in the log.
    """
    logger.warning("file store failed: %s", error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage("The file store is full; the upload was not kept. Retry "
                                   "later or with a smaller file.", param="file")
    return ServiceUnavailable("file store")


def _expires_after(fields: dict[str, str]) -> ExpiresAfter | None:
    """The form's `expires_after[...]` fields as a policy, or one `expires_after` field
    holding it as a JSON object (as a hand-written curl sends it); 400 naming the bad one.
    """
    values: Any = {key: fields[name] for key, name in EXPIRES_AFTER_FIELDS.items()
                   if name in fields}
    if "expires_after" in fields:
        if values:
            raise InvalidRequest("Send expires_after either as expires_after[anchor] and "
                                 "expires_after[seconds] or as one JSON object, not both.",
                                 param="expires_after", code="invalid_value")
        try:
            values = json.loads(fields["expires_after"])
        except ValueError as e:
            raise InvalidRequest('expires_after must be a JSON object such as {"anchor": '
                                 '"created_at", "seconds": 3600}.', param="expires_after",
                                 code="invalid_value") from e
    elif not values:
        return None
    # Sent, it is checked even as {} or null: a file kept for good is not what a client
    # that sent a policy asked for.
    try:
        return ExpiresAfter.model_validate(values)
    except ValidationError as e:
        raise validation_error([{**error, "loc": ("body", "expires_after", *error["loc"])}
                                for error in e.errors()]) from e


def _add_row(resources: Resources, *, file_id: str, tenant_id: str, filename: str,
             num_bytes: int, expires_after_s: int | None) -> dict[str, Any]:
    with resources.sessions() as session:
        row = create_file(session, file_id=file_id, tenant_id=tenant_id, filename=filename,
                          purpose=FilePurpose.BATCH.value, num_bytes=num_bytes,
                          expires_after_s=expires_after_s)
        session.commit()
        logger.info("stored %s (%d bytes) for tenant %s", file_id, num_bytes, tenant_id)
        return file_object(row)


@router.get("/v1/files")
def list_tenant_files(
    session: SessionDep, tenant: TenantDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = MAX_LIST_LIMIT,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict[str, Any]:
    """The tenant's files, newest first by default, with cursor pagination."""
    try:
        rows, has_more = list_files(session, tenant_id=tenant.id, purpose=purpose, limit=limit,
                                    after=after, ascending=order == "asc")
    except ValueError as e:
        raise invalid_cursor(e) from e
    return list_page([file_object(row) for row in rows], has_more=has_more)


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
    """One file object."""
    return file_object(_owned_file(session, tenant.id, file_id))


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, session: SessionDep, tenant: TenantDep,
                 settings: SettingsDep) -> StreamingResponse:
    """The file's bytes, streamed."""
    row = _owned_file(session, tenant.id, file_id)
    try:
        # Opened now, so a delete racing the download cannot cut it short.
        handle = FileStore.from_settings(settings).open(row.id)
    except FileNotFoundError as e:
        raise NotFound(f"The content of file '{file_id}' is no longer available.",
                       param="file_id") from e
    except OSError as e:
        raise storage_error(e) from e
    headers = {"Content-Length": str(row.num_bytes),
               "Content-Disposition": content_disposition(row.filename)}
    return StreamingResponse(_chunks(handle), media_type="application/octet-stream",
                             headers=headers)


def _chunks(handle: BinaryIO) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


@router.delete("/v1/files/{file_id}")
def remove_file(file_id: str, session: SessionDep, tenant: TenantDep,
                settings: SettingsDep) -> dict[str, Any]:
    """Delete a file; 409 while a batch that has not finished reads it."""
    row = _owned_file(session, tenant.id, file_id)
    if is_file_in_use(session, file_id=row.id):
        raise Conflict(f"File '{file_id}' is the input of a batch that has not finished; "
                       "cancel the batch or wait for it first.", param="file_id",
                       code="file_in_use")
    delete_file(session, file_id=row.id)
    session.commit()
    FileStore.from_settings(settings).delete(row.id)
    return {"id": row.id, "object": "file", "deleted": True}


def _owned_file(session: SessionDep, tenant_id: str, file_id: str) -> File:
    row = get_file(session, file_id=file_id, tenant_id=tenant_id)
    if row is None:
        raise NotFound(f"No such file: '{file_id}'.", param="file_id")
    return row


def content_disposition(filename: str) -> str:
    """`attachment` with the filename as RFC 6266 gives it: a plain ASCII `filename`
    (anything else, quotes and backslashes as `_`) and the exact name UTF-8 and
    percent-encoded in `filename*`. Every byte is a valid header byte, whatever the
    stored name holds (rows from before names were checked may hold control characters).
    """
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
    encoded = quote(filename, safe="", errors="backslashreplace")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"
