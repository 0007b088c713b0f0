"""Uploaded and generated files: the `files` table and the directory holding their bytes.

Responsible for: the File row (OpenAI's file object fields), the local directory store
(one file per id under `settings.files_dir`), and streaming in both directions — bytes are
written and read in chunks, so a 1 GB file is never held in memory. A write lands in
`<id>.part` and is renamed into place only once complete, so a reader never sees half a
file; the row is added after the bytes are in place and removed before they are deleted.
Expiry (OpenAI's `expires_after`): a file past `expires_at` reads as gone at once, and
the scheduler deletes its row and bytes later (`delete_expired_files`), a chunk at a time.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import secrets
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from sqlalchemy import BigInteger, ForeignKey, Index, String, delete, or_, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from core.settings import Settings
from storage.batches import ACTIVE_STATUSES, Batch
from storage.models import Base, UTCDateTime, unix_seconds, utcnow
from storage.pages import keyset_page

logger = logging.getLogger(__name__)

# Large enough to amortise syscalls, small enough that many concurrent streams stay cheap.
CHUNK_BYTES = 1024 * 1024
_FILE_ID = re.compile(r"^file-[A-Za-z0-9]{1,64}$")
# OpenAI's bounds for `expires_after.seconds`: one hour to thirty days.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86400


class FilePurpose(enum.StrEnum):
    """Why a file exists: batch input, or a batch's output/error file."""

    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class File(Base):
    """One stored file; its bytes live in the FileStore under the same id."""

    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_files_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    num_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # None: kept until deleted.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)

    def is_expired(self, now: datetime) -> bool:
        """Whether the file is past its expiry at `now` (then it reads as deleted)."""
        return self.expires_at is not None and self.expires_at <= now


class FileTooLarge(ValueError):
    """A file grew past the configured limit while it was being written."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"file is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


def file_object(row: File) -> dict[str, Any]:
    """The file as OpenAI's API shows it (`openai.types.FileObject`)."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.num_bytes,
        "created_at": int(row.created_at.timestamp()),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": unix_seconds(row.expires_at),
    }


def expires_at_for(created_at: datetime, expires_after_s: int | None) -> datetime | None:
    """When a file created at `created_at` expires; ValueError outside OpenAI's bounds."""
    if expires_after_s is None:
        return None
    if not MIN_EXPIRES_AFTER_S <= expires_after_s <= MAX_EXPIRES_AFTER_S:
        raise ValueError(f"expires_after seconds must be between {MIN_EXPIRES_AFTER_S} and "
                         f"{MAX_EXPIRES_AFTER_S}, got {expires_after_s}")
    return created_at + timedelta(seconds=expires_after_s)


def new_file_id() -> str:
    """A fresh id in OpenAI's style (`file-` + 24 hex digits)."""
    return f"file-{secrets.token_hex(12)}"


class FileWriter:
    """Streams one file's bytes into `<id>.part`; `commit()` moves it into place."""

    def __init__(self, part_path: Path, final_path: Path, *, max_bytes: int | None) -> None:
        self._part_path = part_path
        self._final_path = final_path
        self._max_bytes = max_bytes
        self._handle: BinaryIO | None = part_path.open("wb")
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        """Append `data`; FileTooLarge once the total passes the limit."""
        if self._handle is None:
            raise RuntimeError("write after commit or abort")
        self.num_bytes += len(data)
        if self._max_bytes is not None and self.num_bytes > self._max_bytes:
            raise FileTooLarge(self._max_bytes)
        self._handle.write(data)

    def commit(self) -> int:
        """Flush to disk and rename into place; returns the file's size in bytes.

        A failure (a full disk meets the buffered tail at the flush or the fsync) leaves
        nothing behind: the part file is removed and the error raised.
        """
        if self._handle is None:
            raise RuntimeError("commit after commit or abort")
        try:
            self._handle.flush()
            # The database row that follows must never point at bytes a crash could lose.
            os.fsync(self._handle.fileno())
        except BaseException:
            self.abort()
            raise
        handle, self._handle = self._handle, None
        handle.close()
        try:
            os.replace(self._part_path, self._final_path)
        except BaseException:
            self._part_path.unlink(missing_ok=True)
            raise
        return self.num_bytes

    def abort(self) -> None:
        """Drop what was written; safe to call after commit (then it does nothing).

        Closing flushes the buffer, which fails on a full disk: the part file is removed
        whatever the close says.
        """
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            handle.close()
        except OSError:
            logger.debug("closing %s failed; removing it anyway", self._part_path,
                         exc_info=True)
        finally:
            self._part_path.unlink(missing_ok=True)

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Without an explicit commit, nothing becomes visible.
        self.abort()


