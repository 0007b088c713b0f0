"""Refusing what cannot run before anything is queued: bodies sent to a model of the wrong
kind, and embedding inputs the model cannot take.

Which served names are embedding models is a setting. The vector size, context length
and directory of a model come from the card its workers announce; until one has (no
worker started yet), `dimensions` and over-long inputs are left for the worker to judge.
Token counts use the model's own tokenizer, loaded once per directory.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from api.capabilities import check_model
from api.errors import InvalidRequest
from api.resources import Resources
from core.embedding_requests import EmbeddingRequest, embedding_inputs
from core.settings import Settings


def check_generation_model(model: str, settings: Settings) -> None:
    """400 naming `model` when a chat or completion body names an embedding model."""
    if model in settings.embedding_models:
        raise InvalidRequest(
            f"The model '{model}' is an embedding model: send its inputs to POST "
            "/v1/embeddings (or a job with `input`); GET /v1/models lists each model's kind.",
            param="model", code="wrong_model_kind")


def check_embedding_request(request: EmbeddingRequest, resources: Resources) -> None:
    """Served (404), an embedding model, and inputs it can take (400 naming the field)."""
    settings = resources.settings
    check_model(request.model, settings.served_models)
    if request.model not in settings.embedding_models:
        names = ", ".join(repr(m) for m in settings.embedding_models) or "none"
        raise InvalidRequest(
            f"The model '{request.model}' generates text and has no embeddings; embedding "
            f"models served here: {names} (GET /v1/models lists each model's kind).",
            param="model", code="wrong_model_kind")
    card = resources.cards.get(request.model) or {}
    dimensions = card.get("dimensions")
    if request.dimensions is not None and isinstance(dimensions, int) and (
            request.dimensions != dimensions):
        raise InvalidRequest(
            f"dimensions must be {dimensions}, the size of '{request.model}' vectors (it was "
            "not trained to be shortened); leave it out for full vectors.", param="dimensions")
    context_length, path = card.get("context_length"), card.get("path")
    if request.truncate is False and isinstance(context_length, int) and isinstance(path, str):
        counter = token_counter(path)
        for i, item in enumerate(embedding_inputs(request.input)):
            num_tokens = counter.count(item)
            if num_tokens is not None and num_tokens > context_length:
                raise InvalidRequest(
                    f"input[{i}] has {num_tokens} tokens, more than the {context_length} "
                    f"'{request.model}' reads; shorten it, or leave truncate unset to embed "
                    "its start.", param="input", code="context_length_exceeded")


class TokenCounter:
    """Counts an input's tokens as the embedding runner will (special tokens included)."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: Any | None = None
        try:
            # Imported here: only processes that check embedding lengths need transformers.
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception:  # a directory not on this machine: the worker judges instead
            self.tokenizer = None
        # Fast tokenizers refuse concurrent use; the API calls this from a thread pool.
        self._lock = threading.Lock()

    def count(self, item: str | list[int]) -> int | None:
        """Tokens of one input with the model's special tokens; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if isinstance(item, list):
            return len(item) + self.tokenizer.num_special_tokens_to_add()
        with self._lock:
            return len(self.tokenizer(item, add_special_tokens=True)["input_ids"])


@lru_cache(maxsize=8)
def token_counter(path: str) -> TokenCounter:
    """The process's TokenCounter for a model directory."""
    return TokenCounter(Path(path))
