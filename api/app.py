"""The FastAPI application factory: `create_app(settings)` builds a fresh app per call.

The lifespan opens what the routes share (database engine and sessions, Kafka producer,
Redis clients; see `api.resources`) and closes it on shutdown. Request bodies over
`max_request_bytes` are refused with a 413 before they are parsed: by Content-Length
when the client sends one, else by counting the bytes as they stream in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from api.body_deadline import with_body_deadline
from api.body_limit import BodyLimitMiddleware
from api.errors import install_error_handlers
from api.hot_path import HotPath
from api.job_state import read_finished_views
from api.json_guard import JSONGuardMiddleware
from api.last_resort import LastResortMiddleware
from api.metrics import HTTPMetricsMiddleware
from api.resources import Resources
from api.routes import (
    batch_lines,
    batches,
    cache_stats,
    completions,
    deliveries,
    embeddings,
    files,
    health,
    job_events,
    jobs,
    metrics,
    models,
    responses,
    usage,
)
from core.gc_policy import settle_heap
from core.model_context import model_contexts
from core.settings import Settings, get_settings

logger = logging.getLogger(__name__)

# File uploads are multipart: the file plus boundaries, part headers and the `purpose`
# field, which a few KiB cover; 1 MiB leaves room for long file names.
MULTIPART_OVERHEAD_BYTES = 1 << 20
# Seconds start-up waits for the served models' tokenizers (under `up`'s 60 s API start
# limit; `up` starts the load long before the API, beside the warm server's imports).
CONTEXT_LOAD_WAIT_S = 30.0


class ServiceApp(FastAPI):
    """The API app: FastAPI, with `api.hot_path.HotPath` in front of its whole stack.

    `max_jobs_body_bytes`: the body limit of `POST /v1/jobs`, which the hot path checks
    itself (the app's body-limit middleware is behind it).
    """

    def __init__(self, *, max_jobs_body_bytes: int, body_read_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hot_path = HotPath(super().__call__, api=self, max_body_bytes=max_jobs_body_bytes)
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every request, and the lifespan, enter through the hot path; a request's body
        must keep arriving (api.body_deadline)."""
        if scope["type"] == "http":
            receive = with_body_deadline(receive, self.body_read_timeout_s)
        await self.hot_path(scope, receive, send)


def create_app(settings: Settings | None = None, *, serving: bool = False) -> FastAPI:
    """A new API app on `settings` (default: the process's `get_settings()`).

    `serving`: the app is what this process runs (not a test's client), so once started it
    settles the process's garbage collector (`core.gc_policy`).
    """
    app_settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """Open the shared resources for the app's lifetime; close them at shutdown."""
        resources = Resources.open(app_settings)
        app.state.resources = resources
        resources.done_hub.start(read_views=partial(read_finished_views, resources))
        # Tokenizers for the context checks load before the app takes requests: one that
        # came meanwhile would wait for the load, on a busy machine past a client's
        # timeout. Bounded, so a slow load delays start-up at most that long; requests
        # after it wait as before.
        loading = model_contexts(app_settings.models_dir).warm_up(
            [m for m in app_settings.served_models if m not in app_settings.embedding_models])
        await asyncio.to_thread(loading.join, CONTEXT_LOAD_WAIT_S)
        logger.info("API ready: database %s, broker %s, redis %s, models %s",
                    resources.engine.url.render_as_string(hide_password=True),
                    app_settings.kafka_bootstrap_servers, app_settings.redis_url,
                    ", ".join(app_settings.served_models))
        if serving:
            settle_heap()
        try:
            yield
        finally:
            await resources.aclose()

    app = ServiceApp(
        max_jobs_body_bytes=app_settings.max_request_bytes,
        body_read_timeout_s=app_settings.api_body_read_timeout_s,
        title="batchinfer",
        summary="Asynchronous batch inference for LLMs, with an OpenAI-compatible API.",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    # Added last is outermost: latency covers everything, 413s included. The JSON guard
    # reads bodies the body limit has counted; the last resort answers what escapes both.
    app.add_middleware(JSONGuardMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=app_settings.max_request_bytes,
        limits_by_prefix={"/v1/files": app_settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
    )
    app.add_middleware(LastResortMiddleware)
    app.add_middleware(HTTPMetricsMiddleware)
    for module in (jobs, job_events, completions, embeddings, models, health, metrics, files,
                   batches, batch_lines, deliveries, cache_stats, usage, responses):
        app.include_router(module.router)
    return app
