"""A statement run for many parameter sets at once, its values bound without SQLAlchemy's
per-row machinery.

`Session.execute(statement, [rows])` builds every row's parameters through the compiled
statement's caches and per-value type processors: ~60 us a row on the 2-core hosts, 70%
of storing a step's results on SQLite (the driver's own `executemany` is the rest). Here
the statement is compiled once per dialect, each bind parameter's type processor looked up
once, and the rows handed to the driver's `executemany` as plain tuples (or dicts, for
named parameter styles) through `exec_driver_sql`, so the connection, the transaction
and the engine's events are SQLAlchemy's as before. The values stored are the same: each
goes through the processor SQLAlchemy would have applied (JSON serialiser, datetime
handling, type decorators).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import CursorResult
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement


@dataclass(frozen=True, slots=True)
class _Bind:
    key: str  # as the SQL names it (named parameter styles)
    row_key: str | None  # the row's value by this name; None: the statement's own value
    process: Callable[[Any], Any] | None
    constant: Any = None  # processed, where row_key is None


@dataclass(frozen=True, slots=True)
class _Plan:
    sql: str
    positional: bool
    binds: tuple[_Bind, ...]  # in the order a positional driver takes them

    def values(self, row: Mapping[str, Any], shared: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return [(b.key, b.constant if b.row_key is None else shared[b.row_key]
                 if b.row_key in shared else row[b.row_key] if b.process is None
                 else b.process(row[b.row_key]))
                for b in self.binds]

    def processed(self, shared: Mapping[str, Any]) -> dict[str, Any]:
        """Values the same for every row, through their processors once."""
        out: dict[str, Any] = {}
        for b in self.binds:
            key = b.row_key
            if key is not None and key in shared and key not in out:
                out[key] = shared[key] if b.process is None else b.process(shared[key])
        return out


class ManyStatement:
    """`statement`, compiled once per dialect and run for many rows: each row (or the
    values shared by all) gives the values of the statement's value-less `bindparam()`s by
    name; its other bind parameters (literal values) are the same for every row. Expanding
    IN lists cannot run this way."""

    def __init__(self, statement: ClauseElement) -> None:
        self._statement = statement
        self._plans: weakref.WeakKeyDictionary[Dialect, _Plan] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def run(self, session: Session, rows: Sequence[Mapping[str, Any]],
            shared: Mapping[str, Any] | None = None) -> int:
        """Execute once per row in the session's transaction; the rows changed in all.
        `shared` gives values the same for every row (processed once, not per row)."""
        connection = session.connection()
        plan = self._plan(connection.dialect)
        common = plan.processed(shared or {})
        if plan.positional:
            params: list[Any] = [tuple(value for _, value in plan.values(row, common))
                                 for row in rows]
        else:
            params = [dict(plan.values(row, common)) for row in rows]
        result = connection.exec_driver_sql(plan.sql, params)
        assert isinstance(result, CursorResult)
        return result.rowcount

    def _plan(self, dialect: Dialect) -> _Plan:
        plan = self._plans.get(dialect)
        if plan is not None:
            return plan
        with self._lock:
            compiled: Any = self._statement.compile(dialect=dialect)
            binds = compiled.binds
            if any(bind.expanding for bind in binds.values()):
                raise ValueError("expanding parameters (IN lists) cannot run as executemany")
            # A name the dialect had to escape is written escaped in the SQL.
            escaped = getattr(compiled, "escaped_bind_names", None) or {}
            names = compiled.positiontup if compiled.positional else list(binds)
            planned = []
            for name in names:
                bind = binds[name]
                process = bind.type.dialect_impl(dialect).bind_processor(dialect)
                if bind.required:
                    planned.append(_Bind(escaped.get(name, name), bind.key, process))
                else:
                    value = bind.effective_value
                    planned.append(_Bind(escaped.get(name, name), None, None,
                                         value if process is None else process(value)))
            plan = _Plan(compiled.string, compiled.positional, tuple(planned))
            self._plans[dialect] = plan
        return plan
