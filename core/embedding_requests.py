"""Embedding request bodies: OpenAI's `POST /v1/embeddings` fields, plus our extras.

`input` is a string, a list of strings, one list of token ids, or a list of token-id
lists; empty input, empty strings and more than MAX_EMBEDDING_INPUTS items are refused
where the body is parsed (a 400 naming `input`), so nothing is queued for them. The same
normalisation serves the worker, which gets bodies from batch files and older messages
too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from core.requests import Key, Metadata, check_text
from core.topics import Priority

# OpenAI's limit on inputs per request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingItem = str | list[int]


def embedding_inputs(value: object) -> list[EmbeddingItem]:
    """`input` as a list of texts or token-id lists; ValueError naming the bad part."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list):
        items = value
    else:
        raise ValueError("input must be a string, a list of strings, or token-id lists")
    if not items:
        raise ValueError("input must not be empty")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} "
                         "per request (send the rest in another request, or use a batch)")
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input[{i}] is an empty string")
        elif not (isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item)):
            raise ValueError(f"input[{i}] must be a non-empty string or a non-empty list of "
                             "token ids (integers >= 0)")
    return items


def _check_input(value: object) -> object:
    embedding_inputs(value)
    # Text that is not valid Unicode (a JSON-escaped lone surrogate) is refused here, as
    # in every other request body, before it can reach storage or a tokenizer.
    for item in value if isinstance(value, list) else [value]:
        check_text(item)
    return value


EmbeddingInput = Annotated[
    str | list[str] | list[int] | list[list[int]], AfterValidator(_check_input)
]


class EmbeddingRequest(BaseModel):
    """Body of `POST /v1/embeddings`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    # Only the model's own size: none of the served encoders was trained to be shortened.
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)
    # Our extra: false refuses inputs longer than the model reads instead of cutting them.
    truncate: bool | None = None
    # Jobs with the same cache_key land on the same partition (as for completions).
    cache_key: Key | None = Field(default=None, min_length=1, max_length=200)
    metadata: Metadata | None = None

    @property
    def kind(self) -> Literal["embedding"]:
        """The job kind (its result is an embeddings list)."""
        return "embedding"

    def inference_body(self) -> dict[str, Any]:
        """The normalised request a worker runs and the job row keeps."""
        body: dict[str, Any] = {"model": self.model, "input": self.input}
        for name in ("encoding_format", "dimensions", "user", "truncate"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body


class EmbeddingJobCreate(EmbeddingRequest):
    """An embeddings body as a queued job: with a priority and an optional callback."""

    priority: Priority = Priority.NORMAL
    callback_url: str | None = Field(default=None, max_length=2048)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
