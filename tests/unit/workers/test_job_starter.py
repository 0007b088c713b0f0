"""A job whose body cannot be prepared fails alone: the jobs started beside it run."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kafka import TopicPartition

from core.messages import JobMessage
from core.settings import Settings
from storage.models import JobStatus
from workers.inference.job_starter import Candidate, JobStarter
from workers.inference.job_store import JobSnapshot

TP = TopicPartition("jobs.normal", 0)


class Store:
    """The rows JobStarter reads and claims: every job queued, none cached."""

    semantic = None

    def load_many(self, job_ids: list[str]) -> dict[str, JobSnapshot]:
        return {j: JobSnapshot(JobStatus.QUEUED, datetime.now(UTC)) for j in job_ids}

    def cached_results(self, messages: list[JobMessage]) -> list[None]:
        return [None] * len(messages)

    def claim_many(self, job_ids: list[str], *, worker_id: str) -> set[str]:
        return set(job_ids)


class Outcomes:
    def __init__(self) -> None:
        self.failures: dict[str, tuple[str, str | None, str]] = {}

    def failed(self, message: JobMessage, reason: str, *, code: str | None = None,
               type: str = "invalid_request_error") -> None:
        self.failures[message.job_id] = (reason, code, type)


class Engine:
    class engine:  # noqa: N801 - the attribute JobStarter reads the context length from
        max_model_len = 2048

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_all(self, requests: list[Any]) -> None:
        self.added += [r.request_id for r in requests]


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_body_that_raises_other_than_valueerror_fails_its_job_and_not_the_worker() -> None:
    settings = Settings()
    model = settings.served_model_name
    chat = [{"role": "user", "content": "hi"}]
    bodies = {
        "ok-1": {"messages": chat, "max_tokens": 3},
        # Nested past the interpreter's recursion limit: json.dumps raises RecursionError
        # while the request is prepared (the API would refuse it; a record from another
        # producer need not have passed the API).
        "deep": {"messages": chat, "max_tokens": 3, "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": nested_schema(5000)}}},
        "bad-top-p": {"prompt": "x", "max_tokens": 3, "top_p": 7},
        "ok-2": {"prompt": "x", "max_tokens": 3},
    }
    candidates = {
        job_id: Candidate(JobMessage(job_id=job_id, tenant_id="t", priority="normal",
                                     model=model, body=body,
                                     kind="text_completion" if "prompt" in body
                                     else "chat.completion"),
                          {(TP, i)})
        for i, (job_id, body) in enumerate(bodies.items())
    }
    acked: list[set[tuple[TopicPartition, int]]] = []
    outcomes, engine = Outcomes(), Engine()
    starter = JobStarter(settings, store=Store(), outcomes=outcomes,  # type: ignore[arg-type]
                         engine=engine, worker_id="w", ack=acked.append)  # type: ignore[arg-type]

    started = starter.start(candidates)

    assert [job.message.job_id for job in started] == ["ok-1", "ok-2"]
    assert engine.added == ["ok-1", "ok-2"]
    reason, code, type_ = outcomes.failures["deep"]
    assert (code, type_) == ("request_not_prepared", "server_error")
    assert reason.startswith("the request could not be prepared: RecursionError")
    assert outcomes.failures["bad-top-p"][1:] == (None, "invalid_request_error")
    assert set(outcomes.failures) == {"deep", "bad-top-p"}
    assert acked == [{(TP, 1)}, {(TP, 2)}]  # the failed jobs' records, and only theirs
