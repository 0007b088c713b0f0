"""Loading weights into the decoder: Hugging Face safetensors directories, and GGUF files
dequantized once through transformers into such a directory (the cache that makes the
second load fast).

The loader knows no family: the registry names the class, and the class's
`packed_modules_mapping` says which checkpoint matrices stack into which fused projection.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

from workers.engine import cpu_int4
from workers.engine.attention import AttentionBackend
from workers.engine.kv_scales import read_kv_scales, split_kv_scale_names
from workers.engine.models import CausalLM, model_class_for
from workers.engine.models.attention import Attention
from workers.engine.models.experts import ExpertWeights
from workers.engine.models.linear import FusedLinear
from workers.engine.models.quant_linear import QuantLinear
from workers.engine.quantization import QuantScheme, dequantized_tensors, quant_scheme_of
from workers.engine.quantized_loading import (
    load_packed,
    packed_source_names,
    plan_packed,
    swap_in_packed,
)

logger = logging.getLogger(__name__)

# model_type → the transformers class a dequantized GGUF of that family loads as.
_CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3_text": "Gemma3ForCausalLM"}
# Buffers some checkpoints carry that the decoder recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    """Read config.json of a local model directory (never the hub)."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model directory {model_dir} has no config.json")
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def read_eos_token_ids(model_dir: Path, hf_config: PretrainedConfig) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json, merged."""
    found: set[int] = set()
    sources: list[object] = [getattr(hf_config, "eos_token_id", None)]
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(int(v) for v in value)
    return found


def load_model(
    model_dir: Path,
    hf_config: PretrainedConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    *,
    quantized_weights: str = "auto",
) -> CausalLM:
    """Build the decoder on `device` in `dtype` and fill it from the directory's safetensors.

    A quantized checkpoint's projections stay quantized in memory where `quantized_weights`
    says so (`keeps_packed`); the rest are dequantized here.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no .safetensors files")
    model_class = model_class_for(hf_config)
    with torch.device("meta"):  # no init work or memory for weights about to be overwritten
        model = model_class(hf_config, backend).to(dtype)
    scheme = quant_scheme_of(hf_config)
    with ExitStack() as stack:
        # Every file open at once: a quantized linear's parts may sit in different shards.
        handles = [stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                   for path in files]
        file_of = {name: f for f in handles for name in f.keys()}  # noqa: SIM118

        def get(name: str) -> torch.Tensor:
            return file_of[name].get_tensor(name)

        present = set(file_of)
        kv_scale_names, names = split_kv_scale_names(list(file_of))
        plans = []
        if scheme is not None and keeps_packed(quantized_weights, scheme, device, dtype):
            plans = plan_packed(model, scheme, names, get,
                                lambda n: file_of[n].get_slice(n).get_dtype(),
                                lambda n: _target_of(n, model))
            swap_in_packed(model, plans, scheme, dtype)
        model = model.to_empty(device=device)
        model.reset_buffers(device, dtype)
        params = dict(model.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        if scheme is not None:
            load_packed(model, plans, scheme, get, present)
            if device.type == "cpu":
                prepare_cpu_projections(model, dtype, keep_memory=quantized_weights == "packed")
        taken = packed_source_names(plans, present)
        for name, tensor in dequantized_tensors(scheme, [n for n in names if n not in taken],
                                                get):
            target = _target_of(name, model)
            if target is None:
                continue
            param_name, shard = target
            if param_name not in params:
                raise ValueError(f"model checkpoint has an unexpected weight {name!r}")
            sizes = _output_sizes(model, param_name)
            _copy_into(params[param_name], sizes, shard, tensor, name)
            loaded.add(target)
        _set_kv_scales(model, read_kv_scales(kv_scale_names, get))
    _check_complete(model, params, loaded)
    model.eval()
    logger.info("loaded %s (%d files) as %s on %s%s", model_dir, len(files), dtype, device,
                f", {len(plans)} projections kept {scheme.method}-quantized"
                if plans and scheme else "")
    return model


def keeps_packed(mode: str, scheme: QuantScheme, device: torch.device,
                 dtype: torch.dtype) -> bool:
    """Whether a quantized checkpoint's projections stay quantized in memory.

    "auto": on CUDA, where the Triton kernels run (FP8 from compute capability 8.9, the
    first with e4m3 conversions); on the CPU, 4-bit GPTQ/AWQ in bf16 where our int4 kernel
    runs (x86-64 with AVX2), which outruns oneDNN's bf16 GEMM on the dequantized matrices up
    to a few dozen rows; otherwise the CPU dequantizes at load (`cpu_int4`). "packed":
    always (on the CPU: 4 bits through an int4 GEMM in bf16/fp16, else dequantized per
    call, or Triton's interpreter). "dequantize": never.
    """
    if mode not in ("auto", "packed", "dequantize"):
        raise ValueError(f"quantized_weights {mode!r} is not one of auto, packed, dequantize")
    if mode != "auto":
        return mode == "packed"
    if device.type == "cpu":
        return (scheme.method in ("gptq", "awq") and scheme.bits == 4
                and dtype == torch.bfloat16 and cpu_int4.has_tile_kernel())
    if device.type != "cuda":
        return False
    return scheme.method != "fp8" or torch.cuda.get_device_capability(device) >= (8, 9)


def prepare_cpu_projections(model: torch.nn.Module, dtype: torch.dtype, *,
                             keep_memory: bool) -> None:
    """Give each packed projection an int4 kernel's copy where one takes it; the others
    dequantize on every call where the user asked for the memory (`keep_memory`), else
    keep their dequantized matrix."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and not module.prepare_int4(dtype) and not keep_memory:
            module.keep_dequantized(dtype)


def _set_kv_scales(model: CausalLM, scales: dict[str, tuple[float, float]]) -> None:
    """Hand each attention layer the checkpoint's calibrated fp8 KV scales."""
    for path, (k_scale, v_scale) in scales.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, Attention):
            raise ValueError(f"model checkpoint has KV cache scales for {path!r}, which is not "
                             "an attention layer of this model")
        module.set_kv_scales(k_scale, v_scale)
    if scales:
        logger.info("checkpoint carries calibrated KV cache scales for %d layers (used with "
                    "kv_cache_dtype=fp8)", len(scales))


