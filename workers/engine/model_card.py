"""What a prepared model directory is, read from its files alone (no torch, no weights).

Responsible for:
- its kind: `embedding` for encoders laid out for sentence-transformers (or whose
  architectures are bare encoders), else `chat` (a causal LM);
- its context length (for encoders the sentence-transformers `max_seq_length`);
- its weights revision: a content hash of config.json and every .safetensors file,
  computed once and cached by the files' sizes and modification times, so a restart (or
  the next worker) reads it back in microseconds, while a changed file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

ModelKind = Literal["chat", "embedding"]
# Hex digits of SHA-256 kept as the revision: collisions stay out of reach, names short.
REVISION_CHARS = 16
# The file beside each cached revision; its name is a hash of the model's absolute path.
REVISION_CACHE_DIR = ".revisions"
_HASH_CHUNK_BYTES = 8 << 20
# Heads that make a checkpoint a generator rather than an encoder.
_GENERATOR_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A served model as `GET /v1/models` describes it."""

    name: str
    kind: ModelKind
    context_length: int | None
    revision: str
    path: str
    # Length of an embedding model's vectors; None for a chat model.
    dimensions: int | None = None

    def to_json(self) -> str:
        """The card as one JSON object."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelCard:
        """Parse `to_json`'s output; ValueError for anything else."""
        try:
            data = json.loads(text)
            return cls(name=str(data["name"]), kind=data["kind"],
                       context_length=data.get("context_length"),
                       revision=str(data["revision"]), path=str(data["path"]),
                       dimensions=data.get("dimensions"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a model card: {e}") from e


def describe_model(model_dir: Path, *, name: str, cache_dir: Path | None = None) -> ModelCard:
    """The card of a prepared directory served as `name` (revision cached under cache_dir)."""
    config = read_config(model_dir)
    kind = model_kind(model_dir, config)
    hidden_size = config.get("hidden_size")
    return ModelCard(name=name, kind=kind, context_length=context_length(model_dir, config, kind),
                     revision=model_revision(model_dir, cache_dir=cache_dir),
                     path=str(model_dir),
                     dimensions=hidden_size if kind == "embedding" and isinstance(
                         hidden_size, int) else None)


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; ValueError when it is missing or not a JSON object."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir} has no config.json")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def model_kind(model_dir: Path, config: dict[str, Any]) -> ModelKind:
    """`embedding` for a sentence-transformers layout or a bare encoder, else `chat`."""
    if (model_dir / "modules.json").is_file():
        return "embedding"
    architectures = config.get("architectures") or []
    if architectures and not any(str(a).endswith(_GENERATOR_SUFFIXES) for a in architectures):
        return "embedding"
    return "chat"


def context_length(model_dir: Path, config: dict[str, Any], kind: ModelKind) -> int | None:
    """Tokens a request may hold: sentence-transformers' max_seq_length for encoders (they
    were trained to it, though their position table may be longer), else the position
    table's size."""
    positions = config.get("max_position_embeddings")
    if kind == "embedding":
        st_config = model_dir / "sentence_bert_config.json"
        if st_config.is_file():
            length = json.loads(st_config.read_text()).get("max_seq_length")
            if isinstance(length, int):
                return min(length, positions) if isinstance(positions, int) else length
    return positions if isinstance(positions, int) else None


def model_revision(model_dir: Path, *, cache_dir: Path | None = None) -> str:
    """SHA-256 (first REVISION_CHARS hex digits) over config.json and the safetensors files.

    With cache_dir, the answer is kept there keyed by every file's (size, mtime_ns), so
    hashing (a second per GB) happens once per change of the weights.
    """
    files = sorted([model_dir / "config.json", *model_dir.glob("*.safetensors")])
    stamp = {f.name: [st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()]}
    cache_file = None
    if cache_dir is not None:
        key = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=8).hexdigest()
        cache_file = cache_dir / REVISION_CACHE_DIR / f"{key}.json"
        cached = _read_cached(cache_file)
        if cached is not None and cached.get("files") == stamp:
            return str(cached["revision"])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as stream:
            while chunk := stream.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    revision = digest.hexdigest()[:REVISION_CHARS]
    if cache_file is not None:
        _write_cached(cache_file, {"path": str(model_dir), "files": stamp, "revision": revision})
    logger.info("model %s has revision %s", model_dir, revision)
    return revision


def _read_cached(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_cached(path: Path, data: dict[str, Any]) -> None:
    # A read-only models directory only costs the next process another hash.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("cannot cache the revision of %s in %s: %s", data["path"], path, e)
