"""`batchinfer models pull|prepare`: bring a model here and check that a worker can run it.

Both refuse, before anything starts, a model the worker's loader would refuse: the check
is the engine's own (`check_model`), run on the model's config, so a GPT-2 directory
fails here with the engine's reason instead of crash-looping a worker later.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# A tokenizer in any of the forms transformers loads: fast (json), its config, SentencePiece.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_model(model_dir: Path) -> None:
    """ValueError with the engine's reason when a worker could not load `model_dir`.

    Encoders (embedding models) go to the embedding runner, which loads any BERT-style
    checkpoint through transformers; decoders must pass the engine's check of architecture,
    rope kind, quantization and head sizes.
    """
    from workers.engine.loader import load_hf_config
    from workers.engine.model_card import model_kind, read_config

    if model_kind(model_dir, read_config(model_dir)) == "embedding":
        return
    # The one place that names the engine's check.
    from workers.engine.models import check_supported

    try:
        check_supported(load_hf_config(model_dir))
    except ValueError as e:
        raise ValueError(f"{model_dir} cannot be served: {e}") from e
    # What the worker's load reads besides the config: weights, and a tokenizer for text.
    if not any(model_dir.glob("*.safetensors")):
        raise ValueError(f"{model_dir} cannot be served: it has no .safetensors weights")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir} cannot be served: it has no tokenizer "
                         f"({' or '.join(TOKENIZER_FILES)})")


def prepared_dir(model: str, models_dir: Path) -> Path:
    """A known name pulled when missing, or a path taken as it is; checked either way."""
    from workers.engine.registry import KNOWN_MODELS, pull_model, resolve_model

    if model in KNOWN_MODELS:
        model_dir = pull_model(model, models_dir)
    else:
        model_dir = resolve_model(model, models_dir)
    check_model(model_dir)
    return model_dir


def _models_dir(args: argparse.Namespace) -> Path:
    from core.settings import get_settings

    return Path(args.models_dir) if args.models_dir else get_settings().models_dir


def cmd_models_pull(args: argparse.Namespace) -> int:
    """Download a known model into the models directory (or check a path); print where."""
    print(prepared_dir(args.name, _models_dir(args)))
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    """Pull a known name if needed, or take a path as it is; print the model's card (JSON)."""
    from workers.engine.model_card import describe_model

    models_dir = _models_dir(args)
    model_dir = prepared_dir(args.model, models_dir)
    card = describe_model(model_dir, name=args.served_model_name or args.model,
                          cache_dir=models_dir)
    print(card.to_json())
    return 0


def add_models_parser(sub: Any) -> None:
    """Register `models pull|prepare` on the `batchinfer` subparsers."""
    models = sub.add_parser("models", help="bring models here and check they can be served")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = models_sub.add_parser(
        "pull", help="download a known model into the models directory, or check a path; "
                     "print its directory")
    pull.add_argument("name", metavar="PATH|NAME",
                      help="a known name (e.g. smollm2-135m-instruct), a Hugging Face "
                           "directory or a .gguf file")
    pull.add_argument("--models-dir", default=None,
                      help="where models are prepared (default: settings.models_dir)")
    pull.set_defaults(func=cmd_models_pull)
    prepare = models_sub.add_parser(
        "prepare", help="pull a known name or check a path; print the model's card as JSON")
    prepare.add_argument("model", metavar="PATH|NAME",
                         help="a known name, a Hugging Face directory or a .gguf file")
    prepare.add_argument("--served-model-name", default=None,
                         help="the name clients use (default: the model itself)")
    prepare.add_argument("--models-dir", default=None,
                         help="where models are prepared (default: settings.models_dir)")
    prepare.set_defaults(func=cmd_models_prepare)
