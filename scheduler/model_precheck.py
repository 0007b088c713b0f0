"""What `up` can tell about a model from its config.json alone, before anything starts.

The full check (`batchinfer models prepare`, forked from the warm server) needs torch,
transformers and the engine imported: 10-13 s of CPU on two cores. Read first, the
config settles the common refusal, a family the engine does not serve, without them; a
model that passes here is then fully checked while the broker, Redis and the database
start beside the warm server's imports. A model that only the full preparation can
read (a known name still to pull, a GGUF file to dequantize) is prepared first, as
before.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from workers.engine.model_card import model_kind, read_config
from workers.engine.model_types import SERVED_MODEL_TYPES, unsupported_type_reason


def config_dir(model: str, models_dir: Path) -> Path | None:
    """The prepared directory `model` names (a path, or a name prepared under models_dir),
    in the order `resolve_model` looks; None when preparing it must come first."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        return None  # a GGUF file, or a directory holding one
    prepared = models_dir / model
    if "/" not in model and (prepared / "config.json").is_file():
        return prepared
    return None


class ReadModel(NamedTuple):
    """A model whose config was read: its directory and kind (`chat` or `embedding`)."""

    path: Path
    kind: str


def precheck(model: str, models_dir: Path) -> ReadModel | None:
    """The directory and kind of `model` when its config was read and names a family the
    engine serves (or an encoder); None when only its preparation can tell. ValueError, in
    the words of the full check, for a config of a family the engine does not serve."""
    model_dir = config_dir(model, models_dir)
    if model_dir is None:
        return None
    try:
        config = read_config(model_dir)
    except ValueError:
        return None  # unreadable JSON: the full check names what is wrong with it
    kind = model_kind(model_dir, config)
    if kind == "embedding":
        return ReadModel(model_dir, kind)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None  # transformers' own reading names what is wrong with it
    if model_type not in SERVED_MODEL_TYPES:
        raise ValueError(f"{model_dir} cannot be served: {unsupported_type_reason(model_type)}")
    return ReadModel(model_dir, kind)
