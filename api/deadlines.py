"""Refusing work whose deadline the backlog and the fleet cannot meet.

At creation a job (or batch) with a deadline is placed where workers would take it
(`api.estimates`: its priority, its deadline among the others, the jobs queued before
it) and its completion estimated from the model's measured pace. A deadline before that
estimate is answered `409 deadline_unattainable` with the estimate, unless the request
says `"on_unattainable": "accept"` (best effort). Without a measured worker there is
nothing to estimate from, and the work is accepted.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse

from api.errors import Conflict, error_body
from api.estimates import EstimateBoard
from core.topics import PRIORITIES
from storage.queue_estimates import queue_key


class DeadlineUnattainable(Conflict):
    """409: the deadline falls before the estimated completion; the body carries the estimate."""

    code = "deadline_unattainable"

    def __init__(self, message: str, *, estimated_completion_at: float,
                 param: str = "deadline") -> None:
        super().__init__(message, param=param)
        self.estimated_completion_at = round(estimated_completion_at)

    def to_response(self) -> JSONResponse:
        """The error shape plus `estimated_completion_at` (unix time) inside `error`."""
        body: dict[str, Any] = error_body(self.message, type=self.type, param=self.param,
                                          code=self.code)
        body["error"]["estimated_completion_at"] = self.estimated_completion_at
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def estimated_completion(
    board: EstimateBoard, *, model: str, priority: str, deadline: datetime, num_jobs: int = 1,
    max_tokens: int | None = None,
) -> float | None:
    """When `num_jobs` new jobs with this deadline would be done (unix time), or None;
    `max_tokens` is a single job's own."""
    queue = board.model(model)
    if queue is None:
        return None
    now = time.time()
    rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
    first = queue.estimate_queued(rank, queue_key(deadline, datetime.fromtimestamp(now, UTC)),
                                  now, max_tokens)
    if first.estimated_completion_at is None or not queue.tokens_per_s:
        return None
    rest = (num_jobs - 1) * queue.work_per_job / queue.tokens_per_s
    return first.estimated_completion_at + max(0.0, rest)


def check_attainable(
    board: EstimateBoard,
    *,
    model: str,
    priority: str,
    deadline: datetime,
    num_jobs: int = 1,
    max_tokens: int | None = None,
    on_unattainable: str | None,
    what: str = "deadline",
) -> None:
    """Raise DeadlineUnattainable when the estimate falls after `deadline` (unless accepted)."""
    if on_unattainable == "accept":
        return
    at = estimated_completion(board, model=model, priority=priority, deadline=deadline,
                              num_jobs=num_jobs, max_tokens=max_tokens)
    if at is None or at <= deadline.timestamp():
        return
    estimate = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    raise DeadlineUnattainable(
        f"The {what} ({deadline.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}) cannot be met: with the "
        f"work queued ahead and {model}'s measured pace this would finish around {estimate} "
        f"({at - time.time():.0f} s from now). Send \"on_unattainable\": \"accept\" to queue "
        "it anyway as best effort.",
        estimated_completion_at=at, param=what,
    )
