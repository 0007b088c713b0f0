"""Where a fetched record goes, above all one whose job was released and not yet let go."""

from __future__ import annotations

from datetime import UTC, datetime

from kafka import TopicPartition

from core.messages import JobMessage
from workers.inference.job_starter import Candidate, InFlightJob
from workers.inference.record_intake import HeldRecords, place_record

TP = TopicPartition("jobs.normal", 0)


def message(job_id: str) -> JobMessage:
    return JobMessage(job_id=job_id, tenant_id="t", priority="normal", model="m",
                      kind="text_completion", body={"prompt": job_id, "max_tokens": 3})


def in_flight(job_id: str, offset: int, *, is_released: bool = False) -> InFlightJob:
    return InFlightJob(message(job_id), datetime.now(UTC), {(TP, offset)},
                       is_released=is_released)


def test_a_new_job_becomes_a_candidate_and_its_copies_join_it() -> None:
    inflight: dict[str, InFlightJob] = {"r": in_flight("r", 1)}
    candidates: dict[str, Candidate] = {}
    held = HeldRecords()
    place_record(message("a"), (TP, 5), inflight=inflight, candidates=candidates, held=held)
    place_record(message("a"), (TP, 9), inflight=inflight, candidates=candidates, held=held)
    place_record(message("r"), (TP, 7), inflight=inflight, candidates=candidates, held=held)
    assert list(candidates) == ["a"] and candidates["a"].records == {(TP, 5), (TP, 9)}
    assert inflight["r"].records == {(TP, 1), (TP, 7)}  # a redelivered copy of a running job
    assert len(held) == 0


def test_a_record_of_a_released_job_waits_for_the_abort_and_then_starts() -> None:
    # The partition moved away (the job was released and its abort asked) and came back
    # before the engine reported the abort: the record is fetched again.
    inflight = {"j": in_flight("j", 3, is_released=True)}
    candidates: dict[str, Candidate] = {}
    held = HeldRecords()
    place_record(message("j"), (TP, 3), inflight=inflight, candidates=candidates, held=held)
    place_record(message("j"), (TP, 8), inflight=inflight, candidates=candidates, held=held)
    # Neither started beside the engine's request of the same id, nor attached to the
    # released job, whose records are dropped unacknowledged when its abort comes in.
    assert candidates == {}
    assert inflight["j"].records == {(TP, 3)}
    assert len(held) == 1
    again = held.take("j")  # the abort is in
    assert again is not None and again.message.job_id == "j"
    assert again.records == {(TP, 3), (TP, 8)}
    assert held.take("j") is None and len(held) == 0


def test_held_records_are_forgotten_on_a_new_assignment() -> None:
    held = HeldRecords()
    held.hold(message("j"), (TP, 3))
    held.clear()  # fetched again from the committed offsets
    assert held.take("j") is None
