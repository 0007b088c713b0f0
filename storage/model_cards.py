"""Served models' cards in Redis: each worker announces what it serves, the API lists them.

A card is a small JSON object (name, kind, context length, weights revision, path) kept
in the hash `<prefix>:models` under the served name. Workers of one model write the same
card, so the last writer wins harmlessly; a worker with new weights overwrites it.
"""

from __future__ import annotations

import json
import logging
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
