"""Tenants' virtual clocks: the fair order of the waiting line within one priority.

Start-time fair queuing over tokens. Every request of a tenant gets a virtual start when it
is queued: the later of the priority's virtual time and where the tenant's previous request
ends (its start plus its cost / the tenant's weight). The waiting line orders equal
priorities and deadlines by that start, so a tenant with 200 requests queued cannot hold
back a later tenant's request for more than its share: the newcomer starts at the current
virtual time, which the first tenant's queued requests stand beyond.

Worked example, weights 1, cost 10 tokens a request: tenant A queues 4 requests at virtual
time 0 (starts 0, 10, 20, 30); one is admitted (virtual time 0); tenant B's request comes
and starts at max(0, 0) = 0, ahead of A's 10, 20 and 30. With A's weight 2, A's starts are
0, 5, 10, 15: A gets two admissions to B's one while both wait.

The priority's virtual time is the largest start admitted so far, so a tenant that was away
comes back at the current time with no credit saved up (no burst after idling), and a lone
tenant's starts rise with its arrivals: its order is its arrival order, as without tenants.
A request without a tenant is queued under the tenant None, which is one more tenant.

Responsible for: stamping `Sequence.virtual_start` (`stamp`) and advancing the virtual time
as sequences are admitted (`on_admit`). Nothing here runs per step, only per request.
"""

from __future__ import annotations

from workers.engine.sequence import Sequence

# Tenants whose clocks are kept before those that fell behind the virtual time (which would
# start at the virtual time anyway) are dropped; keeps the maps bounded whatever the ids.
MAX_CLOCKS = 1024


class TenantClocks:
    """Per priority, the virtual time and each tenant's virtual finish."""

    def __init__(self) -> None:
        self._virtual_time: dict[int, float] = {}  # priority -> largest admitted start
        self._finish: dict[tuple[int, str | None], float] = {}  # (priority, tenant) -> end

    def stamp(self, seq: Sequence) -> None:
        """Give a newly queued sequence its virtual start and advance its tenant's clock by
        its cost (prompt plus the most it may generate) / its tenant's weight."""
        now = self._virtual_time.get(seq.priority, 0.0)
        key = (seq.priority, seq.tenant)
        start = max(now, self._finish.get(key, now))
        seq.virtual_start = start
        self._finish[key] = start + (seq.num_prompt_tokens + seq.params.max_tokens) / seq.weight
        if len(self._finish) > MAX_CLOCKS:
            self._forget_idle()

    def on_admit(self, seq: Sequence) -> None:
        """A waiting sequence was admitted: the virtual time reaches its start."""
        if seq.virtual_start > self._virtual_time.get(seq.priority, 0.0):
            self._virtual_time[seq.priority] = seq.virtual_start

    def _forget_idle(self) -> None:
        for key, finish in list(self._finish.items()):
            if finish <= self._virtual_time.get(key[0], 0.0):
                del self._finish[key]
