"""Delete files past their `expires_at` (OpenAI's `expires_after`).

Responsible for: removing expired files' rows and then their bytes, a bounded chunk per
transaction so a backlog of thousands never holds one long lock. The API already treats
an expired file as gone; this only reclaims the space, so running late is harmless.
A crash between the commit and the byte deletion leaves an orphan file in the store and
no row pointing at it, never a row without its bytes.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from storage.files import FileStore, delete_expired_files
from storage.models import utcnow

logger = logging.getLogger(__name__)

# Rows deleted per transaction.
CHUNK_SIZE = 500


class FileReaper:
    """Deletes expired files, chunk by chunk."""

    def __init__(self, sessions: sessionmaker[Session], store: FileStore, *,
                 interval_s: float, chunk_size: int = CHUNK_SIZE) -> None:
        self.sessions = sessions
        self.store = store
        self.interval_s = interval_s
        self.chunk_size = chunk_size

    def step(self, *, now: datetime | None = None) -> int:
        """Delete every file expired at `now` (default: now); returns how many."""
        now = now or utcnow()
        num_deleted = 0
        while True:
            with self.sessions() as session:
                file_ids = delete_expired_files(session, now=now, limit=self.chunk_size)
                session.commit()
            for file_id in file_ids:
                self.store.delete(file_id)
            num_deleted += len(file_ids)
            if len(file_ids) < self.chunk_size:
                break
        if num_deleted:
            logger.info("deleted %d expired file(s)", num_deleted)
        return num_deleted
