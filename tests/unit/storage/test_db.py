"""Engines and the UTC datetime column type on SQLite."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session

from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.models import ApiKey, Base, Tenant


def test_sqlite_file_gets_wal_foreign_keys_busy_timeout_and_its_directory(
    tmp_path: Path,
) -> None:
    path = tmp_path / "nested" / "dir" / "x.db"
    engine = create_db_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
        assert path.parent.is_dir()
    finally:
        engine.dispose()


def test_foreign_keys_are_enforced(engine: sqlalchemy.Engine) -> None:
    with session_factory(engine)() as session:
        session.add(ApiKey(id="key_1", tenant_id="ten_missing", key_hash="0" * 64, prefix="bi_x"))
        with pytest.raises(IntegrityError):
            session.flush()


def test_in_memory_database_is_shared_by_sessions() -> None:
    engine = create_db_engine("sqlite://")
    try:
        Base.metadata.create_all(engine)
        sessions = session_factory(engine)
        with sessions() as session:
            session.add(Tenant(id="ten_1", name="a"))
            session.commit()
        with sessions() as session:
            assert session.get(Tenant, "ten_1") is not None
    finally:
        engine.dispose()


def test_bad_url_is_explained() -> None:
    with pytest.raises(ValueError, match="invalid database URL 'not a url'"):
        create_db_engine("not a url")


def test_datetimes_come_back_aware_utc_and_naive_ones_are_refused(session: Session) -> None:
    plus_two = timezone(timedelta(hours=2))
    created = datetime(2025, 3, 1, 14, 30, tzinfo=plus_two)
    session.add(Tenant(id="ten_1", name="a", created_at=created))
    session.commit()
    session.expire_all()
    tenant = session.get(Tenant, "ten_1")
    assert tenant is not None
    assert tenant.created_at == created
    assert tenant.created_at.utcoffset() == timedelta(0)
    assert tenant.created_at.hour == 12
    stored = session.execute(text("SELECT created_at FROM tenants")).scalar()
    assert str(stored).startswith("2025-03-01 12:30:00")

    session.add(Tenant(id="ten_2", name="b", created_at=datetime(2025, 1, 1)))
    with pytest.raises(StatementError, match="naive datetime"):
        session.flush()


def test_json_columns_keep_floats_non_ascii_and_lone_surrogates(
    session: Session, tenant: Tenant
) -> None:
    """The JSON codec (orjson, the standard library for what UTF-8 cannot hold) gives back
    exactly what was stored: floats bit for bit, non-Latin text, and a lone surrogate that
    a free-form request field can carry."""
    from storage.jobs import create_job, get_job

    floats = [0.1, -1.2345678901234567, 1e-300, 3.4028234663852886e38, 0.0]
    plain = {"input": "日本語 café 🚀", "v": floats}
    odd = {**plain, "extra": {"odd": "x\ud800y"}}
    ids = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                      kind="embedding", request=request).id for request in (plain, odd)]
    session.commit()
    session.expunge_all()
    for job_id, request in zip(ids, (plain, odd), strict=True):
        stored = get_job(session, job_id=job_id)
        assert stored is not None and stored.request == request
    raw = [session.execute(text("SELECT request FROM jobs WHERE id = :id"),
                           {"id": job_id}).scalar_one() for job_id in ids]
    assert "日本語" in raw[0]  # written as UTF-8 by orjson
    assert "\\ud800" in raw[1]  # escaped by the standard library, which can


def test_float32_arrays_are_written_as_their_shortest_floats_by_both_codecs(
    session: Session, tenant: Tenant
) -> None:
    """An embedding result's vector goes in as a float32 array: stored as a JSON list of
    each float32's shortest decimal form, which reads back as the same float32s, whether
    orjson writes the row or (a lone surrogate beside it) the standard library does."""
    from storage.jobs import create_job, get_job
    from workers.inference.embedding_jobs import float32_values

    vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    vector[:4] = [0.1, -0.0, 1e-40, 3.4e38]
    results = [{"data": [{"embedding": vector}]},
               {"data": [{"embedding": vector}], "odd": "x\ud800y"}]
    ids = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                      kind="embedding", request={"input": "x"}).id for _ in results]
    for job_id, result in zip(ids, results, strict=True):
        get_job(session, job_id=job_id).result = result  # type: ignore[union-attr]
    session.commit()
    session.expunge_all()
    for job_id in ids:
        raw = session.execute(text("SELECT result FROM jobs WHERE id = :id"),
                              {"id": job_id}).scalar_one()
        assert raw.count("0.1,") >= 1 and "0.10000000149011612" not in raw
        stored = get_job(session, job_id=job_id)
        assert stored is not None and stored.result is not None
        floats = stored.result["data"][0]["embedding"]
        assert floats == float32_values(vector)
        assert np.array_equal(np.array(floats, dtype=np.float32), vector)


def _connects_over_two_rounds(engine: sqlalchemy.Engine, concurrent: int) -> int:
    """New database connections opened by two rounds of `concurrent` checkouts at once."""
    opened = []
    sqlalchemy.event.listen(engine, "connect", lambda *_: opened.append(1))
    for _ in range(2):
        held = [engine.connect() for _ in range(concurrent)]
        for connection in held:
            connection.close()
    engine.dispose()
    return len(opened)


def test_a_pool_as_large_as_the_concurrency_reuses_its_connections(tmp_path: Path) -> None:
    # The API's thread pool queries from many threads at once: connections beyond the
    # pool are opened (pragmas and all) and closed again per use.
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    assert _connects_over_two_rounds(create_db_engine(url, pool_size=12), 12) == 12
    assert _connects_over_two_rounds(create_db_engine(url), 12) > 12  # SQLAlchemy's 5
    assert Settings().db_pool_size >= 32  # the API's concurrency in the benchmarks
