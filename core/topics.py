"""Priorities and the order workers prefer them in."""

from __future__ import annotations

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
