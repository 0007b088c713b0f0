"""Keyset pages over (created_at, id), the order every list of a tenant's rows pages by.

Rows created in the same instant are told apart by id, so a page that ends inside such a
group neither repeats nor skips a row: newest first, after (t, "b") come (t, "a") and
then everything older than t.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, literal, tuple_
from sqlalchemy.orm import InstrumentedAttribute, Session

from storage.models import UTCDateTime

RowT = TypeVar("RowT")


def keyset_page(
    session: Session,
    query: Select[RowT],
    *,
    created_at: InstrumentedAttribute[datetime],
    id: InstrumentedAttribute[Any],
    after: tuple[datetime, str] | None,
    limit: int,
    ascending: bool = False,
) -> tuple[list[RowT], bool]:
    """`limit` rows of `query` past the `after` row's (created_at, id); whether more follow."""
    if after is not None:
        key = tuple_(created_at, id)
        at = tuple_(literal(after[0], UTCDateTime), literal(after[1]))
        query = query.where(key > at if ascending else key < at)
    if ascending:
        query = query.order_by(created_at, id)
    else:
        query = query.order_by(created_at.desc(), id.desc())
    # One row more than asked for says whether another page follows.
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit
