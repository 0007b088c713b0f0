"""The active-job cap (api.active_jobs): exact near the cap, a cached count far from it."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from api.active_jobs import MAX_AGE_S, ActiveJobGate
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
