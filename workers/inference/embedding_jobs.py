"""Embedding jobs: a body (OpenAI's embeddings fields) → runner inputs, and the result back.

The result is OpenAI's embeddings list object: `data[i].embedding` as floats (each
float32's shortest decimal form), or as the base64 of little-endian float32 values
(`encoding_format: "base64"`, as OpenAI encodes them), in input order, and `usage` with
the prompt tokens read. Our addition to `usage`: `truncated_inputs`, the indices of inputs
cut at the model's length, so a caller knows which vectors cover only the start of their
text.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from core.embedding_requests import embedding_inputs
from workers.engine.embedding_engine import EmbeddingParams, EmbeddingRequestOutput
from workers.engine.embedding_runner import EmbeddingInput

ENCODING_FORMATS = ("float", "base64")


def embedding_inputs_from_body(body: dict[str, Any]) -> list[EmbeddingInput]:
    """`input` as a list of texts or token-id lists; ValueError naming the bad part."""
    return embedding_inputs(body.get("input"))


def embedding_params_from_body(body: dict[str, Any], *, dimensions: int) -> EmbeddingParams:
    """Truncation, and checks of `encoding_format` and `dimensions` (ValueError naming them)."""
    encoding_format = body.get("encoding_format", "float")
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be float or base64, got {encoding_format!r}")
    asked = body.get("dimensions")
    if asked is not None and asked != dimensions:
        raise ValueError(f"dimensions must be {dimensions} (this model's size), got {asked!r}; "
                         "it was not trained to be shortened")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"truncate must be true or false, got {truncate!r}")
    return EmbeddingParams(truncate=truncate)


def embedding_request_from_body(body: dict[str, Any], engine: object) -> tuple[Any, Any]:
    """(inputs, EmbeddingParams) of a job for the engine loop; ValueError naming the field.

    A chat engine (no `dimensions`) gets a refusal: the job was routed to the wrong model.
    """
    dimensions = getattr(engine, "dimensions", None)
    if not isinstance(dimensions, int):
        raise ValueError("model serves chat and completions, not embeddings; send input to "
                         "an embedding model (GET /v1/models lists each model's kind)")
    inputs = embedding_inputs_from_body(body)
    return inputs, embedding_params_from_body(body, dimensions=dimensions)


def build_embedding_result(
    output: EmbeddingRequestOutput, *, model: str, body: dict[str, Any]
) -> dict[str, Any]:
    """OpenAI's embeddings list object for a finished request (see the module docstring).

    A float vector stays a float32 array until the result is written: the storage codec
    (storage.db) writes each value in float32's shortest decimal form, as
    `float32_values` reads them, without a Python float per value.
    """
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for i, vector in enumerate(output.embeddings):
        values = np.ascontiguousarray(vector.float().numpy(), dtype=np.float32)
        embedding: Any = (base64.b64encode(values.astype("<f4").tobytes()).decode()
                          if as_base64 else values)
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {
            "prompt_tokens": output.num_prompt_tokens,
            "total_tokens": output.num_prompt_tokens,
            "truncated_inputs": list(output.truncated_indices),
        },
    }


def float32_values(values: np.ndarray) -> list[float]:
    """float32 values as the Python floats of their shortest decimal forms.

    `tolist()` widens each value to the float64 nearest it, whose decimal form runs to
    17 digits (0.10000000149011612 for float32 0.1); a float32 needs at most 9. Every
    stored result, cached answer and output line carries these digits: an all-MiniLM
    vector's JSON shrinks from ~8.0 to ~4.7 KB, and reads back as the same float32s.
    """
    packed = np.ascontiguousarray(values, dtype=np.float32)
    return list(orjson.loads(orjson.dumps(packed, option=orjson.OPT_SERIALIZE_NUMPY)))


def decode_base64_embedding(text: str) -> list[float]:
    """The floats of a base64 embedding (what OpenAI clients do with one)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(float).tolist()
