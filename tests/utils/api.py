"""Factories for API tests: tenants with keys, auth headers, and a recording producer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import KafkaTimeoutError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from storage.models import Job, Tenant
from storage.tenants import create_api_key, create_tenant

CHAT_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
    "temperature": 0,
}


@dataclass(frozen=True, slots=True)
class TenantKey:
    """A committed tenant and the plaintext of one of its API keys."""

    tenant_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header for this key."""
        return {"Authorization": f"Bearer {self.key}"}


def committed_tenant(sessions: sessionmaker[Session], name: str = "acme") -> Tenant:
    """A tenant created and committed in a session of its own."""
    with sessions() as session:
        tenant = create_tenant(session, name=name)
        session.commit()
        return tenant


def make_tenant_key(sessions: sessionmaker[Session], name: str) -> TenantKey:
    """Create a tenant called `name` with one API key, committed."""
    with sessions() as session:
        tenant = create_tenant(session, name=name)
        _, key = create_api_key(session, tenant_id=tenant.id)
        session.commit()
        return TenantKey(tenant_id=tenant.id, key=key)


def count_jobs(sessions: sessionmaker[Session]) -> int:
    """How many job rows the database holds."""
    with sessions() as session:
        return session.scalar(select(func.count(Job.id))) or 0


class _Acked:
    """A send that the 'broker' acknowledged at once."""

    def get(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""
        return None


@dataclass
class RecordingProducer:
    """Stands in for the Kafka producer in tests that assert nothing about Kafka.

    Implements what the API uses of the producer handle (`get()`, `unavailable_reason`,
    `is_refusing`, `accepting()`, `close()`) and of the producer (`send(topic, key=,
    value=)` returning a future with `get(timeout)`).
    """

    records: list[tuple[str, bytes | None, bytes | None]] = field(default_factory=list)
    is_down: bool = False

    def get(self) -> RecordingProducer:
        """The producer itself (the handle's connect step)."""
        return self

    @property
    def unavailable_reason(self) -> str | None:
        """Why sends are refused, as the handle says it (readiness checks read it)."""
        return "broker unreachable (test)" if self.is_down else None

    @property
    def is_refusing(self) -> bool:
        """Whether jobs are refused for a stop (never here)."""
        return False

    @contextmanager
    def accepting(self) -> Iterator[str | None]:
        """Jobs are always accepted here (a stop is tested against the real handle)."""
        yield None

    def send(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> _Acked:
        """Record one record, or fail as an unreachable broker would."""
        if self.is_down:
            raise KafkaTimeoutError("broker unreachable (test)")
        self.records.append((topic, key, value))
        return _Acked()

    def close(self) -> None:
        """Nothing to close."""
