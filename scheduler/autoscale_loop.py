"""The autoscaler's loop: read the workers' lag, decide, scale.

Responsible for:
- reading lag and partition counts of one served model's job topics for its workers'
  consumer group over one long-lived Kafka client (LagReader); with several models,
  each has its own reader, autoscaler and loop, so each is sized by its own lag;
- feeding each reading, or its failure, to the Autoscaler; exporting the desired count
  and the weighted lag per priority; logging every change with its reason;
- calling a scale_to hook when the count changes.

The local Supervisor must be driven from the main thread, while a Kafka read may block
for seconds; so `batchinfer up` runs the loop on its own thread with a MainThreadScaler as
the hook, and its main loop applies the latest count the autoscaler asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from kafka import KafkaConsumer

from core import metrics
from core.kafka import CLIENT_ID, TopicLag, make_consumer, topic_lag
from core.settings import Settings
from scheduler.autoscaler import Autoscaler, ScaleDecision
from scheduler.periodic import Periodic

logger = logging.getLogger(__name__)

# Added to the session timeout to bound each broker round trip of a reading, so an
# unreachable broker shows up as a failed reading (count kept, logged) within seconds,
# not kafka-python's default 30 s (3.x) or 5 min (2.3). kafka-python 2.3 refuses a request
# timeout at or below the session timeout for a consumer with a group, though this one
# never joins it.
LAG_READ_TIMEOUT_MARGIN_MS = 1000


class LagReader:
    """Topic → lag of one model's workers' group, over one consumer created on first use."""

    def __init__(self, settings: Settings, *, model: str | None = None) -> None:
        self.settings = settings
        # The served model whose topics and group are read (default: the settings' own).
        self.model = model or settings.served_model_name
        self.job_topics = settings.job_topics_for(self.model)
        self._consumer: KafkaConsumer | None = None

    def __call__(self) -> dict[str, TopicLag]:
        """Read the job topics' lag and partition counts; raises what the client raises."""
        if self._consumer is None:
            # Kept between readings: it never subscribes (so never joins the group) and
            # reconnects by itself, whereas a fresh client waits out a 30 s bootstrap on
            # every reading while the broker is down.
            self._consumer = make_consumer(
                self.settings, group_id=self.settings.consumer_group_for(self.model),
                client_id=f"{CLIENT_ID}-autoscaler",
                request_timeout_ms=(self.settings.kafka_session_timeout_ms
                                    + LAG_READ_TIMEOUT_MARGIN_MS))
        return topic_lag(self._consumer, list(self.job_topics.values()))

    def close(self) -> None:
        """Close the client, if one was made."""
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None


class AutoscaleLoop:
    """Every interval_s: one reading → one decision → scale_to when the count changed."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        *,
        read_lag: Callable[[], Mapping[str, TopicLag]],
        scale_to: Callable[[int], None],
        job_topics: Mapping[str, str],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        model: str | None = None,
        read_deadline_floor: Callable[[], int] | None = None,
    ) -> None:
        self.autoscaler = autoscaler
        # Named in the log lines and the metrics' `model` label, where several models each
        # have a loop.
        self.model = model
        self.read_lag = read_lag
        self.scale_to = scale_to
        self.job_topics = job_topics
        self.interval_s = interval_s
        self.clock = clock
        # Workers the queued deadlines need (None: lag alone decides).
        self.read_deadline_floor = read_deadline_floor
        self._is_failing = False

    def step(self) -> ScaleDecision:
        """Read the lag once, decide, export, and scale when the count changed."""
        now = self.clock()
        try:
            found = self.read_lag()
        except Exception as e:  # whatever went wrong, the workers keep running
            metrics.AUTOSCALER_LAG_READ_ERRORS.inc()
            decision = self.autoscaler.observe_error(f"{type(e).__name__}: {e}")
            # Once per outage at WARNING: readings repeat every few seconds.
            logger.log(logging.DEBUG if self._is_failing else logging.WARNING, "%s",
                       decision.reason)
            self._is_failing = True
            return decision
        if self._is_failing:
            logger.info("lag readable again")
            self._is_failing = False
        lag = {p: found[topic].lag for p, topic in self.job_topics.items() if topic in found}
        # Workers consume every job topic in one group; the range assignor gives each
        # topic's partitions to as many members as it has partitions, so the largest topic
        # bounds the workers that get any work.
        num_partitions = max((found[t].num_partitions for t in self.job_topics.values()
                              if t in found), default=0)
        decision = self.autoscaler.observe(lag, num_partitions=num_partitions, now=now,
                                           num_for_deadlines=self._deadline_floor())
        model = self.model or ""
        for priority, weighted in decision.weighted_lag.items():
            metrics.AUTOSCALER_WEIGHTED_LAG.labels(model, priority).set(weighted)
        metrics.AUTOSCALER_DESIRED_WORKERS.labels(model).set(decision.num_workers)
        if decision.is_change:
            logger.info("autoscaling workers%s %d → %d: %s",
                        f" of {self.model}" if self.model else "", decision.num_previous,
                        decision.num_workers, decision.reason)
            self.scale_to(decision.num_workers)
        else:
            logger.debug("keeping %d workers: %s", decision.num_workers, decision.reason)
        return decision

    def _deadline_floor(self) -> int:
        if self.read_deadline_floor is None:
            return 0
        try:
            return self.read_deadline_floor()
        except Exception as e:  # the lag still decides; the next reading tries again
            logger.warning("cannot read queued deadlines: %s", e)
            return 0

    def run(self, stop: threading.Event) -> None:
        """Step now and every interval_s until stop is set; a failed step is not fatal."""
        Periodic(self.step, self.interval_s, "autoscaler").run(stop)


class MainThreadScaler:
    """A scale_to hook any thread may call; the main thread applies the latest count."""

    def __init__(self, scale_to: Callable[[int], None]) -> None:
        self._scale_to = scale_to
        self._lock = threading.Lock()
        self._num_pending: int | None = None

    def __call__(self, num_workers: int) -> None:
        """Remember num_workers; an earlier count not yet applied is superseded."""
        with self._lock:
            self._num_pending = num_workers

    def apply(self) -> None:
        """Call the wrapped scale_to with the count last asked for, if any (main thread)."""
        with self._lock:
            num_workers, self._num_pending = self._num_pending, None
        if num_workers is not None:
            self._scale_to(num_workers)
