"""A small HTTP client of the Files and Batches endpoints, for the `batchinfer batch` CLI.

It speaks to a running service over HTTP only (httpx), like any OpenAI client would, and
streams both ways: uploads are read from disk in chunks by httpx's multipart encoder,
downloads are written to disk as they arrive (to `<path>.part`, renamed when complete).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

DEFAULT_ENDPOINT = "/v1/chat/completions"
# Uploads of hundreds of MB need more than a short read timeout on a busy service.
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
DOWNLOAD_CHUNK_BYTES = 1024 * 1024


class BatchAPIError(RuntimeError):
    """The service answered with an error (its message, and the HTTP status)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code


class BatchClient:
    """Files and Batches calls against one service with one API key."""

    def __init__(self, base_url: str, api_key: str, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        try:
            self._http = httpx.Client(base_url=self.base_url, timeout=TIMEOUT,
                                      headers={"Authorization": f"Bearer {api_key}"},
                                      transport=transport)
        except httpx.InvalidURL as e:  # said as the CLI says a bad argument
            raise ValueError(f"--url {base_url!r} is not a URL: {e}") from e

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def upload(self, path: Path) -> dict[str, Any]:
        """Upload a JSONL file with `purpose=batch`; returns the file object."""
        with path.open("rb") as handle:
            response = self._http.post("/v1/files", data={"purpose": "batch"},
                                       files={"file": (path.name, handle,
                                                       "application/jsonl")})
        return _json(response)

    def create_batch(self, *, input_file_id: str, endpoint: str, completion_window: str,
                     priority: str | None = None, model: str | None = None,
                     metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Create a batch; `priority` and `model` are this service's extras."""
        body: dict[str, Any] = {"input_file_id": input_file_id, "endpoint": endpoint,
                                "completion_window": completion_window}
        for name, value in (("priority", priority), ("model", model), ("metadata", metadata)):
            if value is not None:
                body[name] = value
        return _json(self._http.post("/v1/batches", json=body))

    def get_batch(self, batch_id: str, *, wait: float = 0.0) -> dict[str, Any]:
        """The batch object; with `wait`, once the batch ends or after `wait` seconds (the
        service holds the request open meanwhile)."""
        params = {"wait": wait} if wait > 0 else None
        return _json(self._http.get(f"/v1/batches/{batch_id}", params=params))

    def list_batches(self, *, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        """One page of batches, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return _json(self._http.get("/v1/batches", params=params))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Ask the service to cancel a batch."""
        return _json(self._http.post(f"/v1/batches/{batch_id}/cancel"))

    def list_jobs(self, *, limit: int = 20, after: str | None = None,
                  filters: dict[str, str] | None = None) -> dict[str, Any]:
        """One page of jobs, newest first, narrowed by the service's query filters."""
        params: dict[str, Any] = {"limit": limit, **(filters or {})}
        if after:
            params["after"] = after
        return _json(self._http.get("/v1/jobs", params=params))

    def get_job(self, job_id: str, *, wait: float = 0.0) -> dict[str, Any]:
        """The job object; with `wait`, once it ends or after `wait` seconds."""
        params = {"wait": wait} if wait > 0 else None
        return _json(self._http.get(f"/v1/jobs/{job_id}", params=params))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Ask the service to cancel a job."""
        return _json(self._http.post(f"/v1/jobs/{job_id}/cancel"))

    def download(self, file_id: str, path: Path) -> int:
        """Stream a file's content to `path`; returns the bytes written."""
        part = path.with_name(path.name + ".part")
        num_bytes = 0
        with self._http.stream("GET", f"/v1/files/{file_id}/content") as response:
            if response.is_error:
                response.read()
                _json(response)
            with part.open("wb") as handle:
                for chunk in response.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                    handle.write(chunk)
                    num_bytes += len(chunk)
        os.replace(part, path)
        return num_bytes


def endpoint_of(path: Path) -> str:
    """The `url` of the first request in a JSONL file (the batch's endpoint)."""
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                return url if isinstance(url, str) and url else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT


def _json(response: httpx.Response) -> dict[str, Any]:
    """The response's JSON object; BatchAPIError carrying the service's message on errors."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_error:
        message = response.text[:500]
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message") or message)
        raise BatchAPIError(response.status_code, message)
    if not isinstance(body, dict):
        raise BatchAPIError(response.status_code, "the service answered with no JSON object")
    return body
