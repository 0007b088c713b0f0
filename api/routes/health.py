"""`GET /healthz` (the process answers) and `GET /readyz` (its dependencies answer too,
and it takes jobs: not while stopping)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from kafka import KafkaAdminClient
from sqlalchemy import text

from api.deps import ResourcesDep
from api.errors import SERVER_ERROR, error_body
from api.resources import Resources

logger = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

# Each dependency gets this long to answer; probes typically time out after a few seconds.
READY_CHECK_TIMEOUT_S = 2.0


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves requests (dependencies are /readyz's business)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> JSONResponse:
    """Readiness: database, broker and Redis each answer; 503 naming those that do not."""
    names = ("database", "broker", "redis")
    outcomes = await asyncio.gather(
        _timed(asyncio.to_thread(_ping_database, resources)),
        _broker_check(resources),
        _timed(resources.aredis.ping()),
    )
    checks = dict(zip(names, outcomes, strict=True))
    failed = {name: outcome for name, outcome in checks.items() if outcome != "ok"}
    if not failed:
        return JSONResponse({"status": "ok", "checks": checks})
    logger.warning("not ready: %s", failed)
    detail = "; ".join(f"{name}: {outcome}" for name, outcome in failed.items())
    body: dict[str, Any] = error_body(f"Not ready: {detail}.", type=SERVER_ERROR,
                                      param=", ".join(failed), code="not_ready")
    body["checks"] = checks
    return JSONResponse(body, status_code=503)


async def _timed(check: Any) -> str:
    """"ok", or why the check failed or timed out."""
    try:
        await asyncio.wait_for(check, READY_CHECK_TIMEOUT_S)
    except TimeoutError:
        return f"no answer within {READY_CHECK_TIMEOUT_S:g} s"
    except Exception as e:
        return f"{type(e).__name__}: {e}".rstrip(".")
    return "ok"


async def _broker_check(resources: Resources) -> str:
    """Why jobs are refused, when the producer knows (broker down, service stopping): the
    same answer submissions get; else a fresh metadata request."""
    reason = resources.producer.unavailable_reason
    if reason is not None:
        return reason
    return await _timed(asyncio.to_thread(_ping_broker, resources))


def _ping_database(resources: Resources) -> None:
    with resources.engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def _ping_broker(resources: Resources) -> None:
    """A metadata request (list topics) on a fresh connection, so a dead broker shows."""
    timeout_ms = int(READY_CHECK_TIMEOUT_S * 1000)
    servers = [s.strip() for s in resources.settings.kafka_bootstrap_servers.split(",")]
    admin = KafkaAdminClient(bootstrap_servers=[s for s in servers if s],
                             client_id="batchinfer-readyz", bootstrap_timeout_ms=timeout_ms,
                             request_timeout_ms=timeout_ms)
    try:
        admin.list_topics()
    finally:
        admin.close()
