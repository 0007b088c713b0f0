"""Keeping one embedded child service (the broker, Redis) alive for `batchinfer up`.

Responsible for:
- noticing that the service's process exited on its own, logging it with its exit code;
- starting it again on the same port after an exponential backoff (a service that keeps
  dying does not spin the CPU), the backoff resetting once it has stayed up a while;
- counting each restart in `batchinfer_embedded_service_restarts_total{service=...}`;
- telling the caller, once the service answers again, so it can restore what the
  service lost (the memory-only broker comes back without topics or messages).

`poll()` runs on the main thread of `batchinfer up`: the child's parent-death signal
follows the thread that started it, and that thread lives as long as the stack.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from core.metrics import EMBEDDED_SERVICE_RESTARTS
from scheduler.embedded_services import ChildService

logger = logging.getLogger(__name__)

# Seconds a restarted service gets to answer on its port before the attempt counts as
# failed (both services start in well under a second on an idle machine).
RESTART_READY_TIMEOUT_S = 20.0


class ServiceKeeper:
    """Restarts `service` with backoff whenever poll() finds it dead."""

    def __init__(
        self,
        service: ChildService,
        *,
        on_restart: Callable[[], None] | None = None,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
    ) -> None:
        if not 0 <= min_backoff_s <= max_backoff_s:
            raise ValueError(f"backoff must satisfy 0 <= min ({min_backoff_s}) <= max "
                             f"({max_backoff_s})")
        self.service = service
        self.on_restart = on_restart
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.num_restarts = 0
        self.backoff_s = 0.0
        self._started_at = time.monotonic()
        # Set while the service is down: when it died, and when the next attempt is due.
        self._down_since: float | None = None
        self._next_attempt_at = 0.0

    @property
    def is_down(self) -> bool:
        """True from the moment poll() found the service dead until it answers again."""
        return self._down_since is not None

    def poll(self) -> None:
        """Notice a dead service, and restart it once its backoff has passed."""
        now = time.monotonic()
        if self._down_since is None:
            if self.service.is_running:
                return
            self._on_death(now)
        if now >= self._next_attempt_at:
            self._attempt(now)

    def _on_death(self, now: float) -> None:
        uptime = now - self._started_at
        # A service that ran a good while crashed once; one that died soon after its
        # last restart is in a loop, and each retry waits twice as long.
        if uptime >= self.healthy_after_s:
            self.backoff_s = self.min_backoff_s
        else:
            self.backoff_s = min(self.max_backoff_s,
                                 max(self.min_backoff_s, self.backoff_s * 2))
        self._down_since = now
        self._next_attempt_at = now + self.backoff_s
        logger.error("%s (pid %s) exited with code %s after %.1fs; restarting it in %.1fs",
                     self.service.name, self.service.pid, self.service.returncode, uptime,
                     self.backoff_s)

    def _attempt(self, now: float) -> None:
        assert self._down_since is not None
        try:
            self.service.start(timeout=RESTART_READY_TIMEOUT_S)
        except (RuntimeError, OSError) as e:
            self.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, self.backoff_s * 2))
            self._next_attempt_at = time.monotonic() + self.backoff_s
            logger.error("restarting %s failed; next attempt in %.1fs: %s", self.service.name,
                         self.backoff_s, e)
            return
        self.num_restarts += 1
        EMBEDDED_SERVICE_RESTARTS.labels(service=self.service.name).inc()
        self._started_at = time.monotonic()
        logger.warning("restarted %s (pid %s) on port %d, %.1fs after it died (restart %d)",
                       self.service.name, self.service.pid, self.service.port,
                       self._started_at - self._down_since, self.num_restarts)
        self._down_since = None
        if self.on_restart is not None:
            try:
                self.on_restart()
            except Exception:
                logger.exception("restoring state after restarting %s failed", self.service.name)
