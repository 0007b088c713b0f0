"""How many CPU threads the engine's ops use, following what other processes leave free.

Responsible for one thing: between steps, every `interval` seconds, measure how much CPU
the rest of the machine used (all cores' busy time from /proc/stat, less this process's own
CPU time) and set torch's intra-op thread count to the cores left, never above the count
it started with and never below one.

Why: torch's OpenMP team spin-waits at every op's barrier. When another busy process holds
one of two cores, each op waits for a descheduled team member while the waiting thread
burns its own slice spinning; a SmolLM2-135M decode step then takes several times the CPU
time it takes alone. One thread per free core never waits for a thread that is not running.
Worked example on 2 cores: the engine on 2 threads plus one busy loop gives the loop about
2/3 of a core (three runnable threads), so 2 - 0.67 rounds to 1 thread; once alone, the
loop's share is 1 core and the engine stays at 1 until the loop ends (2 - 0 = 2).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_PROC_STAT = Path("/proc/stat")
_IDLE_FIELDS = (3, 4)  # idle and iowait, after the "cpu" label
_GUEST_FIELDS = (8, 9)  # guest time is already counted in user time


class CpuThreadGovernor:
    """Sets torch.set_num_threads to the cores other processes leave free (see module doc)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.max_threads = torch.get_num_threads()
        self.num_threads = self.max_threads
        self.interval = interval
        self._ticks_per_second = os.sysconf("SC_CLK_TCK")
        self._last = self._sample() if self.is_enabled else None

    @property
    def is_enabled(self) -> bool:
        """Only with more than one thread to give back, and a /proc/stat to read."""
        return self.max_threads > 1 and _PROC_STAT.is_file()

    def adjust(self) -> None:
        """Re-measure once `interval` has passed since the last measurement; cheap otherwise."""
        if self._last is None:
            return
        now = time.monotonic()
        if now - self._last[0] < self.interval:
            return
        current = self._sample()
        wall = current[0] - self._last[0]
        busy = current[1] - self._last[1]
        own = current[2] - self._last[2]
        self._last = current
        others = max(0.0, (busy - own) / wall)  # cores' worth of other processes' work
        wanted = max(1, min(self.max_threads, round(self.max_threads - others)))
        if wanted != self.num_threads:
            logger.debug("CPU threads %d -> %d (others use %.2f cores)",
                         self.num_threads, wanted, others)  # fmt: skip
            torch.set_num_threads(wanted)
            self.num_threads = wanted

    def _sample(self) -> tuple[float, float, float]:
        """(monotonic time, all cores' busy seconds, this process's CPU seconds)."""
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
        idle = sum(ticks[i] for i in _IDLE_FIELDS if i < len(ticks))
        guest = sum(ticks[i] for i in _GUEST_FIELDS if i < len(ticks))
        busy = (sum(ticks) - idle - guest) / self._ticks_per_second
        return time.monotonic(), busy, time.process_time()
