"""OpenAI-compatible Batches API: create, retrieve (or wait for its end), list (cursor
pages), cancel.

A created batch starts `validating`; the batch loop (scheduler.batches) validates its
file, fans it out into low-priority jobs and moves it on, so every call here is a few
small queries. The objects are OpenAI's (`openai.types.Batch`), plus `priority`. With an
`Idempotency-Key`, creating again with the same key and body answers with the first batch
(`Idempotent-Replayed: true`), so a client that retries after a timeout does not run the
file twice; the same key with another body is a 409.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError

from api.batch_state import batch_view, wait_for_batch
from api.capabilities import check_model
from api.deadlines import check_attainable
from api.deps import (
    IdempotencyKeyDep,
    RedisDep,
    ResourcesDep,
    SessionDep,
    SettingsDep,
    TenantDep,
    WaitQuery,
    long_poll_s,
    resources_of,
)
from api.errors import Conflict, InvalidParameter, InvalidRequest, NotFound
from api.model_states import refuse_if_failed
from api.pagination import invalid_cursor, list_page
from api.schemas import CallbackUrl, ExpiresAfter, Metadata
from api.submission import json_hash
from core.deadlines import check_window
from core.json_bounds import json_bounds_error
from core.topics import Priority
from core.webhook_urls import validate_callback_url
from storage.batches import (
    Batch,
    IllegalBatchTransition,
    batch_object,
    completion_window_seconds,
    create_batch,
    find_batch_by_idempotency_key,
    list_batches,
    request_cancel,
)
from storage.events import publish_batches_wake
from storage.files import FilePurpose, FileStore, get_file
from storage.models import utcnow

logger = logging.getLogger(__name__)

router = APIRouter(tags=["batches"])

MAX_LIST_LIMIT = 100
# The metadata key that may carry a batch's webhook URL (OpenAI clients cannot send ours).
CALLBACK_METADATA_KEY = "callback_url"


class BatchCreate(BaseModel):
    """Body of `POST /v1/batches`: OpenAI's fields plus `priority`, `model`, `callback_url`."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=40)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                      "/v1/responses"]
    completion_window: str = Field(min_length=2, max_length=16)
    metadata: Metadata | None = None
    # The output and error files expire this long after each is written.
    output_expires_after: ExpiresAfter | None = None
    priority: Priority = Priority.LOW
    # Runs every request on this model, whatever each line names.
    model: str | None = Field(default=None, min_length=1, max_length=200)
    callback_url: CallbackUrl | None = None
    # When the backlog and the fleet cannot finish it within its window: `refuse` (409
    # deadline_unattainable with the estimate, the default) or `accept` as best effort.
    on_unattainable: Literal["refuse", "accept"] | None = None


@router.post("/v1/batches")
def create(body: BatchCreate, session: SessionDep, tenant: TenantDep,
           settings: SettingsDep, redis_client: RedisDep,
           resources: ResourcesDep, response: Response,
           idempotency_key: IdempotencyKeyDep = None) -> dict[str, Any]:
    """Create a batch from an uploaded `purpose=batch` file (once per Idempotency-Key)."""
    digest = None
    if idempotency_key is not None:
        # Defaults included: a field written out at its default is the same body.
        digest = json_hash(body.model_dump(mode="json", exclude_none=True))
        earlier = find_batch_by_idempotency_key(session, tenant_id=tenant.id,
                                                key=idempotency_key)
        if earlier is not None:
            return _replayed(earlier, digest, idempotency_key, response)
    file = get_file(session, file_id=body.input_file_id, tenant_id=tenant.id)
    if file is None:
        raise NotFound(f"No such file: '{body.input_file_id}'.", param="input_file_id")
    if file.purpose != FilePurpose.BATCH.value:
        raise InvalidRequest(f"File '{file.id}' has purpose '{file.purpose}'; a batch reads "
                             "a file uploaded with purpose 'batch'.", param="input_file_id",
                             code="invalid_file")
    try:
        window_s = completion_window_seconds(body.completion_window)
        # Any window from a minute to seven days; the configured ones (tests add seconds)
        # are accepted as they are.
        if body.completion_window not in settings.batch_completion_windows:
            check_window(window_s, what="completion_window")
    except ValueError as e:
        raise InvalidRequest(f"{e}.", param="completion_window", code="invalid_value") from e
    if body.model is not None:
        check_model(body.model, settings.served_models)
        refuse_if_failed(redis_client, settings, body.model)
    callback_url = body.callback_url or (body.metadata or {}).get(CALLBACK_METADATA_KEY)
    if callback_url is not None:
        try:
            validate_callback_url(callback_url, settings)
        except ValueError as e:
            # Named where the client put it: the field, or the metadata key.
            where = ("callback_url" if body.callback_url
                     else f"metadata.{CALLBACK_METADATA_KEY}")
            raise InvalidParameter(str(e), param=where) from e
    if body.on_unattainable != "accept":
        num_lines, model = _lines_and_model(FileStore.from_settings(settings), file.id)
        model = body.model or model
        if model is not None and num_lines:
            check_attainable(resources.estimates, model=model, priority=body.priority.value,
                             deadline=utcnow() + timedelta(seconds=window_s),
                             num_jobs=num_lines, on_unattainable=body.on_unattainable,
                             what="completion_window")
    now = utcnow()
    try:
        # The key's unique index answers at create_batch's flush, or at the commit.
        batch = create_batch(
            session, tenant_id=tenant.id, input_file_id=file.id, endpoint=body.endpoint,
            completion_window=body.completion_window,
            expires_at=now + timedelta(seconds=window_s), priority=body.priority.value,
            metadata=body.metadata, model_override=body.model, callback_url=callback_url,
            output_expires_after_s=(body.output_expires_after.seconds
                                    if body.output_expires_after else None),
            idempotency_key=idempotency_key, request_hash=digest,
        )
        session.commit()
    except IntegrityError:
        # A concurrent request with the same key created it first.
        session.rollback()
        if idempotency_key is None or digest is None:
            raise
        earlier = find_batch_by_idempotency_key(session, tenant_id=tenant.id,
                                                key=idempotency_key)
        if earlier is None:
            raise
        return _replayed(earlier, digest, idempotency_key, response)
    publish_batches_wake(redis_client, prefix=settings.topic_prefix, batch_id=batch.id)
    logger.info("batch %s created from %s for tenant %s", batch.id, file.id, tenant.id)
    return batch_object(batch)


