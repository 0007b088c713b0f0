"""Bearer API keys: who is calling.

Responsible for: reading `Authorization: Bearer <key>`, resolving it to a live tenant with
`storage.tenants.tenant_for_api_key`, and a 401 carrying `WWW-Authenticate` (RFC 6750)
when the key is missing, unknown or revoked. A key found live lately is answered from
`api.key_cache` on the event loop (no thread, no SELECT); otherwise the lookup runs on the
thread pool in its own short session, so a route's long wait never holds a database
transaction open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.errors import Unauthorized
from api.resources import Resources
from storage.tenants import hash_api_key, tenant_for_api_key

logger = logging.getLogger(__name__)

REALM = "batchinfer"

# A declaration (it documents the scheme in OpenAPI), not a connection: safe at import.
bearer_scheme = HTTPBearer(auto_error=False, description="An API key: `bi_...`")


@dataclass(frozen=True, slots=True)
class CurrentTenant:
    """The tenant whose API key authenticated this request."""

    id: str
    name: str


async def authenticate(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> CurrentTenant:
    """The calling tenant; 401 when the bearer key is missing, unknown or revoked."""
    if credentials is None or not credentials.credentials:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' "
            "(operators create keys with `batchinfer keys create`).",
            code="missing_api_key",
            headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'},
        )
    resources: Resources = request.app.state.resources
    key_hash = hash_api_key(credentials.credentials)
    tenant = resources.api_keys.get(key_hash)
    if tenant is None:
        tenant = await look_up_key_shared(resources, credentials.credentials, key_hash)
    if tenant is None:
        raise Unauthorized(
            "Incorrect API key provided: it is unknown or has been revoked.",
            headers={"WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token"'},
        )
    return tenant


async def look_up_key_shared(resources: Resources, key: str, key_hash: str
                             ) -> CurrentTenant | None:
    """`look_up_key` once for every request of a key that misses the cache meanwhile.

    Each cached key expires every MAX_AGE_S, and then all of its requests in flight (32
    under load) missed together and each ran its own SELECT on the thread pool. The
    answer they share was read after the first of them arrived, as fresh as a cache hit.
    """
    return await resources.key_lookups.run(
        key_hash, partial(run_in_threadpool, look_up_key, resources, key))


def look_up_key(resources: Resources, key: str) -> CurrentTenant | None:
    """The tenant of a live key, read from the database and remembered; None otherwise."""
    read_at = resources.api_keys.now()
    with resources.sessions() as session:
        found = tenant_for_api_key(session, key=key)
        if found is None:
            return None
        tenant = CurrentTenant(id=found.id, name=found.name)
    resources.api_keys.put(hash_api_key(key), tenant, read_at=read_at)
    return tenant
