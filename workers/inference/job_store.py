"""The worker's reads and writes of job rows, with the caches and events around them.

Responsible for: loading a job's status before running it (redelivered jobs that already
finished are skipped), claiming it (`mark_running`), storing its result or error with the
idempotent storage calls, and, after a write that actually finished the job, filling the
exact-result cache and announcing completion. A webhook delivery is enqueued in the same
transaction as the status write, so a crash keeps both or neither.

Work is done per batch where the worker has one: the jobs of a poll are loaded with one
SELECT and claimed with one UPDATE, the results of an engine step are stored in one
transaction, and Redis hears of them in one round trip (the cache fill, the
announcement and the token settling share one pipeline). Every write is committed before
its Kafka offset is acknowledged, which is what makes the offset commit safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.messages import JobMessage
from core.tenant_metrics import TenantLabels, count_finished
from storage import job_batches, jobs
from storage.cache_policy import CachePolicy
from storage.events import publish_batches_wake, queue_job_done, queue_jobs_done
from storage.models import Job, JobStatus
from storage.redis_batch import RedisBatch
from storage.result_cache import ResultCache, result_cache_key
from storage.tenant_limits import tenant_weights
from storage.token_budget import TokenBudgets
from storage.webhook_events import enqueue_job_event
from workers.inference.semantic_lookup import SemanticLookup

logger = logging.getLogger(__name__)

# Jobs whose result-cache key is remembered between its look-up and its fill. A job looked
# up and then never stored (cancelled before its claim) leaves its key behind: past this
# many, the memo starts over.
MAX_REMEMBERED_KEYS = 65_536


@dataclass(slots=True)
class Success:
    """A result to store for a job (see `JobStore.succeed_many`)."""

    message: JobMessage
    result: dict[str, Any]
    first_token_at: datetime | None
    fill_cache: bool = True


@dataclass(slots=True)
class JobSnapshot:
    """What the worker needs to know about a job row before running it."""

    status: JobStatus
    created_at: datetime
    # Claims so far: each worker that took it counts one.
    attempts: int = 0


class JobStore:
    """Job rows, result cache and completion events, as the inference worker uses them."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        redis_client: redis.Redis,
        *,
        prefix: str,
        result_cache_ttl_s: int,
        model_revision: str | None = None,
        max_tenants: int = 50,
    ) -> None:
        self._sessions = sessions
        # The served weights' revision: results carry it, cached ones are keyed by it.
        self.model_revision = model_revision
        self._redis = redis_client
        self._prefix = prefix
        self._cache = ResultCache(redis_client, prefix=prefix)
        self._cache_ttl_s = result_cache_ttl_s
        # Set by the worker's wiring when semantic lookups are possible.
        self.semantic: SemanticLookup | None = None
        # Finished jobs settle their token reservations and feed the per-tenant counters.
        self.budgets = TokenBudgets(redis_client, prefix=prefix)
        self.tenant_labels = TenantLabels(max_tenants)
        # A job's result-cache key is needed to look its result up before it runs and to
        # fill the cache after; the key (canonical JSON, SHA-256) cost ~18 us a job each
        # time on the worker's one thread. Job id -> key, from look-up until stored.
        self._cache_keys: dict[str, str | None] = {}

    def load(self, job_id: str) -> JobSnapshot | None:
        """The job's status and creation time, or None if no such row exists."""
        with self._sessions() as session:
            job = jobs.get_job(session, job_id=job_id)
            return None if job is None else JobSnapshot(job.status, job.created_at)

    def tenant_weights(self) -> dict[str, float]:
        """Tenant id -> fair-share weight, for tenants that set one."""
        with self._sessions() as session:
            return tenant_weights(session)

    def claim(self, job_id: str, *, worker_id: str) -> bool:
        """Mark the job running on this worker; False if it finished meanwhile."""
        with self._sessions() as session:
            claimed = jobs.mark_running(session, job_id=job_id, worker_id=worker_id)
            session.commit()
            return claimed

    def cached_result(self, message: JobMessage) -> dict[str, Any] | None:
        """A stored result for an identical deterministic request, or None."""
        return self._cache.get(self._cache_key(message))

    def load_many(self, job_ids: list[str]) -> dict[str, JobSnapshot]:
        """`load` for many jobs in one statement; ids without a row are left out."""
        with self._sessions() as session:
            found = job_batches.load_statuses(session, job_ids=job_ids)
        return {job_id: JobSnapshot(*row) for job_id, row in found.items()}

    def claim_many(self, job_ids: list[str], *, worker_id: str) -> set[str]:
        """`claim` for many jobs in one statement and commit; the ids claimed."""
        with self._sessions() as session:
            claimed = job_batches.claim_jobs(session, job_ids=job_ids, worker_id=worker_id)
            session.commit()
        return claimed

    def cached_results(self, messages: list[JobMessage]) -> list[dict[str, Any] | None]:
        """`cached_result` for each message in one Redis round trip."""
        keys = [self._cache_key(m, remember=True) if CachePolicy.of(m.body).reads_exact
                else None for m in messages]
        found = self._cache.get_many(keys)
        num_misses = sum(key is not None and hit is None for key, hit in zip(keys, found,
                                                                             strict=True))
        if num_misses:
            metrics.CACHE_LOOKUPS.labels("exact", "miss").inc(num_misses)
        return found

    def succeed(
        self,
        message: JobMessage,
        *,
        result: dict[str, Any],
        first_token_at: datetime | None,
        fill_cache: bool = True,
    ) -> bool:
        """Store the result; True only if this call finished the job (then cache and announce)."""
        success = Success(message, result, first_token_at, fill_cache)
        return message.job_id in self.succeed_many([success])

    def succeed_many(self, successes: list[Success]) -> set[str]:
        """Store results in one transaction; the ids this call finished (cached, announced).

        Token counts come from each result's OpenAI `usage` object. Cache fills and
        announcements go to Redis in one pipeline each, after the commit.
        """
        if not successes:
            return set()
        completions = [_completion(s) for s in successes]
        with self._sessions() as session:
            finished = job_batches.complete_jobs(session, completions)
            if finished is None:  # some job was finished elsewhere: find which, one by one
                session.rollback()
                finished = {c.job_id for c in completions if jobs.complete_job(
                    session, job_id=c.job_id, result=c.result, prompt_tokens=c.prompt_tokens,
                    completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                    first_token_at=c.first_token_at)}
            self._enqueue_webhooks(session, {
                s.message.job_id for s in successes
                if s.message.job_id in finished and s.message.has_callback is not False})
            session.commit()
        if dropped := len(successes) - len(finished):
            logger.info("%d result(s) dropped: their jobs were already finished", dropped)
        filled = [s for s in successes if s.fill_cache and s.message.job_id in finished
                  and CachePolicy.of(s.message.body).fills]
        # The cache fill, the announcement and the token settling: one round trip, in
        # that order (a client woken by the announcement finds the result cached).
        batch = RedisBatch(self._redis)
        self._cache.queue_puts(batch, [
            (self._cache_key(s.message), s.result,
             CachePolicy.of(s.message.body).ttl_or(self._cache_ttl_s) if self._cache_ttl_s
             else 0)
            for s in filled
        ])
        for success in successes:  # those not filled: stored elsewhere, or cache answers
            self._cache_keys.pop(success.message.job_id, None)
        if self.semantic is not None:
            self.semantic.remember_many([(s.message, s.result) for s in filled])
        queue_jobs_done(batch, prefix=self._prefix,
                        statuses=dict.fromkeys(finished, JobStatus.SUCCEEDED))
        self._account(batch, [(s.message, c) for s, c in zip(successes, completions,
                                                             strict=True)
                              if s.message.job_id in finished])
        batch.execute()
        return finished

    def wake_batches(self, batch_ids: list[str]) -> None:
        """Ask the schedulers for a pass over these batches now (best effort)."""
        for batch_id in batch_ids:
            publish_batches_wake(self._redis, prefix=self._prefix, batch_id=batch_id)

    def _account(self, batch: RedisBatch,
                 done: list[tuple[JobMessage, job_batches.Completion]]) -> None:
        """Settle the finished jobs' token reservations (in `batch`); count them per tenant.

        A budget counts the tokens computed, prompt plus completion; an answer from the
        result cache computed none and is charged nothing (its usage shows as cached).
        """
        used = []
        for message, c in done:
            is_cached_answer = "cached" in c.result
            used.append((message.job_id, 0 if is_cached_answer
                         else c.prompt_tokens + c.completion_tokens))
            count_finished(self.tenant_labels, tenant_id=message.tenant_id,
                           model=message.model,
                           outcome="cached" if is_cached_answer else "succeeded",
                           prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                           cached_tokens=c.prompt_tokens if is_cached_answer
                           else c.cached_tokens)
        self.budgets.queue_settle(batch, used)

    def fail(self, message: JobMessage, *, error: dict[str, Any]) -> bool:
        """Store the error; True only if this call finished the job (then announce)."""
        self._cache_keys.pop(message.job_id, None)
        with self._sessions() as session:
            finished = jobs.fail_job(session, job_id=message.job_id, error=error)
            if finished:
                self._enqueue_webhook(session, message.job_id)
            session.commit()
        if finished:  # announced and settled in one round trip
            batch = RedisBatch(self._redis)
            queue_job_done(batch, prefix=self._prefix, job_id=message.job_id,
                           status=JobStatus.FAILED)
            self.budgets.queue_settle(batch, [(message.job_id, 0)])
            batch.execute()
            count_finished(self.tenant_labels, tenant_id=message.tenant_id,
                           model=message.model, outcome="failed")
        return finished

    def release(self, job_ids: list[str], *, worker_id: str) -> int:
        """Hand this worker's unfinished jobs back to the queue as it stops; how many moved.

        Only jobs still running under `worker_id` move. A database error is logged, not
        raised: the worker leaves either way, and once its heartbeat row is gone the
        reconciler hands the jobs back itself.
        """
        try:
            with self._sessions() as session:
                released = jobs.release_jobs(session, job_ids=job_ids, worker_id=worker_id)
                session.commit()
        except SQLAlchemyError as e:
            logger.warning("cannot hand %d job(s) back to the queue: %s", len(job_ids), e)
            return 0
        return len(released)

    def _cache_key(self, message: JobMessage, *, remember: bool = False) -> str | None:
        """The job's key: the one remembered at its look-up (forgotten now), else computed
        (and remembered when `remember`, for the fill after the job runs)."""
        key = self._cache_keys.pop(message.job_id, _NOT_REMEMBERED)
        if key is _NOT_REMEMBERED:
            # Salted by tenant: equal requests of one tenant share results, tenants never
            # do; and by revision: new weights under the same name never see old results.
            salt = message.tenant_id + (f"@{self.model_revision}" if self.model_revision
                                        else "")
            if message.kind == "response":  # the same chat body, another result object
                salt += "|response"
            key = result_cache_key(message.model, message.body, salt=salt)
        if remember:
            if len(self._cache_keys) >= MAX_REMEMBERED_KEYS:
                self._cache_keys.clear()
            self._cache_keys[message.job_id] = key
        return key  # type: ignore[return-value]  # a str or None once not the sentinel

    @property
    def system_fingerprint(self) -> str | None:
        """OpenAI's `system_fingerprint` of results: `fp_<revision>`, None without one."""
        return f"fp_{self.model_revision}" if self.model_revision else None

    def _enqueue_webhook(self, session: Session, job_id: str) -> None:
        job = jobs.get_job(session, job_id=job_id)
        if job is not None:
            enqueue_job_event(session, job=job)

    def _enqueue_webhooks(self, session: Session, job_ids: set[str]) -> None:
        """`_enqueue_webhook` for the jobs among these that have a callback (one SELECT;
        none when no message says a job may have one, as for a batch's lines)."""
        if not job_ids:
            return
        query = select(Job).where(Job.id.in_(list(job_ids)), Job.callback_url.is_not(None))
        for job in session.scalars(query):
            enqueue_job_event(session, job=job)


_NOT_REMEMBERED: Any = object()


def epoch_to_datetime(seconds: float | None) -> datetime | None:
    """An engine timestamp (seconds since the epoch) as an aware UTC datetime."""
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _completion(success: Success) -> job_batches.Completion:
    """A result with the token counts of its OpenAI `usage` object."""
    usage = success.result.get("usage") or {}
    # A Responses result names them input/output tokens.
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return job_batches.Completion(
        job_id=success.message.job_id, result=success.result,
        prompt_tokens=int(usage.get("prompt_tokens", usage.get("input_tokens", 0))),
        completion_tokens=int(usage.get("completion_tokens", usage.get("output_tokens", 0))),
        cached_tokens=int(details.get("cached_tokens", 0)),
        first_token_at=success.first_token_at)