def _target_of(name: str, model: CausalLM) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to (our parameter name, shard) or None to skip it."""
    if name.endswith(_IGNORED_SUFFIXES) or (model.tie_word_embeddings and name == "lm_head.weight"):
        return None
    parts = name.split(".")
    expert = _expert_target(parts, model)
    if expert is not None:
        return expert
    mapping = model.packed_modules_mapping
    if len(parts) >= 2 and parts[-2] in mapping:
        fused, shard = mapping[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, None


def _expert_target(parts: list[str], model: CausalLM) -> tuple[str, int] | None:
    """`<block>.experts.<e>.<proj>.weight` -> (`<block>.experts.<stacked>.weight`, shard).

    Expert e's matrix j of a stacked projection is shard e * (matrices per expert) + j:
    with gate/up stacked in w13, expert 3's up_proj is shard 7.
    """
    mapping = model.expert_modules_mapping
    if len(parts) < 4 or parts[-4] != "experts" or parts[-2] not in mapping:
        return None
    stacked, index = mapping[parts[-2]]
    param_name = ".".join([*parts[:-3], stacked, parts[-1]])
    module = model.get_submodule(".".join([*parts[:-3], stacked]))
    if not (isinstance(module, ExpertWeights) and parts[-3].isdigit()
            and int(parts[-3]) < module.num_experts):
        raise ValueError(f"model checkpoint has an unexpected weight {'.'.join(parts)!r}")
    per_expert = len(module.output_sizes) // module.num_experts
    return param_name, int(parts[-3]) * per_expert + index


def _output_sizes(model: CausalLM, param_name: str) -> list[int] | None:
    """Row sizes of the checkpoint matrices stacked in a fused parameter, else None."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    if isinstance(module, FusedLinear | ExpertWeights | QuantLinear):
        return module.output_sizes
    return None


def _copy_into(
    param: torch.Tensor,
    sizes: list[int] | None,
    shard: int | None,
    tensor: torch.Tensor,
    name: str,
) -> None:
    """Copy a checkpoint tensor into a parameter, or into its rows of a fused parameter."""
    target = param.data
    if shard is not None:
        if sizes is None:
            raise ValueError(f"model checkpoint has an unexpected weight {name!r}")
        target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(
            f"model weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


def _check_complete(
    model: CausalLM,
    params: dict[str, torch.nn.Parameter],
    loaded: set[tuple[str, int | None]],
) -> None:
    """Every parameter (every shard of a fused one) must have come from the checkpoint."""
    missing = []
    for name in params:
        if (name, None) in loaded:  # whole, fused or not (Phi-3 packs q/k/v itself)
            continue
        sizes = _output_sizes(model, name)
        shards: list[int | None] = list(range(len(sizes))) if sizes else [None]
        missing += [
            f"{name}[{s}]" if s is not None else name for s in shards if (name, s) not in loaded
        ]
    if missing:
        raise ValueError(f"model checkpoint lacks weights: {', '.join(missing[:8])}")


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors model directory with its tokenizer.

    Returns out_dir at once when it is already prepared. Writes into a temporary sibling
    and renames it into place, so concurrent workers never see a half-written directory.
    """
    if (out_dir / "config.json").is_file():
        _name_architecture(out_dir)
        return out_dir
    if not gguf_file.is_file():
        raise ValueError(f"model file {gguf_file} does not exist")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        logger.info("dequantizing %s into %s (once)", gguf_file, out_dir)
        kwargs = {"gguf_file": gguf_file.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        hf_model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, dtype=torch.float32, **kwargs
        )
        tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
        state = {
            name: tensor.contiguous()
            for name, tensor in hf_model.state_dict().items()
            if not (tied and name == "lm_head.weight")  # shared with the embedding
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)  # the saved weights are plain fp32
        config["dtype"] = "float32"
        # transformers leaves it null for GGUF loads; vLLM and others refuse such a config.
        config["architectures"] = [type(hf_model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # tokenizer.json, chat template included
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            logger.info("%s was prepared concurrently; keeping that copy", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _name_architecture(model_dir: Path) -> None:
    """Fill in `architectures` of a directory an older version prepared with it null."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures"):
        return
    config["architectures"] = [_CAUSAL_LM_CLASSES.get(config.get("model_type"), "LlamaForCausalLM")]
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True))
        tmp.replace(path)
    except OSError as e:  # a read-only copy still loads; only other tools would object
        logger.warning("cannot name the architecture in %s: %s", path, e)
        return
    logger.info("named the architecture of %s: %s", model_dir, config["architectures"][0])