def _replayed(earlier: Batch, digest: str, key: str, response: Response) -> dict[str, Any]:
    """The batch an earlier request with this key created; 409 for another body."""
    if earlier.request_hash != digest:
        raise Conflict(f"Idempotency-Key {key!r} was already used with a different request "
                       "body; use a new key for a new batch.", param="Idempotency-Key",
                       code="idempotency_key_reused")
    response.headers["Idempotent-Replayed"] = "true"
    return batch_object(earlier)


def _lines_and_model(files: FileStore, file_id: str) -> tuple[int, str | None]:
    """Requests in a batch file (its lines) and the model its first line names, for the
    deadline check; validation proper happens later (scheduler.batch_input)."""
    num_lines, model, last, first_line = 0, None, b"\n", b""
    try:
        for chunk in files.iter_chunks(file_id):
            if not first_line:
                first_line = chunk.split(b"\n", 1)[0]
            num_lines += chunk.count(b"\n")
            last = chunk[-1:] or last
    except OSError:
        return 0, None  # its bytes are gone: validation fails the batch
    num_lines += last != b"\n"  # a last line without its newline
    if json_bounds_error(first_line) is not None:
        return num_lines, None  # nested past the bound: validation reports its line
    try:
        first = json.loads(first_line)
        named = first.get("body", {}).get("model") if isinstance(first, dict) else None
        model = named if isinstance(named, str) else None
    except (ValueError, AttributeError, RecursionError):
        model = None  # validation reports it
    return num_lines, model


@router.get("/v1/batches/{batch_id}")
async def retrieve(
    batch_id: str,
    request: Request,
    tenant: TenantDep,
    wait: WaitQuery = 0,
) -> dict[str, Any]:
    """One batch object; with `wait`, held open until the batch ends or `wait` seconds
    pass (our extension: OpenAI's clients poll)."""
    resources = resources_of(request)
    batch = await wait_for_batch(resources, batch_id=batch_id, tenant_id=tenant.id,
                                 timeout=long_poll_s(resources, wait))
    if batch is None:
        raise NotFound(f"No such batch: '{batch_id}'.", param="batch_id")
    return batch


@router.get("/v1/batches")
def list_tenant_batches(
    session: SessionDep, tenant: TenantDep, resources: ResourcesDep, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
) -> dict[str, Any]:
    """The tenant's batches, newest first, with cursor pagination; those in progress carry
    their `estimated_completion_at` (the batch CLI's ETA column)."""
    try:
        rows, has_more = list_batches(session, tenant_id=tenant.id, limit=limit, after=after)
    except ValueError as e:
        raise invalid_cursor(e) from e
    return list_page([batch_view(resources, session, row) for row in rows], has_more=has_more)


@router.post("/v1/batches/{batch_id}/cancel")
def cancel(batch_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep,
           redis_client: RedisDep) -> dict[str, Any]:
    """Start cancelling: queued requests never run, running ones are aborted."""
    try:
        batch = request_cancel(session, batch_id=batch_id, tenant_id=tenant.id)
    except IllegalBatchTransition as e:
        raise Conflict(f"Batch '{batch_id}' is {e.old.value} and can no longer be cancelled.",
                       param="batch_id", code="batch_not_cancellable") from e
    if batch is None:
        raise NotFound(f"No such batch: '{batch_id}'.", param="batch_id")
    session.commit()
    publish_batches_wake(redis_client, prefix=settings.topic_prefix, batch_id=batch.id)
    return batch_object(batch)
