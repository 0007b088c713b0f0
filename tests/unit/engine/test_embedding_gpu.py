"""The embedding runner on CUDA: half precision there, one stream, the same vectors as the CPU.

The real all-MiniLM-L6-v2 checks run on the CPU in test_embedding_runner.py; here a small
random BERT shows that the CUDA path (device placement, float16 by default, padding and
pooling on the GPU) computes the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizer

from workers.engine.embedding_runner import EmbeddingRunner

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "##s", "##ing", "big",
         "small", "red", "blue", "tree", "house", "river", "city", "night"]
TEXTS = ["the cat sat on the mat", "a dog ran far", "", "big red house " * 60,
         "small blue tree by the river at night", "cats dogs running"]


def save_tiny_bert(model_dir: Path) -> None:
    """A 2-layer random BERT with a WordPiece vocabulary, mean pooling and normalisation."""
    model_dir.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab_file=str(model_dir / "vocab.txt")).save_pretrained(model_dir)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(model_dir)
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True}))
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))


@pytest.mark.gpu
def test_cuda_embeddings_equal_the_cpu_ones(tmp_path: Path) -> None:
    """float16 on CUDA against float32 on the CPU: cosine >= 0.999, unit norm, same usage."""
    save_tiny_bert(tmp_path / "bert")
    gpu = EmbeddingRunner(tmp_path / "bert", device="cuda", max_num_batched_tokens=256)
    cpu = EmbeddingRunner(tmp_path / "bert", device="cpu", streams=1)
    assert gpu.dtype == torch.float16 and gpu.streams == 1
    got, want = gpu.embed(TEXTS), cpu.embed(TEXTS)
    assert len(got) == len(TEXTS) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.embedding.device.type == "cpu" and g.embedding.dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(g.embedding, w.embedding, dim=0).item()
        assert cosine >= 0.999
        assert abs(g.embedding.norm().item() - 1.0) < 1e-3
        assert (g.num_tokens, g.is_truncated) == (w.num_tokens, w.is_truncated)
    assert got[3].is_truncated and got[3].num_tokens == gpu.max_model_len
