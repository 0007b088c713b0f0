"""`GET /healthz` (the process answers) and `GET /readyz` (its dependencies answer too,
and it takes jobs: not while stopping), with each served model's state beside. Both are
unauthenticated: /readyz names the dependency that is down and in a word why, never where
it lives (hosts, ports and the errors' own texts go to the log), and a model's state
without its load error (that is for `GET /v1/models`, behind a key)."""

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
from storage.model_states import ModelState

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
    """Readiness: database, broker and Redis each answer; 503 naming those that do not.

    `models` gives each served model's state and live workers, and `models_not_ready` those
    without a worker taking jobs: the API is ready (jobs for them are accepted and wait
    queued) unless a model failed to load, which only its own jobs feel (503 on submit).
    """
    names = ("database", "broker", "redis")
    outcomes = await asyncio.gather(
        _timed(asyncio.to_thread(_ping_database, resources), "database"),
        _broker_check(resources),
        _timed(resources.aredis.ping(), "redis"),
    )
    checks = dict(zip(names, outcomes, strict=True))
    failed = {name: outcome for name, outcome in checks.items() if outcome != "ok"}
    statuses = await resources.model_states.read(fresh=True) if "redis" not in failed else {}
    models = {name: {"state": status.state.value, "live_workers": status.num_live_workers}
              for name, status in statuses.items()}
    not_ready = [name for name in resources.settings.served_models
                 if name not in statuses or statuses[name].state is not ModelState.READY]
    if not failed:
        return JSONResponse({"status": "ok", "checks": checks, "models": models,
                             "models_not_ready": not_ready})
    detail = "; ".join(f"{name}: {outcome}" for name, outcome in failed.items())
    body: dict[str, Any] = error_body(f"Not ready: {detail}.", type=SERVER_ERROR,
                                      param=", ".join(failed), code="not_ready")
    body.update(checks=checks, models=models, models_not_ready=not_ready)
    return JSONResponse(body, status_code=503)


async def _timed(check: Any, name: str) -> str:
    """"ok", or in a word why the check failed: `down (<error type>)` or no answer in time.

    The probe is unauthenticated: what the error says (hosts, ports, URLs) goes to the
    log only.
    """
    try:
        await asyncio.wait_for(check, READY_CHECK_TIMEOUT_S)
    except TimeoutError:
        logger.warning("readiness: %s gave no answer within %g s", name, READY_CHECK_TIMEOUT_S)
        return f"no answer within {READY_CHECK_TIMEOUT_S:g} s"
    except Exception as e:
        logger.warning("readiness: %s is down: %s", name, e)
        return f"down ({type(e).__name__})"
    return "ok"


async def _broker_check(resources: Resources) -> str:
    """Down or stopping when the producer knows (the answer submissions get, less its
    text); else a fresh metadata request."""
    producer = resources.producer
    if producer.is_refusing:
        return "stopping"
    reason = producer.unavailable_reason
    if reason is not None:
        logger.warning("readiness: broker is down: %s", reason)
        return "down"
    return await _timed(asyncio.to_thread(_ping_broker, resources), "broker")


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
