"""Decode throughput of one model in bf16, GPTQ int4 and FP8, in one run.

A random-weight Llama (Llama-3.2-1B's shape, or a tiny one) is saved in bf16 and written
again as a GPTQ 4-bit (group 128) and an FP8 (per-channel, compressed-tensors) checkpoint
with the formats' own layouts; each loads into the engine as a user's would, and decodes
`--max-tokens` tokens for batches of `--batches` prompts. Printed per format and batch:
output tokens/s, the ratio to bf16, and the GPU memory the weights took. On a GPU the
quantized projections stay quantized (Triton dequantize-in-GEMM); on the CPU they are
dequantized at load, so there the three should match, unless `--quantized-weights packed`
keeps them (4 bits then run torch's int4 GEMM, FP8 is dequantized on every call).

    python -m bench.quantized_decode                       # CUDA, 1B shape, batches 1 4 16
    python -m bench.quantized_decode --device cpu --tiny --batches 1 4 --max-tokens 16
    python -m bench.quantized_decode --device cpu --batches 1 4 8 --quantized-weights packed
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

FORMATS = ("gptq-int4", "fp8")


def _write(name: str, model_dir: Path, group_size: int) -> None:
    if name == "gptq-int4":
        qc.write_gptq(model_dir, bits=4, group_size=group_size, act_order=False)
    else:
        qc.write_fp8(model_dir, strategy="channel")


def _decode(model_dir: Path, device: str, batches: list[int], max_tokens: int,
            vocab: int, quantized_weights: str = "auto") -> tuple[dict[int, float], float]:
    """(batch -> output tokens/s, GiB allocated by the loaded model on CUDA)."""
    before = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    llm = LLM(str(model_dir), dtype="bfloat16", device=device, skip_tokenizer_init=True,
              kv_cache_memory_bytes=4 << 30, quantized_weights=quantized_weights)
    weights_gib = ((torch.cuda.memory_allocated() - before) / 2**30
                   if device.startswith("cuda") else 0.0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    llm.generate([torch.randint(0, vocab, (16,), generator=gen).tolist()], params)  # warm-up
    rates = {}
    for batch in batches:
        prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(batch)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        rates[batch] = sum(len(o.token_ids) for o in outputs) / elapsed
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rates, weights_gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of 1B")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--quantized-weights", default="auto",
                        choices=["auto", "packed", "dequantize"],
                        help="for the quantized formats (packed on the CPU: int4 through "
                             "torch's int4 GEMM, FP8 dequantized per call)")
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
                                    mode)
            rates, gib = results[name]
            line = ", ".join(f"batch {b}: {r:,.0f} tok/s" for b, r in rates.items())
            print(f"{name:>10}: {line}" + (f"; model {gib:.2f} GiB" if gib else ""), flush=True)
        bf16_rates = results["bf16"][0]
        for name in args.formats:
            ratios = ", ".join(f"batch {b}: {results[name][0][b] / bf16_rates[b]:.2f}x"
                               for b in args.batches)
            print(f"{name:>10} / bf16: {ratios}")


if __name__ == "__main__":
    main()
