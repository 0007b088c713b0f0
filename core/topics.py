"""Priorities and the order workers prefer them in; job topic and consumer group names,
one set per served model."""

from __future__ import annotations

import hashlib
import re
from enum import Enum


class Priority(str, Enum):  # noqa: UP042 (StrEnum would change str(priority))
    """Job priority; each has its own Kafka topic."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for the most urgent; also the engine's priority value (lower runs first)."""
        return PRIORITIES.index(self.value)


# Most urgent first: workers drain topics in this order.
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")


# Kafka topic names allow [a-zA-Z0-9._-], up to 249 characters.
_TOPIC_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")
MAX_SLUG_CHARS = 80


def model_slug(model: str) -> str:
    """The served model name as a topic/group name part an operator can still read.

    Every run of characters Kafka refuses becomes one `-`. A name that had to change gets
    a short hash of the original appended, so two names that differ only in what was
    replaced (`org/m` and `org-m`) never share a topic: `smollm2-135m-instruct` stays as
    it is, `/models/Llama 3` becomes `models-Llama-3-<8 hex digits>`.
    """
    if not model:
        raise ValueError("model name must not be empty")
    slug = _TOPIC_UNSAFE.sub("-", model).strip("-.")[:MAX_SLUG_CHARS] or "model"
    if slug != model:
        slug += "-" + hashlib.blake2b(model.encode(), digest_size=4).hexdigest()
    return slug


def job_topic_names(prefix: str, model: str) -> dict[str, str]:
    """Priority name → `<prefix>.jobs.<model-slug>.<priority>`, most urgent first."""
    slug = model_slug(model)
    return {p: f"{prefix}.jobs.{slug}.{p}" for p in PRIORITIES}


def consumer_group_name(prefix: str, model: str) -> str:
    """`<prefix>.workers.<model-slug>`: one consumer group per served model."""
    return f"{prefix}.workers.{model_slug(model)}"
