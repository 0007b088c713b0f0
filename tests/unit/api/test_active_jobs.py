"""The active-job cap (api.active_jobs): exact near the cap, a cached count far from it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from api.active_jobs import MAX_AGE_S, REFRESH_AFTER_S, ActiveJobGate
from api.auth import CurrentTenant
from api.errors import RateLimited
from api.single_flight import SingleFlight
from api.submission import _admit
from storage.jobs import create_job
from storage.tenants import create_tenant
from tests.utils.clock import ManualClock


def _tenant_with_jobs(sessions: sessionmaker[Session], num_jobs: int) -> str:
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        for i in range(num_jobs):
            create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                       kind="text_completion", request={"prompt": f"p{i}"})
        session.commit()
        return tenant.id


@dataclass
class _Watched:
    """A tenant with jobs, a gate on a manual clock, and the SQL run from then on."""

    tenant_id: str
    clock: ManualClock
    gate: ActiveJobGate
    statements: list[str]

    @property
    def num_counts(self) -> int:
        """COUNT queries run so far."""
        return sum("count" in sql.lower() for sql in self.statements)


def _watched(sessions: sessionmaker[Session], *, num_jobs: int, cap: int) -> _Watched:
    tenant_id = _tenant_with_jobs(sessions, num_jobs)
    clock = ManualClock(0.0)
    statements: list[str] = []
    event.listen(sessions.kw["bind"], "before_cursor_execute",
                 lambda conn, cursor, sql, *args: statements.append(sql))
    return _Watched(tenant_id, clock, ActiveJobGate(cap, clock=clock), statements)


def test_far_from_the_cap_the_count_is_reused_until_it_ages(
    sessions: sessionmaker[Session],
) -> None:
    w = _watched(sessions, num_jobs=10, cap=1000)
    with sessions() as session:
        assert all(w.gate.admit(session, tenant_id=w.tenant_id) for _ in range(50))
        assert w.num_counts == 1
        w.clock.now += MAX_AGE_S
        assert w.gate.admit(session, tenant_id=w.tenant_id)
    assert w.num_counts == 2


def test_near_the_cap_every_submission_counts_exactly(sessions: sessionmaker[Session]) -> None:
    tenant_id = _tenant_with_jobs(sessions, 8)
    gate = ActiveJobGate(10, clock=ManualClock(0.0))
    with sessions() as session:
        # 8 active: counted, admitted. Then two more rows appear (another process's);
        # the estimate (8 + the 1 admitted) is within 90% of the cap, so the next
        # submission counts again, sees 10, and is refused, where a cached count would not.
        assert gate.admit(session, tenant_id=tenant_id)
        create_job(session, tenant_id=tenant_id, priority="normal", model="m",
                   kind="text_completion", request={"prompt": "ninth"})
        create_job(session, tenant_id=tenant_id, priority="normal", model="m",
                   kind="text_completion", request={"prompt": "tenth"})
        session.commit()
        assert not gate.admit(session, tenant_id=tenant_id)


def test_admission_without_a_count_needs_a_recent_one_far_from_the_cap(
    sessions: sessionmaker[Session],
) -> None:
    """The event loop's path: never a SELECT; False sends the caller to a counting admit."""
    w = _watched(sessions, num_jobs=8, cap=1000)
    assert not w.gate.admit_without_count(tenant_id=w.tenant_id)
    with sessions() as session:
        assert w.gate.admit(session, tenant_id=w.tenant_id)
    assert w.gate.admit_without_count(tenant_id=w.tenant_id)
    w.clock.now += MAX_AGE_S
    assert not w.gate.admit_without_count(tenant_id=w.tenant_id)
    assert w.num_counts == 1
    near = ActiveJobGate(9, clock=w.clock)
    with sessions() as session:
        assert near.admit(session, tenant_id=w.tenant_id)
    assert not near.admit_without_count(tenant_id=w.tenant_id)


def test_requests_sharing_a_count_are_admitted_one_by_one_against_it(
    sessions: sessionmaker[Session],
) -> None:
    """8 active, cap 10, five requests on one count: two slots, whoever asks first."""
    w = _watched(sessions, num_jobs=8, cap=10)
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
    assert [w.gate.admit_counted(tenant_id=w.tenant_id) for _ in range(5)] == [
        True, True, False, False, False]
    assert w.num_counts == 1


def test_a_count_wants_refreshing_at_half_life_while_still_used(
    sessions: sessionmaker[Session],
) -> None:
    w = _watched(sessions, num_jobs=3, cap=1000)
    assert not w.gate.wants_recount(tenant_id=w.tenant_id)  # nothing to refresh yet
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
    w.clock.now += REFRESH_AFTER_S - 0.01
    assert not w.gate.wants_recount(tenant_id=w.tenant_id)
    w.clock.now += 0.01
    assert w.gate.wants_recount(tenant_id=w.tenant_id)
    assert w.gate.admit_without_count(tenant_id=w.tenant_id)  # still good to use
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
    assert not w.gate.wants_recount(tenant_id=w.tenant_id)


