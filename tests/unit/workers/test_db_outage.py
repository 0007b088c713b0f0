"""Which database errors a worker waits out, and the pace of its tries."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from core import metrics
from workers.inference.db_outage import DatabaseOutage, is_outage


def error_of(url: str, *statements: str, **connect_args: object) -> SQLAlchemyError:
    """The error SQLAlchemy raises running `statements` on a database at `url`."""
    engine = sa.create_engine(url, connect_args=connect_args)
    try:
        with engine.begin() as connection:
            for statement in statements:
                connection.execute(sa.text(statement))
    except SQLAlchemyError as e:
        return e
    finally:
        engine.dispose()
    raise AssertionError(f"no error from {statements} on {url}")


def unreachable_error() -> SQLAlchemyError:
    """What SQLAlchemy raises for a PostgreSQL that does not answer (nothing listens)."""
    return error_of("postgresql+psycopg://u:p@127.0.0.1:9/db", connect_timeout=2)


def constraint_error() -> SQLAlchemyError:
    """What SQLite raises for a duplicate primary key: a fault of the statement."""
    return error_of("sqlite://", "CREATE TABLE t (id INTEGER PRIMARY KEY)",
                    "INSERT INTO t VALUES (1)", "INSERT INTO t VALUES (1)")


def test_unreachable_is_an_outage_and_a_constraint_is_not() -> None:
    assert isinstance(unreachable_error(), OperationalError)
    assert is_outage(unreachable_error())
    assert isinstance(constraint_error(), IntegrityError)
    assert not is_outage(constraint_error())


def test_tries_back_off_while_away_and_reset_once_it_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outage = DatabaseOutage(first_retry_s=0.5, max_retry_s=2.0, clock=lambda: now[0])
    errors_before = metrics.WORKER_DATABASE_ERRORS._value.get()
    assert not outage.is_away and outage.may_try()
    error = unreachable_error()
    with caplog.at_level(logging.INFO, logger="workers.inference.db_outage"):
        waits: list[float] = []
        for _ in range(4):
            outage.failed(error, doing="storing results")
            started = now[0]
            assert outage.is_away and not outage.may_try()
            while not outage.may_try():
                now[0] += 0.25
            waits.append(now[0] - started)
        assert waits == [0.5, 1.0, 2.0, 2.0]
        outage.succeeded()
        assert not outage.is_away and outage.may_try()
        outage.failed(error, doing="starting jobs")
        assert not outage.may_try()
        now[0] += 0.5
        assert outage.may_try()  # back to the first wait
    messages = [r.getMessage() for r in caplog.records]
    assert sum("database unreachable while" in m for m in messages) == 2  # once per outage
    assert sum("database reachable again after 5.5 s" in m for m in messages) == 1
    assert metrics.WORKER_DATABASE_ERRORS._value.get() - errors_before == 5


def test_an_error_that_is_not_an_outage_is_raised_again() -> None:
    outage = DatabaseOutage()
    error = constraint_error()
    with pytest.raises(IntegrityError):
        outage.failed(error, doing="storing results")
    assert not outage.is_away