class FileStore:
    """The bytes of every file, one per id, in a local directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_settings(cls, settings: Settings) -> FileStore:
        """The store at `settings.files_dir` (default: data_dir/files)."""
        return cls(settings.files_dir or settings.data_dir / "files")

    def path(self, file_id: str) -> Path:
        """Where `file_id`'s bytes live; ValueError for anything not shaped like an id."""
        if not _FILE_ID.match(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def writer(self, file_id: str, *, max_bytes: int | None = None) -> FileWriter:
        """A writer for a new file; use it as a context manager and call `commit()`."""
        final_path = self.path(file_id)
        return FileWriter(final_path.with_name(file_id + ".part"), final_path,
                          max_bytes=max_bytes)

    def open(self, file_id: str) -> BinaryIO:
        """The file opened for binary reading; FileNotFoundError if its bytes are gone."""
        return self.path(file_id).open("rb")

    def iter_chunks(self, file_id: str, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The file's bytes, `chunk_bytes` at a time."""
        with self.open(file_id) as handle:
            while chunk := handle.read(chunk_bytes):
                yield chunk

    def iter_lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines (with their newline), read through a buffer, never all at once."""
        with self.open(file_id) as handle:
            yield from handle

    def delete(self, file_id: str) -> None:
        """Remove the bytes; a file already gone is not an error."""
        self.path(file_id).unlink(missing_ok=True)


def create_file(
    session: Session, *, file_id: str, tenant_id: str, filename: str, purpose: str,
    num_bytes: int, expires_after_s: int | None = None,
) -> File:
    """Add the row for a file whose bytes are already committed to the store.

    `expires_after_s` counts from this row's creation (OpenAI's `created_at` anchor).
    """
    created_at = utcnow()
    row = File(id=file_id, tenant_id=tenant_id, filename=filename, purpose=purpose,
               num_bytes=num_bytes, created_at=created_at,
               expires_at=expires_at_for(created_at, expires_after_s))
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, *, file_id: str, tenant_id: str | None = None,
             include_expired: bool = False) -> File | None:
    """The file, or None if unknown, expired, or owned by another tenant (`tenant_id` given).

    The batch loop passes `include_expired=True`: an active batch's input is never
    deleted by expiry (see `delete_expired_files`), so it may still read it.
    """
    row = session.get(File, file_id)
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        return None
    if not include_expired and row.is_expired(utcnow()):
        return None
    return row


def list_files(
    session: Session, *, tenant_id: str, purpose: str | None = None, limit: int = 10_000,
    after: str | None = None, ascending: bool = False,
) -> tuple[list[File], bool]:
    """One page of the tenant's files by creation time; the bool says whether more follow."""
    query = select(File).where(File.tenant_id == tenant_id,
                               or_(File.expires_at.is_(None), File.expires_at > utcnow()))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    after_key = None
    if after is not None:
        cursor = get_file(session, file_id=after, tenant_id=tenant_id)
        if cursor is None:
            raise ValueError(f"after: no file {after!r}")
        after_key = (cursor.created_at, cursor.id)
    return keyset_page(session, query, created_at=File.created_at, id=File.id, after=after_key,
                       limit=limit, ascending=ascending)


def delete_file(session: Session, *, file_id: str) -> None:
    """Remove the row; the caller deletes the bytes after committing."""
    row = session.get(File, file_id)
    if row is not None:
        session.delete(row)
        session.flush()


def delete_expired_files(session: Session, *, now: datetime, limit: int) -> list[str]:
    """Remove up to `limit` rows of files expired at `now`; returns their ids.

    The input of a batch that has not finished is skipped until the batch ends, as a
    DELETE of it is refused: the batch loop still reads it. `SKIP LOCKED` lets two
    schedulers reap side by side. The caller commits, then deletes the bytes.
    """
    is_in_use = select(Batch.id).where(Batch.input_file_id == File.id,
                                      Batch.status.in_(ACTIVE_STATUSES)).exists()
    query = (
        select(File.id).where(File.expires_at <= now, ~is_in_use)
        .order_by(File.expires_at, File.id).limit(limit)
        .with_for_update(skip_locked=True)
    )
    file_ids = list(session.scalars(query))
    if file_ids:
        session.execute(delete(File).where(File.id.in_(file_ids)))
    return file_ids
