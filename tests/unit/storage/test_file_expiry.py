"""File expiry: expires_at from expires_after, expired files read as gone, the reaper."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from scheduler.file_expiry import FileReaper
from storage.batches import BatchStatus, create_batch, get_batch
from storage.files import (
    MAX_EXPIRES_AFTER_S,
    MIN_EXPIRES_AFTER_S,
    File,
    FileStore,
    create_file,
    expires_at_for,
    file_object,
    get_file,
    list_files,
    new_file_id,
)
from storage.models import Tenant, utcnow


def add_file(session: Session, tenant: Tenant, store: FileStore | None = None) -> File:
    """A committed file (with bytes when a store is given)."""
    file_id = new_file_id()
    if store is not None:
        with store.writer(file_id) as writer:
            writer.write(b"{}\n")
            writer.commit()
    row = create_file(session, file_id=file_id, tenant_id=tenant.id, filename="f.jsonl",
                      purpose="batch", num_bytes=3)
    session.commit()
    return row


def expire(session: Session, row: File) -> None:
    row.expires_at = utcnow() - timedelta(seconds=1)
    session.commit()


def test_expires_at_counts_from_creation_within_openai_bounds() -> None:
    created_at = datetime(2026, 1, 1, tzinfo=UTC)
    assert expires_at_for(created_at, None) is None
    assert expires_at_for(created_at, MIN_EXPIRES_AFTER_S) == created_at + timedelta(hours=1)
    assert expires_at_for(created_at, MAX_EXPIRES_AFTER_S) == created_at + timedelta(days=30)
    for seconds in (MIN_EXPIRES_AFTER_S - 1, MAX_EXPIRES_AFTER_S + 1, 0, -3600):
        with pytest.raises(ValueError, match="between 3600 and 2592000"):
            expires_at_for(created_at, seconds)


def test_file_object_shows_expires_at(session: Session, tenant: Tenant) -> None:
    row = create_file(session, file_id=new_file_id(), tenant_id=tenant.id, filename="f",
                      purpose="batch", num_bytes=1, expires_after_s=7200)
    obj = file_object(row)
    assert obj["expires_at"] == obj["created_at"] + 7200
    assert file_object(add_file(session, tenant))["expires_at"] is None


def test_an_expired_file_reads_as_gone(session: Session, tenant: Tenant) -> None:
    kept, gone = add_file(session, tenant), add_file(session, tenant)
    expire(session, gone)
    assert get_file(session, file_id=gone.id) is None
    assert get_file(session, file_id=gone.id, include_expired=True) is not None
    rows, _ = list_files(session, tenant_id=tenant.id)
    assert [r.id for r in rows] == [kept.id]


def test_reaper_deletes_rows_and_bytes_in_chunks_but_spares_active_inputs(
        session: Session, sessions: sessionmaker[Session], tenant: Tenant,
        tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files")
    expired = [add_file(session, tenant, store) for _ in range(5)]
    kept = add_file(session, tenant, store)
    for row in expired:
        expire(session, row)
    batch = create_batch(session, tenant_id=tenant.id, input_file_id=expired[0].id,
                         endpoint="/v1/chat/completions", completion_window="24h",
                         expires_at=utcnow() + timedelta(hours=1), priority="low")
    session.commit()
    reaper = FileReaper(sessions, store, interval_s=60, chunk_size=2)

    assert reaper.step() == 4
    session.expire_all()
    remaining = {r.id for r in session.query(File)}
    assert remaining == {expired[0].id, kept.id}
    assert sorted(p.name for p in store.root.iterdir()) == sorted(remaining)

    # Once the batch has finished, its input goes like any other expired file.
    stored = get_batch(session, batch_id=batch.id)
    assert stored is not None
    stored.move_to(BatchStatus.FAILED)
    session.commit()
    assert reaper.step() == 1
    assert not store.path(expired[0].id).exists()
    assert reaper.step() == 0
