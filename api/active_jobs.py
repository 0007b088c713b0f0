"""The per-tenant cap on active jobs, without counting every queued row on every submission.

Counting a tenant's queued and running jobs is a scan of all of them: with a 50,000-line
batch queued, every submission would read 50,000 rows. `ActiveJobGate` counts at most
once per MAX_AGE_S per tenant while the tenant is far from its cap, adding the jobs this
process admitted since, and counts exactly on every submission once that estimate comes
within NEAR_CAP of the cap. Jobs finishing meanwhile only make the estimate high (a
recount sooner); the cap stays exact near it, except that other API processes' admissions
within MAX_AGE_S are seen at the next count (the cap is a guard, not a quota).

The API shares each count among the requests that need it at once and, far from the cap,
refreshes it in the background from half its life on (`api.submission._admit`), so under
steady traffic no request waits for a count.

A job is admitted before its row is written (by the grouped writer, milliseconds later),
so a count sees neither the jobs admitted while it ran nor those admitted before it and
not yet stored. Both are added to the new count: the jobs admitted and not yet `settle`d
when it began, and every one admitted since. A job stored before the count's snapshot is
then counted twice, until the next count: the error is on the cap's side.
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
# Age from which a count is refreshed in the background, while it is still used.
REFRESH_AFTER_S = MAX_AGE_S / 2
# Fraction of the cap from which every submission counts exactly.
NEAR_CAP = 0.9


@dataclass(slots=True)
class _Count:
    num_active: int
    counted_at: float
    num_admitted_since: int = 0


@dataclass(slots=True)
class _Admissions:
    num_admitted: int = 0  # ever, by this gate
    num_unsettled: int = 0  # admitted, their rows not yet written or refused


class ActiveJobGate:
    """Admits a tenant's submission while its active jobs stay below `cap`."""

    def __init__(self, cap: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, _Count] = {}
        self._admissions: dict[str, _Admissions] = {}

    def admit_without_count(self, *, tenant_id: str) -> bool:
        """Take a slot if a recent count shows the tenant far from its cap; False when only
        a count can tell (then call `admit`). Never touches the database."""
        now = self._clock()
        with self._lock:
            known = self._counts.get(tenant_id)
            if (known is not None and now - known.counted_at < MAX_AGE_S
                    and known.num_active + known.num_admitted_since < self.cap * NEAR_CAP):
                self._take(tenant_id, known)
                return True
        return False

    def settle(self, *, tenant_id: str) -> None:
        """An admitted job's row was written, or will never be: call once per admission."""
        with self._lock:
            self._admissions[tenant_id].num_unsettled -= 1

    def _take(self, tenant_id: str, known: _Count) -> None:
        known.num_admitted_since += 1
        admissions = self._admissions.setdefault(tenant_id, _Admissions())
        admissions.num_admitted += 1
        admissions.num_unsettled += 1

    def admit(self, session: Session, *, tenant_id: str) -> bool:
        """Take a slot for one more job of the tenant; False when it is at its cap."""
        if self.admit_without_count(tenant_id=tenant_id):
            return True
        self.count(session, tenant_id=tenant_id)
        return self.admit_counted(tenant_id=tenant_id)

    def count(self, session: Session, *, tenant_id: str) -> None:
        """Count the tenant's active jobs now; admissions go against this count from here
        (with those it cannot see: module docstring)."""
        with self._lock:
            before = self._admissions.get(tenant_id) or _Admissions()
            num_admitted, num_unsettled = before.num_admitted, before.num_unsettled
        now = self._clock()
        num_active = count_active_jobs(session, tenant_id=tenant_id)
        with self._lock:
            known = self._counts.get(tenant_id)
            if known is None or known.counted_at <= now:
                after = self._admissions.get(tenant_id) or _Admissions()
                unseen = num_unsettled + after.num_admitted - num_admitted
                self._counts[tenant_id] = _Count(num_active, now, unseen)

    def admit_counted(self, *, tenant_id: str) -> bool:
        """Take a slot against the latest count (call `count` first), however near the cap.

        Requests that shared one count are admitted one by one against it, each seeing
        the others' slots: never more than the cap, where a count each would have let all
        of them in on the same number.
        """
        with self._lock:
            known = self._counts[tenant_id]
            admitted = known.num_active + known.num_admitted_since < self.cap
            if admitted:
                self._take(tenant_id, known)
            return admitted

    def wants_recount(self, *, tenant_id: str) -> bool:
        """The tenant's count is past half its life: count again before anyone must wait.

        Far from the cap a count ran once a second in front of every request in flight
        (~30-100 ms with tens of thousands of jobs queued: the API's p99). Recounted in
        the background at half-life, the count a request needs is always fresh.
        """
        with self._lock:
            known = self._counts.get(tenant_id)
            return known is not None and self._clock() - known.counted_at >= REFRESH_AFTER_S
