"""The API under test as integration tests drive it: the official `openai` client, httpx,
and a job run to its end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from tests.utils.api import TenantKey
from tests.utils.worker_service import Service

OFF = {"cache": {"mode": "off"}}  # each request runs in the engine


@dataclass
class Api:
    """The service under test, its model's name and a tenant's key."""

    url: str
    model: str
    tenant: TenantKey
    service: Service

    def openai(self) -> openai.OpenAI:
        """The official client, pointed at the API."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.tenant.key,
                             max_retries=0, timeout=300)

    def http(self) -> httpx.Client:
        """An authenticated httpx client."""
        return httpx.Client(base_url=self.url, headers=self.tenant.headers, timeout=120)

    def job(self, job_id: str) -> dict[str, Any]:
        """The job as GET /v1/jobs/{id} shows it."""
        with self.http() as client:
            return client.get(f"/v1/jobs/{job_id}").json()

    def run_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs and wait for it to succeed; the job as it then shows."""
        with self.http() as client:
            job = client.post("/v1/jobs", json=body)
            assert job.status_code == 202, job.text
            job_id = job.json()["id"]
        deadline = time.monotonic() + 120
        while (view := self.job(job_id))["status"] != "succeeded":
            assert view["status"] in ("queued", "running"), view
            assert time.monotonic() < deadline, view
            time.sleep(0.1)
        return view
