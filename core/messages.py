"""The versioned JSON message that carries a job through Kafka, and its partition key.

The database is the source of truth; the message carries what a worker needs to run the
job without a read first (the request body), plus the ids to write the result back.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final, Literal

from pydantic import BaseModel, Field, ValidationError

MESSAGE_VERSION: Final = 1

# Prompts that share their first this-many characters share a partition, so a worker's
# prefix cache sees them all. Long enough to cover a typical system prompt's first block.
AFFINITY_PREFIX_CHARS = 256


class JobMessage(BaseModel):
    """One job as produced to `<prefix>.jobs.<model>.<priority>` (see core.topics)."""

    v: Literal[1] = MESSAGE_VERSION
    job_id: str
    tenant_id: str
    priority: str
    model: str
    # "chat.completion" (body has `messages`), "text_completion" (body has `prompt`) or
    # "embedding" (body has `input`, for an embedding model).
    kind: Literal["chat.completion", "text_completion", "embedding", "response"]
    body: dict[str, Any]
    batch_id: str | None = None
    custom_id: str | None = None
    cache_key: str | None = None
    attempt: int = Field(default=1, ge=1)
    # Whether the job has a webhook to call when it ends, so a worker storing a step's
    # results looks up only those jobs' rows; None (a message from before the field)
    # means it may have one.
    has_callback: bool | None = None
    # When the job must be done by (seconds since the epoch): the engine runs it before
    # jobs of its priority with later deadlines or none.
    deadline: float | None = None
    # When the job was created (seconds since the epoch): a `response`'s `created_at`,
    # the same on every read of it as on the stream that opened it. None in a message
    # from before the field: the worker's clock then.
    created_at: float | None = None

    def encode(self) -> bytes:
        """Bytes for the Kafka record value (UTF-8 JSON).

        ValueError if the body holds text UTF-8 cannot carry (a lone surrogate stored
        before the API refused them): such a job cannot be sent, and the caller fails it.
        """
        try:
            return self.model_dump_json().encode()
        except ValueError as e:  # PydanticSerializationError: a UnicodeEncodeError inside
            raise ValueError(f"job {self.job_id} cannot be encoded as a message: its request "
                             f"holds text that is not valid Unicode ({e})") from e

    @classmethod
    def decode(cls, raw: bytes) -> JobMessage:
        """Parse a record value; ValueError for anything that is not a v1 job message."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as e:
            raise ValueError(f"not a v{MESSAGE_VERSION} job message: {e}") from e

    def affinity_key(self) -> bytes:
        """Partition key: explicit cache_key, else a hash of the prompt's first block."""
        if self.cache_key:
            return self.cache_key.encode("utf-8", "surrogatepass")
        return prompt_affinity_key(self.body, self.model)


def prompt_affinity_key(body: dict[str, Any], model: str) -> bytes:
    """Hash of model + the first AFFINITY_PREFIX_CHARS of the rendered prompt.

    Never raises on text: 'surrogatepass' hashes a lone surrogate that plain UTF-8 would
    refuse (valid text hashes the same either way, so keys do not move).
    """
    if "messages" in body:
        head = json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    else:
        prompt = body.get("prompt", body.get("input", ""))
        head = prompt if isinstance(prompt, str) else json.dumps(prompt)
    key_text = f"{model}\0{head[:AFFINITY_PREFIX_CHARS]}"
    digest = hashlib.blake2b(key_text.encode("utf-8", "surrogatepass"), digest_size=8)
    return digest.hexdigest().encode()
