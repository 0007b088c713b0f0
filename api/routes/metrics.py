"""`GET /metrics`: every metric of this process in Prometheus' text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    """Jobs submitted by priority, HTTP latency, and whatever else the process registered."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
