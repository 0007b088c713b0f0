"""What the worker's fair share needs per record and per tenant: whose it is, and its weight.

`record_tenant` reads the tenant id from a job record's value without decoding the whole
message: `JobMessage.encode` writes fields in declaration order, so `"tenant_id"` comes
within the first bytes (after `v` and `job_id`). A record it cannot read counts as tenant
"" (one more tenant, never an error: the decode that follows reports bad records).

`TenantWeights` holds every tenant's weight (`batchinfer tenants set-limits --weight`),
re-read at most every REFRESH_S on the worker's thread (one small query); a read that
fails keeps the last weights.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Bytes of a record's value searched for the tenant id.
HEAD_BYTES = 256
REFRESH_S = 10.0
_TENANT_FIELD = re.compile(rb'"tenant_id":"([^"\\]{1,64})"')
_READABLE_TENANT = re.compile(r'[^"\\]{1,64}')


def record_tenant(record: Any) -> str:
    """The tenant id in a job record's value, or "" when it cannot be read."""
    value = getattr(record, "value", None)
    if not isinstance(value, bytes | bytearray):
        return ""
    found = _TENANT_FIELD.search(value, 0, HEAD_BYTES)
    return found.group(1).decode("ascii", "replace") if found else ""


def message_tenant(tenant_id: str) -> str:
    """A decoded job's tenant as `record_tenant` reads it from its record (so in-flight
    jobs and waiting records of one tenant are counted as one)."""
    return tenant_id if _READABLE_TENANT.fullmatch(tenant_id) else ""


class TenantWeights:
    """Tenant id -> fair-share weight (1 unless set), refreshed every `refresh_s`."""

    def __init__(self, load: Callable[[], dict[str, float]], *, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._load = load
        self._refresh_s = refresh_s
        self._clock = clock
        self._weights: dict[str, float] = {}
        self._read_at: float | None = None

    def weight_of(self, tenant_id: str) -> float:
        """The tenant's weight as last read."""
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self._refresh_s:
            self._read_at = now
            try:
                self._weights = self._load()
            except Exception as e:  # a database outage must not stop job intake
                logger.warning("reading tenants' weights failed (%s); keeping the last ones", e)
        return self._weights.get(tenant_id, 1.0)
