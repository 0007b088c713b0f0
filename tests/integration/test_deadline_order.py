"""Deadline order on the real stack: API, scheduler, one worker, broker, PostgreSQL.

Four batches wait, fanned out, before the worker starts: a 7-day one, then windows of
24 h, 50 and 30 minutes (the reverse of their deadlines). The worker takes them all in
(its in-flight bound holds every line) and its engine runs two sequences at a time,
deadlines within the hour first, earliest first: the 30m batch's last line finishes
first, then the 50m one's, then the far-off windows', which the engine leaves to the
tenants' fair share (one tenant here: arrival order). The jobs of one poll reach the
engine in one step (`EngineLoop.add_all`), so none of them starts before it is ordered.

Behind a backlog, the worker holds two lines at a time, so order must come from the
topic: the backlog fills the model and priority's fan-out window, and the three batches
(24h, 2h, 30m, in that order) wait in their files; as the worker frees room, the fan-out
gives it to the nearest deadline first, so their lines reach the topic 30m, 2h, 24h.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import sqlalchemy as sa

from storage.models import Job
from tests.utils.batch_service import CHAT, TERMINAL, BatchService, chat_line, jsonl

NUM_LINES = 6
WINDOWS = ("7d", "24h", "50m", "30m")
# The backlog fills the window; each batch behind it is larger than the worker holds.
WINDOW = 6
BACKLOG_LINES = 12
BEHIND_LINES = 6


def test_batches_finish_in_deadline_order_whatever_order_they_came_in(
        batch_services: Callable[..., BatchService]) -> None:
    svc = batch_services(start_worker=False, worker_max_inflight=4 * len(WINDOWS) * NUM_LINES,
                         engine_max_num_seqs=2)
    model = svc.settings.model
    client = svc.openai()
    ids = {}
    for window in WINDOWS:
        lines = [chat_line(f"{window}-{i}", model, content=f"Question {i} due in {window}?",
                           max_tokens=4) for i in range(NUM_LINES)]
        uploaded = client.files.create(file=(f"{window}.jsonl", jsonl(lines)), purpose="batch")
        ids[window] = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                            completion_window=window).id  # type: ignore[arg-type]
    for batch_id in ids.values():
        svc.wait_published(batch_id, NUM_LINES)
    svc.start_worker()
    for batch_id in ids.values():
        done = svc.wait_batch(client, batch_id, lambda b: b.status in TERMINAL)
        assert done.status == "completed", svc.logs()
    with svc.sessions() as session:
        rows = session.execute(
            sa.select(Job.batch_id, sa.func.max(Job.finished_at))
            .where(Job.batch_id.in_(list(ids.values()))).group_by(Job.batch_id)).all()
    last_finish: dict[str | None, datetime | None] = dict(rows)  # type: ignore[arg-type]
    order = sorted(WINDOWS, key=lambda w: last_finish[ids[w]] or datetime.max)
    assert order[:2] == ["30m", "50m"], (last_finish, svc.logs())


def _last_finishes(svc: BatchService, ids: dict[str, str]) -> dict[str, datetime]:
    """Window -> when its batch's last line finished."""
    with svc.sessions() as session:
        rows = session.execute(
            sa.select(Job.batch_id, sa.func.max(Job.finished_at))
            .where(Job.batch_id.in_(list(ids.values()))).group_by(Job.batch_id)).all()
    by_id: dict[str, datetime | None] = dict(rows)  # type: ignore[arg-type]
    finishes = {window: by_id.get(batch_id) for window, batch_id in ids.items()}
    assert all(finishes.values()), finishes
    return {window: at for window, at in finishes.items() if at is not None}


def test_batches_behind_a_backlog_reach_the_topic_in_deadline_order(
        batch_services: Callable[..., BatchService]) -> None:
    svc = batch_services(start_worker=False, batch_max_queued_lines=WINDOW,
                         worker_max_inflight=2, engine_max_num_seqs=2)
    model = svc.settings.model
    client = svc.openai()

    def submit(name: str, num_lines: int, window: str) -> str:
        lines = [chat_line(f"{name}-{i}", model, content=f"Line {i} of {name}?",
                           max_tokens=4) for i in range(num_lines)]
        uploaded = client.files.create(file=(f"{name}.jsonl", jsonl(lines)), purpose="batch")
        return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                     completion_window=window).id  # type: ignore[arg-type]

    backlog = submit("backlog", BACKLOG_LINES, "7d")
    svc.wait_published(backlog, WINDOW)
    ids = {window: submit(window, BEHIND_LINES, window) for window in ("24h", "2h", "30m")}
    for batch_id in ids.values():
        svc.wait_batch(client, batch_id, lambda b: b.status == "in_progress")
    # The window is the pair's, not each batch's: the backlog's lines fill it, so
    # nothing of the three is in the topic yet.
    assert all(svc.job_statuses(batch_id) == {} for batch_id in ids.values()), svc.logs()
    svc.start_worker()
    for batch_id in [*ids.values(), backlog]:
        done = svc.wait_batch(client, batch_id, lambda b: b.status in TERMINAL)
        assert done.status == "completed", svc.logs()
    finishes = _last_finishes(svc, {**ids, "7d": backlog})
    order = sorted(finishes, key=lambda w: finishes[w])
    assert order == ["30m", "2h", "24h", "7d"], (finishes, svc.logs())
