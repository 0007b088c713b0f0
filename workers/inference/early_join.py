"""Joining the consumer group while the engine loads, for a model no live worker serves.

Responsible for: deciding whether a starting worker may join before its load (no worker
of its model consumes: nothing could take those partitions in the meantime), polling the
group in the background with every assigned partition paused until the worker is ready,
and handing the consumer, joined, to the worker's own rebalance listener.

A group join costs seconds on its own: the embedded broker holds each one for half the
session timeout (3 s at `up`'s 6 s), and Kafka waits for the group's members to rejoin.
A worker that joins only after its load makes its first job wait that long too; this one
has joined by then. A worker of a model others already serve still joins after its load,
so that it never holds partitions through a load that its peers could be serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import redis
from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition

from storage.model_states import read_statuses

logger = logging.getLogger(__name__)

# Milliseconds each background poll may wait: how soon the hand-over finds it done.
POLL_MS = 100
# Seconds the hand-over waits for the background poll to return.
HAND_OVER_TIMEOUT_S = 10.0


def no_live_worker(client: redis.Redis, *, prefix: str, name: str,
                   live_after_s: float) -> bool:
    """Whether no worker consumes for model `name` now; False when Redis cannot say."""
    try:
        status = read_statuses(client, prefix=prefix, names=[name],
                               live_after_s=live_after_s)[name]
    except redis.RedisError as e:
        logger.info("joining after the load: cannot read the workers of %s (%s)", name, e)
        return False
    return status.num_live_workers == 0


class EarlyJoin(ConsumerRebalanceListener):
    """The consumer's listener from subscription on: pauses whatever is assigned until the
    hand-over, then passes every rebalance to the worker's listener."""

    def __init__(self, consumer: KafkaConsumer, topics: list[str]) -> None:
        self.consumer = consumer  # the worker's from the hand-over on
        self._topics = topics
        # Guards the hand-over against a rebalance callback on kafka-python's own thread.
        self._lock = threading.Lock()
        self._target: ConsumerRebalanceListener | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="early-join", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EarlyJoin:
        """Subscribe, and keep polling the group on a thread until the hand-over."""
        self.consumer.subscribe(self._topics, listener=self)
        logger.info("joining the group while the engine loads")
        self._thread.start()
        return self

    def hand_over(self, listener: ConsumerRebalanceListener) -> None:
        """Stop polling; `listener` gets the current assignment, resumed, and every
        rebalance from now on. Called on the thread that polls from now on."""
        self._stop.set()
        self._thread.join(HAND_OVER_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError("the early group join's poll did not return")
        with self._lock:
            self._target = listener
            assigned = set(self.consumer.assignment())
            if assigned:
                self.consumer.resume(*assigned)
                listener.on_partitions_assigned(assigned)
        logger.info("joined while loading: %d partition(s) assigned", len(assigned))

    def abandon(self) -> None:
        """Stop polling without a hand-over (the load failed); the consumer is closed by
        its owner."""
        self._stop.set()
        self._thread.join(HAND_OVER_TIMEOUT_S)

    def _poll(self) -> None:
        try:
            while not self._stop.is_set():
                # Everything assigned is paused, so this only joins and keeps the member
                # alive; a record fetched before its pause is refetched from the
                # committed offset after the hand-over (the worker restarts there).
                self.consumer.poll(timeout_ms=POLL_MS)
        except Exception as e:  # the worker's own poll meets the same fault and reports it
            logger.warning("early group join stopped: %s", e)
            self.error = e

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        with self._lock:
            if self._target is not None:
                self._target.on_partitions_revoked(revoked)

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        partitions = set(assigned)
        with self._lock:
            if self._target is not None:
                self._target.on_partitions_assigned(partitions)
            elif partitions:
                self.consumer.pause(*partitions)
                logger.info("partitions assigned while loading (paused): %s",
                            sorted(f"{tp.topic}-{tp.partition}" for tp in partitions))

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        with self._lock:
            if self._target is not None:
                self._target.on_partitions_lost(lost)
