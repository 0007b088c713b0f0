"""Query parameters of `GET /v1/jobs` that FastAPI cannot declare: `metadata.<key>`.

Any other parameter the route does not know is refused (400 naming it) rather than
ignored, and so is one given twice: a filter that silently does nothing (or half of what
was asked) answers with jobs it was meant to leave out.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import Request

from api.errors import InvalidRequest

KNOWN_PARAMS = frozenset({"status", "limit", "after", "batch_id", "model", "priority",
                          "created_after", "created_before"})
METADATA_PREFIX = "metadata."


def list_filters(request: Request) -> dict[str, str]:
    """The `metadata.<key>=<value>` filters; InvalidRequest for an unknown parameter."""
    metadata: dict[str, str] = {}
    seen: set[str] = set()
    for name, value in request.query_params.multi_items():
        if name in seen:
            # The last would win, and `status=failed&status=succeeded` read as one status
            # answers with jobs of the other left out without a word.
            raise InvalidRequest(f"query parameter {name!r} is given more than once; each "
                                 "filter takes one value", param=name, code="invalid_value")
        seen.add(name)
        if name.startswith(METADATA_PREFIX) and len(name) > len(METADATA_PREFIX):
            metadata[name.removeprefix(METADATA_PREFIX)] = value
        elif name not in KNOWN_PARAMS:
            known = ", ".join(sorted(KNOWN_PARAMS))
            raise InvalidRequest(f"unknown query parameter {name!r}; filters are {known} and "
                                 f"{METADATA_PREFIX}<key>", param=name, code="unknown_parameter")
    return metadata


# The last second a datetime can hold (9999-12-31T23:59:59Z): a later time in a query is
# refused by its `le` bound rather than overflowing into a 500.
MAX_UNIX_TIME = 253_402_300_799


def from_unix(seconds: int | None) -> datetime | None:
    """A Unix time as an aware UTC datetime."""
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=UTC)
