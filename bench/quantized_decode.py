"""Decode throughput of one model in bf16, GPTQ int4 and FP8, in one run.

A random-weight Llama (Llama-3.2-1B's shape, or a tiny one) is saved in bf16 and written
again as a GPTQ 4-bit (group 128) and an FP8 (per-channel, compressed-tensors) checkpoint
with the formats' own layouts; each loads into the engine as a user's would, and decodes
`--max-tokens` tokens for batches of `--batches` 32-token prompts. Printed per format and
batch: decode tokens/s (the prefill's time taken out, see `_decode`) and tokens/s with the
prefill, their ratios to bf16, and the memory the weights take. On a GPU the quantized
projections stay quantized (Triton dequantize-in-GEMM). On the CPU, 4 bits stay packed
where our int4 kernel runs (x86-64 with AVX2) and FP8 is dequantized at load;
`--quantized-weights packed` keeps both (4 bits elsewhere through torch's int4 GEMM, FP8
dequantized on every call).

    python -m bench.quantized_decode                       # CUDA, 1B shape, batches 1 4 16
    python -m bench.quantized_decode --device cpu --tiny --batches 1 4 --max-tokens 16
    python -m bench.quantized_decode --device cpu --batches 1 2 4 8 16 --max-tokens 32 \
        --formats gptq-int4 --repeats 2                   # the CPU figures in RESULTS.md
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_throughput import machine, random_llama_1b
from tests.unit.engine import quantized_checkpoints as qc
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams
from workers.engine.models.quant_linear import QuantLinear

FORMATS = ("gptq-int4", "fp8")


def _write(name: str, model_dir: Path, group_size: int) -> None:
    if name == "gptq-int4":
        qc.write_gptq(model_dir, bits=4, group_size=group_size, act_order=False)
    else:
        qc.write_fp8(model_dir, strategy="channel")


def _decode(model_dir: Path, device: str, batches: list[int], max_tokens: int,
            vocab: int, quantized_weights: str = "auto", repeats: int = 1
            ) -> tuple[dict[int, tuple[float, float]], float]:
    """(batch -> (decode tokens/s, tokens/s with the prefill), GiB the loaded model's
    weights take: allocated on CUDA, summed over its tensors on the CPU).

    Decode alone: each batch runs twice on fresh prompts of the same length, once for one
    token (the prefill and its token) and once for `max_tokens` (each the fastest of
    `repeats` runs); the decode's rate is the tokens after the first over the difference
    of the two times."""
    before = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    llm = LLM(str(model_dir), dtype="bfloat16", device=device, skip_tokenizer_init=True,
              kv_cache_memory_bytes=4 << 30, quantized_weights=quantized_weights)
    weights_gib = ((torch.cuda.memory_allocated() - before) / 2**30
                   if device.startswith("cuda") else _weight_bytes(llm) / 2**30)
    gen = torch.Generator().manual_seed(0)
    _timed(llm, 2, 8, vocab, gen)  # warm-up: every weight read, the allocator settled
    rates = {}
    for batch in batches:
        prefill_s = min(_timed(llm, batch, 1, vocab, gen) for _ in range(repeats))
        total_s = min(_timed(llm, batch, max_tokens, vocab, gen) for _ in range(repeats))
        decode_rate = batch * (max_tokens - 1) / max(total_s - prefill_s, 1e-9)
        rates[batch] = (decode_rate, batch * max_tokens / total_s)
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rates, weights_gib


def _timed(llm: LLM, batch: int, num_tokens: int, vocab: int, gen: torch.Generator) -> float:
    """Seconds to generate `num_tokens` for `batch` fresh 32-token prompts."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == num_tokens for o in outputs)
    return time.perf_counter() - start


def _weight_bytes(llm: LLM) -> int:
    """Bytes of the model's parameters and buffers, and of the CPU int4 kernels' copies
    and dequantized matrices kept beside quantized projections."""
    model = llm.engine.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, QuantLinear):
            if module.int4 is not None:
                tensors.extend(t for t in (getattr(module.int4, f) for f in
                                           module.int4.__dataclass_fields__)
                               if isinstance(t, torch.Tensor))
            if module.dense is not None:
                tensors.append(module.dense)
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel()}
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of 1B")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each timing, the fastest kept (the tiny model's "
                             "milliseconds need several)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--quantized-weights", default="auto",
                        choices=["auto", "packed", "dequantize"],
                        help="for the quantized formats (see the module docstring)")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.tiny:
            base = root / "bf16"
            save_tiny_llama(base, tie_word_embeddings=False)
            vocab = 256
        else:
            base = random_llama_1b(root)
            vocab = 128256
        dirs = {"bf16": base}
        for name in args.formats:
            dirs[name] = root / name
            shutil.copytree(base, dirs[name])
            _write(name, dirs[name], group_size=32 if args.tiny else 128)
        results = {}
        for name, model_dir in dirs.items():
            mode = "auto" if name == "bf16" else args.quantized_weights
            results[name] = _decode(model_dir, args.device, args.batches, args.max_tokens, vocab,
                                    mode, args.repeats)
            rates, gib = results[name]
            line = ", ".join(f"batch {b}: {r[0]:,.0f} tok/s ({r[1]:,.0f} with the prefill)"
                             for b, r in rates.items())
            print(f"{name:>10}: {line}; model {gib:.3f} GiB", flush=True)
        bf16_rates = results["bf16"][0]
        for name in args.formats:
            for which, title in ((0, "decode"), (1, "with the prefill")):
                ratios = ", ".join(
                    f"batch {b}: {results[name][0][b][which] / bf16_rates[b][which]:.2f}x"
                    for b in args.batches)
                print(f"{name:>10} / bf16, {title}: {ratios}")


if __name__ == "__main__":
    main()
