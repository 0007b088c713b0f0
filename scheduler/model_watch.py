"""What `batchinfer up` says about its models as they change: ready, failed, ready again.

"is up" means the API takes jobs; a model can run them only once a worker consumes its
topics, which takes the model's load and a consumer-group join longer. The main loop
polls this twice a second, so the "ready" line follows a worker's first poll by well under
two seconds.
"""

from __future__ import annotations

import logging

import redis

from storage.model_states import ModelState, ModelStatus, read_statuses, reset_models

logger = logging.getLogger(__name__)


class ModelWatch:
    """Lines announcing each model's changes of state, from the states in Redis."""

    def __init__(self, client: redis.Redis, *, prefix: str, names: list[str],
                 live_after_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self._names = names
        self._live_after_s = live_after_s
        self._last: dict[str, ModelState] = {}

    def reset(self) -> None:
        """Forget earlier runs' failures of these models: they were checked just now."""
        reset_models(self._client, prefix=self._prefix, names=self._names)

    def poll(self) -> list[str]:
        """A line per model whose state changed since the last poll (none while Redis is
        away: the next poll catches up)."""
        try:
            statuses = read_statuses(self._client, prefix=self._prefix, names=self._names,
                                     live_after_s=self._live_after_s)
        except redis.RedisError as e:
            logger.debug("cannot read the models' states: %s", e)
            return []
        lines = []
        for name, status in statuses.items():
            if self._last.get(name, ModelState.LOADING) is not status.state:
                lines.append(describe(name, status))
            self._last[name] = status.state
        return lines


def describe(name: str, status: ModelStatus) -> str:
    """One line saying where model `name` stands."""
    if status.state is ModelState.READY:
        return f"model {name} ready: {status.num_live_workers} worker(s) taking jobs"
    if status.state is ModelState.FAILED:
        return (f"model {name} failed to load; new jobs for it are refused (queued ones "
                f"wait): {status.error}")
    return f"model {name} has no worker taking jobs; waiting for one to load it"
