"""The engine servers of one model as a worker sees them: where they are, how to reach
them (the `engine_url*` settings), and the model's card as they list it.

The loop that sends them requests is workers.inference.remote_engine.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import httpx

from core.settings import Settings
from workers.engine.model_card import ModelCard
from workers.inference.engine_routing import ServerState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RemoteEngineConfig:
    """Where the servers are and how to treat them (the `engine_url*` settings)."""

    urls: list[str]
    model: str  # the name the servers know the model by
    concurrency: int = 32
    api_key: str | None = None
    timeout_s: float = 600.0
    send_priority: bool = False
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("an engine server needs at least one URL (engine_urls)")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"engine_urls names a server twice: {self.urls}")

    @classmethod
    def from_settings(cls, settings: Settings) -> RemoteEngineConfig:
        """The configuration the settings give."""
        return cls(urls=[url.rstrip("/") for url in settings.engine_urls], model=settings.model,
                   concurrency=settings.engine_url_concurrency,
                   api_key=settings.engine_url_api_key, timeout_s=settings.engine_url_timeout_s,
                   send_priority=settings.engine_url_send_priority,
                   backoff_s=settings.engine_url_backoff_s,
                   backoff_max_s=settings.engine_url_backoff_max_s)


class RemoteEngine:
    """The servers of one model as the worker sees an engine (no tokenizer, no KV pool)."""

    # The servers' context is theirs to enforce; a chat job without max_tokens leaves the
    # limit to them.
    max_model_len: int | None = None
    tokenizer: None = None

    def __init__(self, config: RemoteEngineConfig) -> None:
        self.config = config
        self.servers = [ServerState(url, config.concurrency) for url in config.urls]

    @property
    def max_num_inflight(self) -> int:
        """The worker's default in-flight bound: twice what the servers run at once, so a
        finished request's place is refilled from jobs already at hand."""
        return 2 * sum(server.max_concurrency for server in self.servers)

    @property
    def headers(self) -> dict[str, str]:
        """Headers of every request (the API key, when one is set)."""
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def card(self, name: str) -> ModelCard:
        """The served model's card: a chat model, its context as the servers list it, and
        a revision that names the model on the servers (result caches are kept per
        revision, apart from any model this project loads itself)."""
        digest = hashlib.blake2b(self.config.model.encode(), digest_size=8).hexdigest()
        return ModelCard(name=name, kind="chat", context_length=self.context_length(),
                         revision=f"server-{digest}", path=self.config.model)

    def context_length(self) -> int | None:
        """The model's context as the first server that answers lists it (vLLM says
        `max_model_len`); None when none says. ValueError when a server answers without
        the model: the worker was pointed at the wrong server or name."""
        for url in self.config.urls:
            try:
                answer = httpx.get(f"{url}/models", headers=self.headers, timeout=10.0)
                answer.raise_for_status()
                listed = answer.json().get("data") or []
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                logger.warning("cannot list the models of %s (%s); going on", url, e)
                continue
            names = [str(entry.get("id")) for entry in listed if isinstance(entry, dict)]
            for entry in listed:
                if isinstance(entry, dict) and entry.get("id") == self.config.model:
                    length = entry.get("max_model_len") or entry.get("context_length")
                    return int(length) if isinstance(length, int) else None
            raise ValueError(f"the engine server {url} serves {names}, not "
                             f"{self.config.model!r}: give --model the name it serves")
        return None
