"""Deadline order on the real stack: API, scheduler, one worker, broker, PostgreSQL.

Four batches wait, fanned out, before the worker starts: a 7-day one, then windows of
24 h, 2 h and 30 minutes (the reverse of their deadlines). The worker takes them all in
(its in-flight bound holds every line) and its engine runs two sequences at a time, the
earliest deadline first: the batches' last lines finish 30m, 2h, 24h, 7d. (At most the
first lines the engine admitted before the rest arrived run out of order.)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import sqlalchemy as sa

from storage.models import Job, JobStatus
from tests.utils.batch_service import CHAT, TERMINAL, BatchService, chat_line, jsonl

NUM_LINES = 6
WINDOWS = ("7d", "24h", "2h", "30m")


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
        svc.wait_jobs(batch_id, lambda s: s.get(JobStatus.QUEUED, 0) == NUM_LINES)
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
    assert order == ["30m", "2h", "24h", "7d"], (last_finish, svc.logs())
