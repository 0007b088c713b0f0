"""1-token jobs through `LLM.generate` alone: the engine's own cost per short job.

The service benchmark prints this beside the service's figures; on a GPU machine it runs
alone (`python -m bench.short_jobs`), where the model is nearly free and what is left is
the engine's work per step and per request: scheduling, input building, sampling and
detokenizing.

    python -m bench.short_jobs [--jobs 4000] [--max-num-seqs 64 256] [--device auto]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.unit.engine.tiny_models import save_tiny_llama


def job_body(model: str, tag: str, i: int) -> dict[str, Any]:
    """A 1-token greedy text job with a 12-number prompt, distinct per (tag, i)."""
    return {"model": model, "prompt": f"{tag} {i} 4 8 15 16 23 42 7 9 11 13",
            "max_tokens": 1, "temperature": 0}


def engine_jobs_per_second(model_dir: Path, num_jobs: int, max_num_seqs: int = 64,
                           device: str = "auto", enforce_eager: bool = False) -> float:
    """Jobs/s of `LLM.generate` on `num_jobs` distinct 1-token jobs, after as many others.

    The warm-up is the same size as the timed run: on a GPU, Triton compiles a kernel
    variant for each new shape it meets, and those compilations must not be timed.
    """
    from workers.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory_bytes=64 * 1024 * 1024,
              max_num_seqs=max_num_seqs, device=device, enforce_eager=enforce_eager)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([job_body(str(model_dir), "warm-up", i)["prompt"] for i in range(num_jobs)],
                 params)
    prompts = [job_body(str(model_dir), "engine", i)["prompt"] for i in range(num_jobs)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    if len(outputs) != num_jobs or any(len(o.token_ids) != 1 for o in outputs):
        raise RuntimeError("a job did not produce exactly one token")
    return num_jobs / seconds


def main() -> None:
    """Print jobs/s for each batch width, with and without CUDA graphs on a GPU."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    where = torch.cuda.get_device_name() if cuda else "CPU"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        save_tiny_llama(model_dir)
        for width in args.max_num_seqs:
            for eager in ((True, False) if cuda else (True,)):
                rate = engine_jobs_per_second(model_dir, args.jobs, width, args.device, eager)
                graphs = "" if not cuda else (", eager" if eager else ", CUDA graphs")
                print(f"short jobs on {where}: {rate:8.0f} jobs/s ({args.jobs} jobs, "
                      f"max_num_seqs {width}{graphs})", flush=True)


if __name__ == "__main__":
    main()
