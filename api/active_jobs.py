"""The per-tenant cap on active jobs, without counting every queued row on every submission.

Counting a tenant's queued and running jobs is a scan of all of them: with a 50,000-line
batch queued, every submission would read 50,000 rows. `ActiveJobGate` counts at most
once per MAX_AGE_S per tenant while the tenant is far from its cap, adding the jobs this
process admitted since, and counts exactly on every submission once that estimate comes
within NEAR_CAP of the cap. Jobs finishing meanwhile only make the estimate high (a
recount sooner); the cap stays exact near it, except that other API processes' admissions
within MAX_AGE_S are seen at the next count (the cap is a guard, not a quota).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from storage.jobs import count_active_jobs

# Longest a tenant's count is reused while far from the cap, seconds.
MAX_AGE_S = 1.0
# Fraction of the cap from which every submission counts exactly.
NEAR_CAP = 0.9


@dataclass(slots=True)
class _Count:
    num_active: int
    counted_at: float
    num_admitted_since: int = 0


class ActiveJobGate:
    """Admits a tenant's submission while its active jobs stay below `cap`."""

    def __init__(self, cap: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, _Count] = {}

    def admit_without_count(self, *, tenant_id: str) -> bool:
        """Take a slot if a recent count shows the tenant far from its cap; False when only
        a count can tell (then call `admit`). Never touches the database."""
        now = self._clock()
        with self._lock:
            known = self._counts.get(tenant_id)
            if (known is not None and now - known.counted_at < MAX_AGE_S
                    and known.num_active + known.num_admitted_since < self.cap * NEAR_CAP):
                known.num_admitted_since += 1
                return True
        return False

    def admit(self, session: Session, *, tenant_id: str) -> bool:
        """Take a slot for one more job of the tenant; False when it is at its cap."""
        if self.admit_without_count(tenant_id=tenant_id):
            return True
        now = self._clock()
        num_active = count_active_jobs(session, tenant_id=tenant_id)
        with self._lock:
            admitted = num_active < self.cap
            self._counts[tenant_id] = _Count(num_active, now, int(admitted))
        return admitted
