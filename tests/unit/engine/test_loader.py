"""Loading checkpoints (fp32/bf16/fp16, GGUF) and resolving model names."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.engine.checkpoints import hf_logits, make_seq, place, save_llama
from workers.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.loader import convert_gguf, load_hf_config, read_eos_token_ids
from workers.engine.model_runner import ModelRunner
from workers.engine.registry import list_models, pull_model, resolve_model

PROMPT = [5, 9, 33, 200, 17, 4, 81, 120, 7, 7, 64]


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Our logits for the last token of one prompt, prefilled in one step."""
    seq = make_seq(tokens)
    place([seq], [len(tokens)], runner.block_size)
    return runner.compute_logits([seq], [len(tokens)])[1][0].float()


def cpu_runner(model: str | Path, models_dir: Path | None = None, **options: object) -> ModelRunner:
    """A CPU runner with a small pool."""
    extra = {"models_dir": models_dir} if models_dir is not None else {}
    config = EngineConfig(model=str(model), device="cpu", num_kv_blocks=32, **extra, **options)  # type: ignore[arg-type]
    return ModelRunner(config)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_and_logits(tmp_path: Path, dtype: str) -> None:
    """An fp32 checkpoint loads into bf16/fp16: weights are the rounded originals."""
    hf_model = save_llama(tmp_path)
    runner = cpu_runner(tmp_path, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    assert runner.dtype == torch_dtype
    embed = runner.model.model.embed_tokens.weight
    assert embed.dtype == torch_dtype
    assert torch.equal(embed, hf_model.model.embed_tokens.weight.to(torch_dtype))
    qkv = runner.model.layers[1].self_attn.qkv_proj.weight
    k_rows = hf_model.model.layers[1].self_attn.k_proj.weight.to(torch_dtype)
    assert torch.equal(qkv[64:96], k_rows)  # q: 4 heads x 16, then k: 2 heads x 16
    ours = last_logits(runner, PROMPT)
    torch.testing.assert_close(ours, hf_logits(hf_model, PROMPT)[-1], atol=0.05, rtol=0.05)


def test_bf16_checkpoint_loads_exactly_into_fp32(tmp_path: Path) -> None:
    """Weights saved in bf16 are upcast without change; dtype auto on CPU is fp32."""
    hf_model: Any = save_llama(tmp_path)
    hf_model = hf_model.to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    runner = cpu_runner(tmp_path)
    assert runner.dtype == torch.float32
    gate_up = runner.model.layers[0].mlp.gate_up_proj.weight
    up = hf_model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(gate_up[96:], up.float())
    expected = hf_logits(hf_model.float(), PROMPT)[-1]
    torch.testing.assert_close(last_logits(runner, PROMPT), expected, atol=1e-4, rtol=0)


def test_missing_or_unexpected_weights_are_refused(tmp_path: Path) -> None:
    """A checkpoint must cover every parameter and nothing else."""
    save_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    save_file({k: v for k, v in state.items() if "layers.1.self_attn.v_proj" not in k}, path)
    with pytest.raises(ValueError, match=r"lacks weights: model\.layers\.1\.self_attn\.qkv_proj"):
        cpu_runner(tmp_path)
    save_file({**state, "model.layers.0.extra.weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="unexpected weight"):
        cpu_runner(tmp_path)
    save_file({**state, "model.norm.weight": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match="shape"):
        cpu_runner(tmp_path)


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    """EOS ids come from config.json and generation_config.json together."""
    save_llama(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_eos_token_ids(tmp_path, load_hf_config(tmp_path)) == {2, 7}


def test_pool_size_and_max_model_len_follow_the_config(tmp_path: Path) -> None:
    """num_kv_blocks wins; else a byte budget; max_model_len never exceeds the model's."""
    save_llama(tmp_path)  # 2 layers, 2 KV heads of 16: 2*2*16*2*16*4 = 8 KiB per block
    assert cpu_runner(tmp_path, block_size=16).num_kv_blocks == 32
    config = EngineConfig(
        model=str(tmp_path), device="cpu", block_size=16, kv_cache_memory_bytes=1 << 20
    )
    runner = ModelRunner(config)
    assert runner.num_kv_blocks == (1 << 20) // 8192
    assert runner.max_model_len == 512
    assert cpu_runner(tmp_path, max_model_len=100).max_model_len == 100
    assert cpu_runner(tmp_path, max_model_len=10_000).max_model_len == 512
    # The CPU default: what max_num_seqs (256) sequences of 512 tokens hold, under 1 GiB.
    default = ModelRunner(EngineConfig(model=str(tmp_path), device="cpu"))
    assert default.num_kv_blocks == 256 * (512 // 16) and default.block_size == 16
    assert ModelRunner(
        EngineConfig(model=str(tmp_path), device="cpu", max_num_seqs=1, max_model_len=300)
    ).num_kv_blocks == -(-300 // 16)


def test_step_token_budget_defaults_by_device(tmp_path: Path) -> None:
    """Unset, a CPU engine's steps take 2,048 tokens (a GPU's 8,192); a set budget wins and
    reaches the scheduler."""
    save_llama(tmp_path)
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == {"cpu": 2048, "cuda": 8192}
    assert cpu_runner(tmp_path).max_num_batched_tokens == 2048
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=32,
                                    max_num_batched_tokens=96, skip_tokenizer_init=True))
    assert engine.runner.max_num_batched_tokens == engine.scheduler.max_num_batched_tokens == 96
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig(model="m", max_num_batched_tokens=0)


def test_cpu_default_pool_stops_at_one_gib(tmp_path: Path) -> None:
    """A long context times max_num_seqs beyond 1 GiB gets exactly 1 GiB of blocks."""
    save_llama(tmp_path, max_position_embeddings=1 << 20)  # 8 KiB per 16-token block
    default = ModelRunner(EngineConfig(model=str(tmp_path), device="cpu"))
    assert default.num_kv_blocks == (1 << 30) // 8192


def test_unknown_and_unprepared_model_names(tmp_path: Path) -> None:
    """Unknown names name `model`; known but not pulled names say how to pull them."""
    with pytest.raises(ValueError, match="model 'no-such-model'"):
        resolve_model("no-such-model", tmp_path)
    with pytest.raises(ValueError, match="batchinfer models pull smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct", tmp_path)
    with pytest.raises(ValueError, match="model 'no-such-model'"):
        pull_model("no-such-model", tmp_path)
    with pytest.raises(ValueError, match="model"):
        cpu_runner("no-such-model", models_dir=tmp_path)


def test_prepared_names_and_paths_resolve(tmp_path: Path) -> None:
    """A directory under models_dir resolves by name; any model directory by path."""
    save_llama(tmp_path / "tiny")
    assert resolve_model("tiny", tmp_path) == tmp_path / "tiny"
    assert resolve_model(str(tmp_path / "tiny"), Path("/nonexistent")) == tmp_path / "tiny"
    assert list_models(tmp_path) == ["tiny"]


def write_tiny_gguf(path: Path) -> None:
    """A 2-layer GQA Llama GGUF (fp32 tensors) with a byte-level BPE tokenizer."""
    import gguf
    from tokenizers import pre_tokenizers

    tokens = ["<unk>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he"]
    hidden, inter, layers, heads, kv_heads = 64, 96, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", 1 + weight(hidden))
    for i in range(layers):
        for name, shape in [
            ("attn_norm", (hidden,)),
            ("ffn_norm", (hidden,)),
            ("attn_q", (heads * head_dim, hidden)),
            ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)),
            ("attn_output", (hidden, heads * head_dim)),
            ("ffn_gate", (inter, hidden)),
            ("ffn_up", (inter, hidden)),
            ("ffn_down", (hidden, inter)),
        ]:
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape) + (len(shape) == 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_is_dequantized_once_into_a_cached_directory(tmp_path: Path) -> None:
    """A .gguf path loads like transformers' own GGUF load; the cache is reused after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = tmp_path / "gguf-src"
    gguf_dir.mkdir()
    write_tiny_gguf(gguf_dir / "tiny.gguf")
    models_dir = tmp_path / "models"
    runner = cpu_runner(gguf_dir / "tiny.gguf", models_dir=models_dir)
    cached = models_dir / "gguf" / "tiny"
    assert runner.model_dir == cached
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in cached.iterdir()
    }
    assert runner.eos_token_ids == {2}
    # Named, as tools that read config.json (vLLM among them) require.
    assert json.loads((cached / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(cached)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<s>hi</s>"
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="tiny.gguf").eval()
    expected = hf_logits(hf_model, PROMPT)[-1]
    torch.testing.assert_close(last_logits(runner, PROMPT), expected, atol=1e-4, rtol=0)
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert convert_gguf(gguf_dir / "tiny.gguf", cached) == cached
    assert resolve_model(str(gguf_dir), models_dir) == cached  # a directory with one .gguf
    assert time.perf_counter() - start < 1.0
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
