"""Cursor pages for the list endpoints: OpenAI's list object and the bad-cursor error.

Every list endpoint pages the same way: newest first (unless asked otherwise), `limit`
rows at a time, and `after` set to the previous page's `last_id` for the next page.
"""

from __future__ import annotations

from typing import Any

from api.errors import InvalidRequest


def invalid_cursor(error: ValueError) -> InvalidRequest:
    """The 400 for an `after` cursor the storage layer could not read."""
    return InvalidRequest(str(error), param="after", code="invalid_cursor")


def list_page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's list object for one page of objects (`first_id`/`last_id` None when empty)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
