"""Served models' cards in Redis: each worker announces what it serves, the API lists them.

A card is a small JSON object (name, kind, context length, weights revision, path) kept
in the hash `<prefix>:models` under the served name. Workers of one model write the same
card, so the last writer wins harmlessly; a worker with new weights overwrites it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

logger = logging.getLogger(__name__)


def cards_key(prefix: str) -> str:
    """The Redis hash holding every served model's card."""
    return f"{prefix}:models"


def publish_card(client: redis.Redis, *, prefix: str, name: str, card: dict[str, Any]) -> None:
    """Store (or replace) the card of the model served as `name`."""
    client.hset(cards_key(prefix), name, json.dumps(card, sort_keys=True))


def read_cards(client: redis.Redis, *, prefix: str) -> dict[str, dict[str, Any]]:
    """Served name → card, for every model a worker announced; {} when Redis is down."""
    try:
        raw: dict[bytes, bytes] = client.hgetall(cards_key(prefix))  # type: ignore[assignment]
    except redis.RedisError as e:
        logger.warning("cannot read model cards from Redis: %s", e)
        return {}
    cards: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        try:
            card = json.loads(value)
        except ValueError:
            logger.warning("model card %r is not JSON; ignoring it", name)
            continue
        if isinstance(card, dict):
            cards[name.decode() if isinstance(name, bytes) else str(name)] = card
    return cards


class CardReader:
    """`read_cards`, read again at most every `max_age_s` for a model that has a card:
    submissions check a model's card on every request, and a card changes only when a
    worker starts. A model without one is looked up afresh each time, so its first worker's
    card counts at once."""

    def __init__(self, client: redis.Redis, *, prefix: str, max_age_s: float = 5.0) -> None:
        self._client = client
        self._prefix = prefix
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._cards: dict[str, dict[str, Any]] = {}
        self._read_at: float | None = None

    def get(self, name: str) -> dict[str, Any] | None:
        """The card of served model `name`, or None."""
        now = time.monotonic()
        with self._lock:
            fresh = self._read_at is not None and now - self._read_at < self._max_age_s
            if fresh and name in self._cards:
                return self._cards[name]
        cards = read_cards(self._client, prefix=self._prefix)
        with self._lock:
            self._cards, self._read_at = cards, now
        return cards.get(name)
