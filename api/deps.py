"""Dependencies routes declare as plain types: `session: SessionDep`, `tenant: TenantDep`.

Everything comes from the app's `Resources` (opened by the lifespan), never from module
state, so tests build an app per test and override any of these with
`app.dependency_overrides`. The ones that only hand out an attribute are `async def`:
FastAPI runs a plain `def` dependency on the thread pool, a hand-off per request each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import redis
import redis.asyncio as aioredis
from fastapi import Depends, Header, Query, Request
from sqlalchemy.orm import Session

from api.auth import CurrentTenant, authenticate
from api.resources import LazyProducer, Resources
from core.settings import Settings

# Longest Idempotency-Key accepted; the column holds 200 characters.
MAX_IDEMPOTENCY_KEY_CHARS = 200


def resources_of(request: Request) -> Resources:
    """The connections the app's lifespan opened (for routes that take the request)."""
    resources: Resources = request.app.state.resources
    return resources


async def get_resources(request: Request) -> Resources:
    """The connections the app's lifespan opened."""
    return resources_of(request)


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_app_settings(resources: ResourcesDep) -> Settings:
    """The settings this app was built with (not necessarily the process's)."""
    return resources.settings


def get_session(resources: ResourcesDep) -> Iterator[Session]:
    """A database session for one request, closed (rolled back if uncommitted) after it."""
    with resources.sessions() as session:
        yield session


async def get_producer(request: Request) -> LazyProducer:
    """The Kafka producer handle; it connects on first `get()`. (From the request, not
    through `ResourcesDep`: each dependency FastAPI solves costs a submission ~5 us.)"""
    return resources_of(request).producer


async def get_redis(resources: ResourcesDep) -> redis.Redis:
    """The synchronous Redis client (publishing events)."""
    return resources.redis


async def get_async_redis(resources: ResourcesDep) -> aioredis.Redis:
    """The asyncio Redis client (long-poll subscriptions)."""
    return resources.aredis


# `?wait=N` of a long-poll (a job, a batch): held open until what it reads ends or N
# seconds pass, at most the server's long_poll_max_s (see `long_poll_s`).
WaitQuery = Annotated[float, Query(
    ge=0, allow_inf_nan=False, description="Seconds to wait for it to end (capped by the "
    "server's long_poll_max_s); returns at once when it does.")]


def long_poll_s(resources: Resources, wait: float) -> float:
    """A long-poll's `wait` within the server's cap."""
    return min(wait, resources.settings.long_poll_max_s)


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
ProducerDep = Annotated[LazyProducer, Depends(get_producer)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
AsyncRedisDep = Annotated[aioredis.Redis, Depends(get_async_redis)]
TenantDep = Annotated[CurrentTenant, Depends(authenticate)]
IdempotencyKeyDep = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        description="Replaying a request with the same key returns the same job.",
    ),
]
