"""Model cards: kind, context length and weights revision, read from a directory's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.engine.checkpoints import save_llama
from workers.engine.loader import convert_gguf
from workers.engine.model_card import REVISION_CACHE_DIR, ModelCard, describe_model, model_revision
from workers.engine.registry import pull_model, resolve_model


def test_a_causal_lm_directory_is_a_chat_model(tmp_path: Path) -> None:
    """Kind chat, the position table as context, a 16-hex revision; the card round-trips."""
    save_llama(tmp_path / "tiny")
    card = describe_model(tmp_path / "tiny", name="tiny", cache_dir=tmp_path / "models")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert (card.kind, card.dimensions) == ("chat", None)
    assert card.context_length == config["max_position_embeddings"]
    assert len(card.revision) == 16 and int(card.revision, 16) >= 0
    assert ModelCard.from_json(card.to_json()) == card
    with pytest.raises(ValueError, match="not a model card"):
        ModelCard.from_json('{"name": "x"}')


def test_the_packaged_minilm_is_an_embedding_model(tmp_path: Path) -> None:
    """The known name resolves to the installed package's directory, no download."""
    model_dir = resolve_model("all-minilm-l6-v2", tmp_path)
    assert pull_model("all-minilm-l6-v2", tmp_path) == model_dir
    assert not any(tmp_path.iterdir())  # nothing fetched or copied
    card = describe_model(model_dir, name="emb", cache_dir=tmp_path)
    # sentence-transformers truncates at 256 although BERT's table has 512 positions.
    assert (card.kind, card.context_length, card.dimensions) == ("embedding", 256, 384)


def test_revision_follows_the_weights_and_is_cached(tmp_path: Path) -> None:
    """Other weights give another revision; an untouched directory is not hashed again."""
    save_llama(tmp_path / "a", seed=0)
    save_llama(tmp_path / "b", seed=1)
    cache = tmp_path / "cache"
    first = model_revision(tmp_path / "a", cache_dir=cache)
    assert model_revision(tmp_path / "b", cache_dir=cache) != first
    assert model_revision(tmp_path / "a") == first  # the cache only saves time
    assert len(list((cache / REVISION_CACHE_DIR).iterdir())) == 2
    weights = tmp_path / "a" / "model.safetensors"
    stat = weights.stat()
    # Same size and mtime: the cached answer is trusted (that is what makes it cheap) ...
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_revision(tmp_path / "a", cache_dir=cache) == first
    # ... and a file written again (new mtime) is hashed again.
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed = model_revision(tmp_path / "a", cache_dir=cache)
    assert changed != first
    assert changed == model_revision(tmp_path / "a")


def test_a_prepared_gguf_directory_gets_its_architecture_named(tmp_path: Path) -> None:
    """Directories prepared with `architectures: null` are fixed on their next use."""
    prepared = tmp_path / "gguf" / "old"
    prepared.mkdir(parents=True)
    (prepared / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "architectures": None}))
    assert convert_gguf(tmp_path / "gone.gguf", prepared) == prepared
    assert json.loads((prepared / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
