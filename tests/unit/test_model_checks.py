"""`models prepare|pull` and `up` refuse, before anything starts, what a worker cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import GPT2Config

from cli.main import main
from tests.unit.engine.tiny_models import save_tiny_llama, save_tokenizer, tiny_llama_config


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    """A GPT-2 config directory: a causal LM the engine's loader does not run."""
    model_dir = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_head=2, n_embd=16).save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("action", ["prepare", "pull"])
def test_models_prepare_and_pull_refuse_gpt2(action: str, gpt2_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with the engine's reason (the architecture), no card, nothing printed to
    stdout for a script to mistake for a path."""
    code = main(["models", action, str(gpt2_dir), "--models-dir", str(tmp_path / "models")])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert f"{gpt2_dir} cannot be served: model architecture 'gpt2' is not supported" in err


def test_models_prepare_accepts_a_llama_directory(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama-layout directory passes the same check; pull prints its path, prepare its
    card."""
    model_dir = tmp_path / "llama"
    save_tiny_llama(model_dir)
    models_dir = str(tmp_path / "models")
    assert main(["models", "pull", str(model_dir), "--models-dir", models_dir]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)
    assert main(["models", "prepare", str(model_dir), "--served-model-name", "tiny",
                 "--models-dir", models_dir]) == 0
    card = json.loads(capsys.readouterr().out)
    assert (card["name"], card["kind"], card["path"]) == ("tiny", "chat", str(model_dir))


def test_models_prepare_refuses_a_directory_without_weights_or_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A servable config is not yet a servable model: its worker would load weights and a
    tokenizer and fail, three times, before the model is marked failed."""
    model_dir = tmp_path / "llama"
    tiny_llama_config().save_pretrained(model_dir)
    models_dir = str(tmp_path / "models")
    assert main(["models", "prepare", str(model_dir), "--models-dir", models_dir]) == 2
    assert f"{model_dir} cannot be served: it has no .safetensors weights" in (
        capsys.readouterr().err)
    save_tiny_llama(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    assert main(["models", "prepare", str(model_dir), "--models-dir", models_dir]) == 2
    assert "it has no tokenizer" in capsys.readouterr().err
    save_tokenizer(model_dir)
    assert main(["models", "prepare", str(model_dir), "--models-dir", models_dir]) == 0


def test_up_refuses_gpt2_before_starting_anything(gpt2_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`up --model <gpt2>` exits 2 naming the model and the reason; no broker, Redis or
    database was started (the data directory holds no database)."""
    data_dir = tmp_path / "data"
    # `up` publishes its settings in the environment; monkeypatch restores these after
    # (set first: a delenv of an unset name records nothing to restore, and the database
    # URL `up` sets would then point every later test of this process at this one's).
    for name in ("API_PORT", "DATABASE_URL", "API_HOST", "API_REUSE_PORT", "API_PROCESSES"):
        monkeypatch.setenv(f"BATCHINFER_{name}", "")
        monkeypatch.delenv(f"BATCHINFER_{name}")
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(data_dir))
    monkeypatch.setenv("BATCHINFER_MODELS_DIR", str(tmp_path / "models"))
    code = main(["up", "--model", str(gpt2_dir), "--served-model-name", "g",
                 "--data-dir", str(data_dir), "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert (f"batchinfer up: {gpt2_dir} cannot be served: model architecture 'gpt2' is not "
            "supported") in err
    assert not list(data_dir.glob("*.db"))
    assert not (data_dir / "redis").exists()


def test_the_served_families_named_without_torch_are_the_registry_s() -> None:
    """`up`'s early refusal reads a list of names; the engine's registry decides support.
    A family added to one and not the other would be refused early, or let through to
    the full check, by mistake."""
    from workers.engine.model_types import SERVED_MODEL_TYPES
    from workers.engine.models import SUPPORTED_MODEL_TYPES

    assert SERVED_MODEL_TYPES == SUPPORTED_MODEL_TYPES


def _config_dir(path: Path, config: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_precheck_refuses_a_family_the_engine_does_not_serve_in_the_full_check_s_words(
        gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same sentence whichever check speaks first."""
    from scheduler.model_precheck import precheck

    with pytest.raises(ValueError) as refused:
        precheck(str(gpt2_dir), tmp_path / "models")
    assert main(["models", "prepare", str(gpt2_dir), "--models-dir", str(tmp_path)]) == 2
    assert f"batchinfer models prepare: {refused.value}\n" in capsys.readouterr().err


def test_precheck_passes_what_it_can_read_and_defers_what_only_preparing_can_tell(
        tmp_path: Path) -> None:
    """A served family, an encoder, or a name prepared under the models directory pass;
    a GGUF file, a known name still to pull, a config without model_type or one that is not
    JSON are left to the full preparation, which has the words for them."""
    from scheduler.model_precheck import precheck

    models_dir = tmp_path / "models"
    llama = tiny_llama_config()
    llama.save_pretrained(tmp_path / "llama")
    assert precheck(str(tmp_path / "llama"), models_dir) == (tmp_path / "llama", "chat")
    llama.save_pretrained(models_dir / "mine")
    assert precheck("mine", models_dir) == (models_dir / "mine", "chat")
    encoder = _config_dir(tmp_path / "encoder", {"model_type": "bert",
                                                  "architectures": ["BertModel"]})
    assert precheck(str(encoder), models_dir) == (encoder, "embedding")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert precheck(str(gguf), models_dir) is None
    assert precheck("smollm2-135m-instruct", models_dir) is None
    untyped = _config_dir(tmp_path / "untyped", {"hidden_size": 8})
    assert precheck(str(untyped), models_dir) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert precheck(str(broken), models_dir) is None
