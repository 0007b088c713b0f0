"""Where a prefetched job record goes: a new candidate to start, one more copy of a job
already here, or held until the engine has let go of the job it carries.

A job released while running (its partition moved to another worker, see the worker's
rebalance handling) stays in flight until the engine reports its abort, one step later.
Should its partition come back within that step and the record be fetched again, the
record must not be attached to the released job: that job is dropped unacknowledged when
its abort is reported, and the record with it, so the job (queued again in the database)
would wait for the reconciler's requeue instead of running. Nor may it be started at once:
the engine still holds a request of that id. So it waits here and starts once the abort
is in.
"""

from __future__ import annotations

from kafka import TopicPartition

from core.messages import JobMessage
from workers.inference.job_starter import Candidate, InFlightJob

Record = tuple[TopicPartition, int]


class HeldRecords:
    """Records of released jobs whose abort the engine has not reported yet."""

    def __init__(self) -> None:
        self._held: dict[str, Candidate] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, message: JobMessage, record: Record) -> None:
        held = self._held.setdefault(message.job_id, Candidate(message, set()))
        held.records.add(record)

    def take(self, job_id: str) -> Candidate | None:
        """The candidate to start for `job_id` now that the engine let go of it, if any."""
        return self._held.pop(job_id, None)

    def clear(self) -> None:
        """Forget every held record: after a rebalance they are fetched again from the
        committed offsets; on stop they stay unacknowledged and are redelivered."""
        self._held.clear()


def place_record(
    message: JobMessage,
    record: Record,
    *,
    inflight: dict[str, InFlightJob],
    candidates: dict[str, Candidate],
    held: HeldRecords,
) -> None:
    """Add `record` (which carries `message`) to what the worker will start or tracks."""
    running = inflight.get(message.job_id)
    if running is not None and running.is_released:
        held.hold(message, record)
        return
    same = running or candidates.get(message.job_id)
    if same is not None:
        same.records.add(record)  # a redelivered or re-published copy
        return
    candidates[message.job_id] = Candidate(message, {record})
