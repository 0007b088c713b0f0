"""The Celery app of the callbacks role: a delivery task and a dispatcher beat.

Responsible for: the Celery configuration (Redis broker from settings.redis_url, late
acks, one prefetched message per worker thread, no result backend), registering the two
tasks on a `DeliveryRunner`, the beat schedule that runs the dispatcher every second (or
every webhook_dispatch_interval_s), and `run_callbacks`, which runs the worker with beat
embedded until SIGTERM.

The retry schedule lives in the database, not in the broker: a delivery waits as a row
with `next_attempt_at`, and the dispatcher turns due rows into short-lived task messages.
So no message waits days in Redis, where it would be redelivered after the visibility
timeout.
"""

from __future__ import annotations

import logging
import os
import socket

from celery import Celery, signals
from prometheus_client import start_http_server

from core.gc_policy import settle_heap
from core.settings import Settings
from scheduler.embedded_services import die_with_parent
from workers.callbacks.runner import DeliveryRunner

logger = logging.getLogger(__name__)

DISPATCH_TASK = "batchinfer.webhooks.dispatch"
DELIVER_TASK = "batchinfer.webhooks.deliver"
# A dispatch message older than this is dropped unrun: the next beat sends a fresh one.
DISPATCH_EXPIRES_S = 10.0
QUIET_CELERY_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace")


def queue_name(settings: Settings) -> str:
    """The Redis list the callbacks role consumes."""
    return f"{settings.topic_prefix}.webhooks"


def create_celery_app(settings: Settings, runner: DeliveryRunner | None = None) -> Celery:
    """A Celery app on settings.redis_url with the dispatch and deliver tasks registered."""
    runner = runner or DeliveryRunner(settings)
    app = Celery("batchinfer.callbacks", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=queue_name(settings),
        task_serializer="json",
        accept_content=["json"],
        enable_utc=True,
        timezone="UTC",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # No shelve file to manage: a one-second schedule has nothing worth persisting.
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            "dispatch-due-webhook-deliveries": {
                "task": DISPATCH_TASK,
                "schedule": settings.webhook_dispatch_interval_s,
                "options": {"expires": DISPATCH_EXPIRES_S},
            }
        },
    )

    @app.task(name=DELIVER_TASK)
    def deliver(delivery_id: str, claim_token: str) -> str | None:
        """Make one attempt of a claimed delivery."""
        status = runner.deliver(delivery_id, claim_token)
        return None if status is None else status.value

    def enqueue(delivery_id: str, claim_token: str) -> None:
        deliver.apply_async(args=(delivery_id, claim_token))

    @app.task(name=DISPATCH_TASK)
    def dispatch() -> int:
        """Claim due deliveries and enqueue a delivery task for each."""
        return runner.dispatch_due(enqueue)

    return app


# The process running the Celery worker; its embedded beat, forked from it, checks that it
# is still its parent.
_worker_pid: int | None = None


@signals.beat_embedded_init.connect
def _beat_dies_with_its_worker(**_: object) -> None:
    """In the embedded beat, a forked child Celery stops only on a warm shutdown: a worker
    killed, or stopped while still starting, left it running for good, dispatching into a
    Redis that was gone. The kernel now sends it SIGTERM when the worker dies; a worker
    gone before this ran leaves it nothing to wait for."""
    die_with_parent()
    if _worker_pid is not None and os.getppid() != _worker_pid:
        os._exit(0)


def worker_argv(settings: Settings) -> list[str]:
    """`celery worker` arguments: threads (deliveries wait on I/O), beat embedded."""
    return [
        "worker",
        "--beat",
        "--pool", "threads",
        "--concurrency", str(settings.webhook_concurrency),
        "--queues", queue_name(settings),
        "--hostname", f"callbacks-{os.getpid()}@{socket.gethostname()}",
        "--loglevel", settings.log_level.upper(),
        "--without-gossip",
        "--without-mingle",
    ]


def run_callbacks(settings: Settings) -> None:
    """Run the callbacks role (Celery worker with beat) until SIGTERM or Ctrl-C."""
    runner = DeliveryRunner(settings)
    app = create_celery_app(settings, runner)
    if settings.log_level.upper() != "DEBUG":
        # The runner logs one line per attempt; Celery's lines for every dispatch message,
        # once a second, would drown them.
        for name in QUIET_CELERY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    if settings.webhook_metrics_port:
        start_http_server(settings.webhook_metrics_port)
        logger.info("callbacks metrics on :%d/metrics", settings.webhook_metrics_port)
    logger.info("callbacks worker on %s, queue %s", settings.redis_url, queue_name(settings))
    settle_heap()
    global _worker_pid
    _worker_pid = os.getpid()
    try:
        app.worker_main(worker_argv(settings))
    finally:
        runner.close()
