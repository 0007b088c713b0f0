"""The autoscaler on the real broker: lag it reads there sets a Supervisor's worker count."""

from __future__ import annotations

import sys
import time

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata
from prometheus_client import REGISTRY

from core.kafka import ensure_topics, make_consumer, make_producer
from core.settings import Settings
from scheduler.autoscale_loop import AutoscaleLoop, LagReader
from scheduler.autoscaler import AutoscalePolicy, Autoscaler
from scheduler.supervisor import Supervisor

# A stand-in worker: the test is about how many run, not what they do.
IDLE_WORKER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _produce(s: Settings, priority: str, num_records: int) -> None:
    # One record per produce request: the embedded broker's latest offset counts a
    # multi-record batch as one record.
    producer = make_producer(s, batch_size=0)
    try:
        for i in range(num_records):
            producer.send(s.job_topics[priority], value=b"job %d" % i)
            producer.flush()
    finally:
        producer.close()


def _commit_everything(s: Settings) -> None:
    """What workers do once every job is stored: commit each partition's end offset."""
    consumer = make_consumer(s)
    try:
        partitions = [TopicPartition(topic, p) for topic in s.job_topics.values()
                      for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(partitions)
        consumer.commit({tp: OffsetAndMetadata(end, "", -1)
                         for tp, end in consumer.end_offsets(partitions).items()})
    finally:
        consumer.close()


def test_lag_on_the_broker_scales_workers_up_then_down_after_the_cooldown(settings) -> None:
    """Weighted lag 10 at 4 per worker → 3 workers; more lag stops at the 3 partitions;
    once a consumer commits, the count drops to the minimum only after the cooldown."""
    s = settings(topic_partitions=3, autoscale_min_workers=1, autoscale_max_workers=4,
                 autoscale_lag_threshold=4, autoscale_cooldown_s=30)
    ensure_topics(s)
    now = [0.0]
    supervisor = Supervisor(IDLE_WORKER, num_workers=1)
    reader = LagReader(s)
    loop = AutoscaleLoop(Autoscaler(AutoscalePolicy.from_settings(s), num_workers=1),
                         read_lag=reader, scale_to=supervisor.scale_to,
                         job_topics=s.job_topics, interval_s=s.autoscale_interval_s,
                         clock=lambda: now[0], model=s.served_model_name)
    supervisor.start()
    try:
        # 2 high × 4 + 1 normal × 1 + 4 low × 0.25 = 10 → ceil(10 / 4) = 3 (unweighted, 2).
        _produce(s, "high", 2)
        _produce(s, "normal", 1)
        _produce(s, "low", 4)
        decision = loop.step()
        assert decision.weighted_lag == {"high": 8.0, "normal": 1.0, "low": 1.0}
        assert (decision.num_previous, decision.num_workers) == (1, 3)
        assert supervisor.num_running == 3
        assert REGISTRY.get_sample_value("batchinfer_autoscaler_desired_workers",
                                         {"model": s.served_model_name}) == 3.0

        _produce(s, "high", 4)  # weighted 26 asks for 7; max_workers 4; partitions 3
        now[0] += 5
        decision = loop.step()
        assert decision.num_workers == 3 and "3 partitions" in decision.reason

        _commit_everything(s)
        now[0] += 5
        decision = loop.step()
        assert sum(decision.weighted_lag.values()) == 0
        assert decision.num_workers == 3, "scale-down waits for the cooldown"
        now[0] += 29
        assert loop.step().num_workers == 3
        now[0] += 1
        decision = loop.step()
        assert (decision.num_previous, decision.num_workers) == (3, 1)

        deadline = time.monotonic() + 10
        while len(supervisor.slots) > 1:
            assert time.monotonic() < deadline, "surplus workers did not drain"
            supervisor.poll()
            time.sleep(0.05)
        assert supervisor.num_running == 1 and supervisor.slots[0].index == 0
    finally:
        reader.close()
        supervisor.stop(timeout=5)
