"""The work behind the Celery tasks: dispatch due deliveries, make one attempt.

Responsible for:
- holding the process's settings and database sessions (built lazily, and again after
  a fork, so a pool child never shares its parent's connections);
- `dispatch_due`: claim each due delivery (see `storage.deliveries`) and hand it on;
- `deliver`: start the claimed attempt, sign, POST, classify, record the attempt and
  the delivery's next state, and count it in the metrics.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.deliveries import claim_delivery, due_delivery_ids, record_attempt, start_attempt
from storage.models import utcnow
from storage.webhook_secrets import signing_secrets
from storage.webhooks import DeliveryStatus
from workers.callbacks import metrics
from workers.callbacks.delivery import AttemptOutput, attempt_delivery
from workers.callbacks.retry_policy import Verdict, retry_delay
from workers.callbacks.signing import signature_headers

logger = logging.getLogger(__name__)

# Deliveries one dispatch pass claims at most; the next pass, a second later, takes more.
MAX_DISPATCH_BATCH = 200

Enqueue = Callable[[str, str], None]


class DeliveryRunner:
    """Dispatches and delivers webhooks for one process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._engine: sqlalchemy.Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._pid: int | None = None

    @property
    def claim_lease(self) -> timedelta:
        """How long a claim keeps other dispatchers off a delivery."""
        return timedelta(seconds=self.settings.webhook_claim_s)

    def sessions(self) -> sessionmaker[Session]:
        """This process's session factory (a forked child builds its own)."""
        if self._sessions is None or self._pid != os.getpid():
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
            self._engine = create_db_engine(self.settings.database_url)
            self._sessions = session_factory(self._engine)
            self._pid = os.getpid()
        return self._sessions

    def close(self) -> None:
        """Release this process's database connections."""
        if self._engine is not None and self._pid == os.getpid():
            self._engine.dispose()
        self._engine = self._sessions = self._pid = None

    def dispatch_due(self, enqueue: Enqueue) -> int:
        """Claim every due delivery and enqueue (delivery_id, claim_token); how many."""
        sessions = self.sessions()
        now = utcnow()
        with sessions() as session:
            delivery_ids = due_delivery_ids(session, now=now, limit=MAX_DISPATCH_BATCH)
        num_dispatched = 0
        for delivery_id in delivery_ids:
            with sessions() as session:
                token = claim_delivery(session, delivery_id=delivery_id, now=now,
                                       lease=self.claim_lease)
                session.commit()
            if token is None:
                continue  # another dispatcher was faster
            # After the commit: if enqueueing fails, the claim simply expires and the
            # delivery is dispatched again.
            enqueue(delivery_id, token)
            num_dispatched += 1
        if num_dispatched:
            logger.debug("dispatched %d webhook deliveries", num_dispatched)
        return num_dispatched

    def deliver(self, delivery_id: str, claim_token: str) -> DeliveryStatus | None:
        """Make one attempt of a claimed delivery; its new status, None if not ours."""
        sessions = self.sessions()
        with sessions() as session:
            delivery = start_attempt(session, delivery_id=delivery_id, claim_token=claim_token,
                                     lease=self.claim_lease)
            if delivery is None:
                logger.info("delivery %s: claim %s is stale, skipped", delivery_id, claim_token)
                return None
            secrets_in_use = signing_secrets(session, tenant_id=delivery.tenant_id)
            session.commit()
            url, webhook_id = delivery.url, delivery.webhook_id
            event_type, num_attempts = delivery.event_type, delivery.num_attempts + 1
            body = json.dumps(delivery.payload, separators=(",", ":")).encode()

        timestamp = int(time.time())
        headers = signature_headers(secrets_in_use=secrets_in_use, webhook_id=webhook_id,
                                    timestamp=timestamp, body=body)
        attempted_at = utcnow()
        try:
            output = attempt_delivery(url=url, body=body, headers=headers,
                                      settings=self.settings)
        except Exception as e:
            # Our fault, not the receiver's: record it and retry on schedule rather than
            # leave the claim to expire and retry forever unrecorded.
            logger.exception("delivery %s: attempt crashed", delivery_id)
            output = AttemptOutput(Verdict.RETRY, None, 0.0,
                                   error=f"internal error: {type(e).__name__}: {e}")
        status, delay = self._next_state(output, num_attempts=num_attempts)

        with sessions() as session:
            record_attempt(
                session,
                delivery_id=delivery_id,
                attempted_at=attempted_at,
                webhook_timestamp=timestamp,
                status_code=output.status_code,
                latency_ms=output.latency_ms,
                error=output.error,
                response_body=output.response_body,
                status=status,
                next_attempt_at=None if delay is None else utcnow() + timedelta(seconds=delay),
            )
            session.commit()
        self._count(event_type, output, status)
        logger.info("delivery %s (%s) attempt %d → %s: %s%s", delivery_id, webhook_id,
                    num_attempts, status.value, output.status_code or "no answer",
                    f" ({output.error})" if output.error else "")
        return status

    def _next_state(
        self, output: AttemptOutput, *, num_attempts: int
    ) -> tuple[DeliveryStatus, float | None]:
        """The delivery's status after this attempt, and seconds until the next one."""
        if output.verdict is Verdict.SUCCEEDED:
            return DeliveryStatus.SUCCEEDED, None
        if output.verdict is Verdict.FAILED:
            return DeliveryStatus.FAILED, None
        delay = retry_delay(num_attempts=num_attempts,
                            schedule=self.settings.webhook_retry_schedule,
                            retry_after_s=output.retry_after_s)
        if delay is None:
            return DeliveryStatus.FAILED, None
        return DeliveryStatus.PENDING, delay

    @staticmethod
    def _count(event_type: str, output: AttemptOutput, status: DeliveryStatus) -> None:
        """Update the Prometheus metrics for one attempt."""
        metrics.WEBHOOK_ATTEMPTS.labels(event_type=event_type).inc()
        metrics.WEBHOOK_ATTEMPT_SECONDS.observe(output.latency_ms / 1000.0)
        if status is DeliveryStatus.SUCCEEDED:
            metrics.WEBHOOK_DELIVERIES_SUCCEEDED.labels(event_type=event_type).inc()
        elif status is DeliveryStatus.FAILED:
            metrics.WEBHOOK_DELIVERIES_FAILED.labels(event_type=event_type).inc()
