"""Starting a poll's jobs: the per-batch path from prefetched records to the engine.

Responsible for, per batch of decoded messages: loading their rows with one SELECT
(redelivered jobs that finished are skipped; one claimed `job_max_attempts` times is
failed, as its workers kept dying), answering from the exact cache (one MGET) and, for
jobs that opted in, the semantic cache; refusing what the engine would refuse, with a
stored error; claiming the rest with one UPDATE and adding them to the engine's running
batch. Every job settled here has its records acknowledged through `ack`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kafka import TopicPartition

from core import metrics
from core.messages import JobMessage
from core.settings import Settings
from core.topics import Priority
from storage.cache_policy import CachePolicy
from storage.models import utcnow
from workers.engine import SamplingParams
from workers.inference.embedding_jobs import embedding_request_from_body
from workers.inference.engine_loop import EngineLoop, EngineRequest
from workers.inference.job_store import JobStore
from workers.inference.outcomes import OutcomeRecorder
from workers.inference.remote_engine import RemoteEngineLoop
from workers.inference.sampling import (
    Prompt,
    chat_tools,
    num_choices,
    prompt_from_body,
    sampling_params_from_body,
)

logger = logging.getLogger(__name__)

Records = set[tuple[TopicPartition, int]]


@dataclass(slots=True)
class InFlightJob:
    """A job handed to the engine and not yet finished."""

    message: JobMessage
    created_at: datetime
    # Every record that carried this job (a redelivery or a re-publish adds one).
    records: set[tuple[TopicPartition, int]] = field(default_factory=set)
    is_cancelled: bool = False  # aborted because the user cancelled it
    is_released: bool = False  # aborted so that another worker (or restart) runs it


@dataclass(slots=True)
class Candidate:
    """A prefetched job about to be started, with every record that carried it."""

    message: JobMessage
    records: set[tuple[TopicPartition, int]]
    created_at: datetime | None = None

    @property
    def started_from(self) -> datetime:
        """The job's creation time (known once its row is loaded)."""
        assert self.created_at is not None, "loaded before use"
        return self.created_at


