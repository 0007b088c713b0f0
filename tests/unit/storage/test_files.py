"""The file store streams bytes in and out; file rows page and isolate tenants."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types import FileObject
from sqlalchemy.orm import Session

from storage.files import (
    FileStore,
    FileTooLarge,
    create_file,
    delete_file,
    file_object,
    get_file,
    list_files,
    new_file_id,
)
from storage.models import Tenant


def test_writer_commits_atomically_and_reads_back_in_chunks(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    file_id = new_file_id()
    with store.writer(file_id) as writer:
        for _ in range(10):
            writer.write(b"x" * 1000)
        assert not store.path(file_id).exists()
        assert writer.commit() == 10_000
    assert store.path(file_id).stat().st_size == 10_000
    assert [len(c) for c in store.iter_chunks(file_id, chunk_bytes=4096)] == [4096, 4096, 1808]
    assert list(tmp_path.glob("*.part")) == []


def test_writer_without_commit_leaves_nothing(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with store.writer("file-abc") as writer:
        writer.write(b"partial")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_past_the_limit(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(FileTooLarge), store.writer("file-abc", max_bytes=10) as writer:
        writer.write(b"123456")
        writer.write(b"123456")
    assert list(tmp_path.iterdir()) == []


def test_ids_that_could_escape_the_directory_are_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    for bad in ("../etc/passwd", "file-../../x", "file-a/b", ""):
        with pytest.raises(ValueError, match="not a file id"):
            store.path(bad)


def test_rows_page_by_creation_and_stay_with_their_tenant(session: Session, tenant: Tenant,
                                                          other_tenant: Tenant) -> None:
    ids = [create_file(session, file_id=new_file_id(), tenant_id=tenant.id,
                       filename=f"f{i}.jsonl", purpose="batch", num_bytes=i).id
           for i in range(4)]
    create_file(session, file_id=new_file_id(), tenant_id=other_tenant.id, filename="o",
                purpose="batch", num_bytes=1)
    session.commit()
    newest, has_more = list_files(session, tenant_id=tenant.id, limit=3)
    assert has_more and [r.id for r in newest] == ids[:0:-1]
    rest, has_more = list_files(session, tenant_id=tenant.id, limit=3, after=newest[-1].id)
    assert not has_more and [r.id for r in rest] == ids[:1]
    oldest, _ = list_files(session, tenant_id=tenant.id, limit=2, ascending=True)
    assert [r.id for r in oldest] == ids[:2]
    assert get_file(session, file_id=ids[0], tenant_id=other_tenant.id) is None
    delete_file(session, file_id=ids[0])
    session.commit()
    assert get_file(session, file_id=ids[0]) is None


def test_file_object_is_what_the_openai_client_parses(session: Session, tenant: Tenant) -> None:
    row = create_file(session, file_id=new_file_id(), tenant_id=tenant.id,
                      filename="in.jsonl", purpose="batch", num_bytes=42)
    parsed = FileObject.model_validate(file_object(row))
    assert (parsed.id, parsed.bytes, parsed.purpose, parsed.object) == (
        row.id, 42, "batch", "file")