class _Admitting:
    """What `api.submission._admit` uses of the app's resources, on a real database."""

    def __init__(self, sessions: sessionmaker[Session], gate: ActiveJobGate) -> None:
        self.sessions = sessions
        self.active_jobs = gate
        self.active_counts: SingleFlight[None] = SingleFlight()
        self.settings = SimpleNamespace(tenant_max_active_jobs=gate.cap)
        self.limiter = self  # the rate limit is not under test: it admits everyone

    async def retry_after_s(self, tenant_id: str) -> None:
        return None

    async def submit(self, tenant_id: str, num: int) -> list[Any]:
        """`num` concurrent admissions: None for each admitted, else what refused it."""
        tenant = CurrentTenant(id=tenant_id, name="acme")
        resources: Any = self
        return await asyncio.gather(*(_admit(tenant, resources) for _ in range(num)),
                                    return_exceptions=True)


def test_submissions_in_flight_share_one_count_and_never_wait_for_a_refresh(
    sessions: sessionmaker[Session],
) -> None:
    w = _watched(sessions, num_jobs=5, cap=1000)
    resources = _Admitting(sessions, w.gate)
    # No count yet: all 32 wait for one.
    assert asyncio.run(resources.submit(w.tenant_id, 32)) == [None] * 32
    assert w.num_counts == 1
    w.clock.now += REFRESH_AFTER_S

    async def refreshed_behind() -> None:
        # Admitted on the aging count; one recount starts.
        assert await resources.submit(w.tenant_id, 32) == [None] * 32
        assert w.num_counts == 1 and len(resources.active_counts) == 1
        while len(resources.active_counts):
            await asyncio.sleep(0.01)

    asyncio.run(refreshed_behind())
    assert w.num_counts == 2
    assert not w.gate.wants_recount(tenant_id=w.tenant_id)


def test_the_cap_refuses_with_429_once_the_shared_count_is_spent(
    sessions: sessionmaker[Session],
) -> None:
    w = _watched(sessions, num_jobs=8, cap=10)
    outcomes = asyncio.run(_Admitting(sessions, w.gate).submit(w.tenant_id, 5))
    assert outcomes.count(None) == 2
    refused = [o for o in outcomes if o is not None]
    assert len(refused) == 3 and all(isinstance(o, RateLimited) for o in refused)
    assert refused[0].code == "too_many_active_jobs"
    assert w.num_counts == 1


def _add_jobs(sessions: sessionmaker[Session], tenant_id: str, num: int) -> None:
    """Rows of admitted jobs, as the writer stores them."""
    with sessions() as session:
        for i in range(num):
            create_job(session, tenant_id=tenant_id, priority="normal", model="m",
                       kind="text_completion", request={"prompt": f"stored {i}"})
        session.commit()


def test_a_count_adds_the_admitted_jobs_it_cannot_see_yet(
    sessions: sessionmaker[Session],
) -> None:
    """5 active, cap 10, 3 admitted whose rows are not written yet: the next count sees 5
    rows and still leaves 2 slots, not 5. Once their rows are written and settled, a count
    sees them as rows instead."""
    w = _watched(sessions, num_jobs=5, cap=10)
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
        assert [w.gate.admit_counted(tenant_id=w.tenant_id) for _ in range(3)] == [True] * 3
        w.clock.now += MAX_AGE_S
        w.gate.count(session, tenant_id=w.tenant_id)
        assert [w.gate.admit_counted(tenant_id=w.tenant_id) for _ in range(3)] == [
            True, True, False]
        _add_jobs(sessions, w.tenant_id, 5)
        for _ in range(5):
            w.gate.settle(tenant_id=w.tenant_id)
        w.clock.now += MAX_AGE_S
        w.gate.count(session, tenant_id=w.tenant_id)
        assert not w.gate.admit_counted(tenant_id=w.tenant_id)  # 10 rows, none unseen


def test_a_count_adds_the_jobs_admitted_while_it_ran(sessions: sessionmaker[Session]) -> None:
    """Two admissions during the COUNT itself (rows not written): 5 + 2, three slots left."""
    w = _watched(sessions, num_jobs=5, cap=10)
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
    admitted_meanwhile: list[bool] = []

    def admit_twice(conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        if "count" in sql.lower() and not admitted_meanwhile:
            admitted_meanwhile.extend(w.gate.admit_counted(tenant_id=w.tenant_id)
                                      for _ in range(2))

    event.listen(sessions.kw["bind"], "before_cursor_execute", admit_twice)
    w.clock.now += MAX_AGE_S
    with sessions() as session:
        w.gate.count(session, tenant_id=w.tenant_id)
    assert admitted_meanwhile == [True, True]
    assert [w.gate.admit_counted(tenant_id=w.tenant_id) for _ in range(4)] == [
        True, True, True, False]