class JobStarter:
    """Starts batches of jobs (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        store: JobStore,
        outcomes: OutcomeRecorder,
        engine: EngineLoop | RemoteEngineLoop,
        worker_id: str,
        ack: Callable[[Records], None],
        is_followed: Callable[[str], bool] = lambda job_id: False,
        weight_of: Callable[[str], float] = lambda tenant_id: 1.0,
    ) -> None:
        """`weight_of`: a tenant's fair-share weight, which the engine shares by."""
        self.settings = settings
        self._weight_of = weight_of
        self._store = store
        self._outcomes = outcomes
        self._engine = engine
        self._worker_id = worker_id
        self._ack = ack
        self._is_followed = is_followed
        self._max_model_len: int | None = getattr(engine.engine, "max_model_len", None)

    def start(self, candidates: dict[str, Candidate]) -> list[InFlightJob]:
        """Put jobs into the engine: one SELECT, one cache round trip and one claim for all;
        the jobs now in flight.

        Jobs that need no engine (finished already, answered from a cache, refused) are
        settled and their records acknowledged.
        """
        started: list[InFlightJob] = []
        snapshots = self._store.load_many(list(candidates))
        runnable: list[Candidate] = []
        for job_id, candidate in candidates.items():
            snapshot = snapshots.get(job_id)
            if snapshot is None:
                logger.warning("job %s has no row; skipping its record", job_id)
            elif snapshot.status.is_terminal:
                logger.debug("job %s already %s; skipping", job_id, snapshot.status.value)
            elif snapshot.attempts >= self.settings.job_max_attempts:
                # Claimed that often without finishing: each worker holding it died or
                # gave it up. Running it again could take this worker down too.
                self._outcomes.failed(
                    candidate.message,
                    f"this job was claimed {snapshot.attempts} times (job_max_attempts) and "
                    "its worker stopped before finishing it each time: not retried",
                    code="worker_lost", type="server_error")
            else:
                candidate.created_at = snapshot.created_at
                runnable.append(candidate)
                continue
            self._ack(candidate.records)
        runnable = self._answer_from_caches(runnable)
        prepared: list[tuple[Candidate, Prompt, SamplingParams, int]] = []
        tools_of: dict[str, list[dict[str, Any]]] = {}  # job id -> tools for its prompt
        # job id -> its chat template's variables (`chat_template_kwargs`)
        kwargs_of: dict[str, dict[str, Any]] = {}
        for candidate in runnable:
            message = candidate.message
            try:
                self._check_model(message)
                n = 1
                if message.kind == "embedding":
                    prompt, params = embedding_request_from_body(message.body,
                                                                 self._engine.engine)
                else:
                    n = num_choices(message.body)
                    prompt = prompt_from_body(message.kind, message.body)
                    params = sampling_params_from_body(
                        message.kind, message.body, max_model_len=self._max_model_len
                    )
                    # Prefix KV (in the pool and the Redis KV tier) is chained from the
                    # tenant: one tenant's blocks are never another's cache hits.
                    params.cache_salt = message.tenant_id
                    # `cache: {"mode": "off"}` bypasses the prefix KV caches too.
                    params.use_prefix_cache = CachePolicy.of(message.body).shares_prefix_kv
                    tools = chat_tools(message.body) if message.body.get("tools") else None
                    if tools:
                        tools_of[message.job_id] = tools
                    if message.body.get("chat_template_kwargs"):
                        kwargs_of[message.job_id] = message.body["chat_template_kwargs"]
            except ValueError as e:
                self._outcomes.failed(message, str(e))
                self._ack(candidate.records)
                continue
            except Exception as e:  # noqa: BLE001 - one job's body must not stop the worker
                # The API validates bodies, so this is a record from elsewhere (an older
                # release, another producer) or a defect here: the job fails, not the loop.
                logger.exception("job %s: its request could not be prepared", message.job_id)
                self._outcomes.failed(
                    message, f"the request could not be prepared: {type(e).__name__}: {e}",
                    code="request_not_prepared", type="server_error")
                self._ack(candidate.records)
                continue
            prepared.append((candidate, prompt, params, n))
        claimed = self._store.claim_many(
            [c.message.job_id for c, _, _, _ in prepared], worker_id=self._worker_id
        )
        now = utcnow()
        requests: list[EngineRequest] = []
        for candidate, prompt, params, n in prepared:
            message = candidate.message
            if message.job_id not in claimed:
                self._ack(candidate.records)  # finished or cancelled meanwhile
                continue
            metrics.QUEUE_WAIT_SECONDS.labels(message.priority).observe(
                max(0.0, (now - candidate.started_from).total_seconds())
            )
            started.append(InFlightJob(message, candidate.started_from, candidate.records))
            # Streamed: asked for by its request (`stream: true`), or followed over SSE.
            stream = message.body.get("stream") is True or self._is_followed(message.job_id)
            requests.append(EngineRequest(
                message.job_id, prompt, params, priority=Priority(message.priority).rank,
                stream=stream, job=message,
                tools=tools_of.get(message.job_id),
                n=n,
                template_kwargs=kwargs_of.get(message.job_id),
                tenant_weight=self._weight_of(message.tenant_id),
            ))
        # All at once: the engine orders the whole start by urgency before any of it runs.
        self._engine.add_all(requests)
        return started

    def _answer_from_caches(self, candidates: list[Candidate]) -> list[Candidate]:
        """Answer what the exact (then, where asked, semantic) cache can; the rest."""
        answered: list[tuple[JobMessage, dict[str, Any], datetime, str | dict[str, Any]]] = []
        missed: list[Candidate] = []
        exact = self._store.cached_results([c.message for c in candidates])
        for candidate, hit in zip(candidates, exact, strict=True):
            if hit:
                answered.append((candidate.message, hit, candidate.started_from, "exact"))
            else:
                missed.append(candidate)
        semantic = self._store.semantic
        near = semantic.find([c.message for c in missed]) if semantic is not None else {}
        for candidate in missed:
            match = near.get(candidate.message.job_id)
            if match is not None:
                marker = {"kind": "semantic", "similarity": round(match.similarity, 4),
                          "matched_job_id": match.job_id}
                answered.append((candidate.message, match.result, candidate.started_from,
                                 marker))
        if answered:
            self._outcomes.answered_from_cache(answered)
        done = {message.job_id for message, *_ in answered}
        for candidate in candidates:
            if candidate.message.job_id in done:
                self._ack(candidate.records)
        return [c for c in candidates if c.message.job_id not in done]

    def _check_model(self, message: JobMessage) -> None:
        if message.model != self.settings.served_model_name:
            raise ValueError(
                f"model {message.model!r} is not served by this worker "
                f"(it serves {self.settings.served_model_name!r})"
            )
