"""Where a decode step's host time goes: a step profiler for `bench.engine_throughput`.

`--workload host-overhead` runs a model whose forward costs almost nothing (2 layers,
hidden 256, a 2,048-token vocabulary) on 256 sequences decoding 128-256 tokens each, token
ids only: what is left of a step is the engine's own work, which bounds a GPU engine on
small and medium models. The profiler wraps the engine's phase methods on one instance
(nothing in the engine knows of it) and sums, per phase, wall time and the calling
thread's CPU time. Thread CPU time is the figure to read on a shared machine: wall time
stretches with the neighbours' load, the host's own work (one Python thread) much less.

Phases of `LLMEngine.step`, each the named method's time less the phases nested in it:

  schedule    Scheduler.schedule: which sequences run, how many tokens, KV blocks
  prepare     ModelRunner.compute_logits less forward and logits: packing the step's
              token ids, positions, slots and attention metadata into tensors
  forward     the model's forward (its own ops and the attention kernels)
  logits      the vocabulary projection of the rows that sample
  sample      Sampler.sample_on_device: picking tokens, still as a tensor
  postprocess Scheduler.postprocess: tokens appended, stop checks, blocks cached or freed
  outputs     building RequestOutputs (and detokenizing, with a tokenizer)
  other       the rest of step(): the host sync and transfer of tokens, bookkeeping

Host work per step is everything but forward, logits and sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PHASES = ("schedule", "prepare", "forward", "logits", "sample", "postprocess", "outputs",
          "other")
DEVICE_PHASES = ("forward", "logits", "sample")

# The host-overhead workload's model: the forward is a few small matmuls.
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def tiny_model(root: Path) -> Path:
    """A random-weight 2-layer Llama of hidden 256 (fp32), saved under root; no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = root / "tiny-llama-2x256"
    model: Any = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE))
    model.save_pretrained(path)
    return path


@dataclass(slots=True)
class _Timer:
    wall: float = 0.0
    cpu: float = 0.0


@dataclass(slots=True)
class StepProfiler:
    """Per-phase wall and thread-CPU seconds over the steps of one engine (see module doc)."""

    timers: dict[str, _Timer] = field(default_factory=lambda: {p: _Timer() for p in PHASES})
    num_steps: int = 0
    num_seqs: int = 0  # unfinished sequences at the start of each step, summed
    _stack: list[list[float]] = field(default_factory=list)  # nested time per open phase

    def attach(self, engine: Any) -> None:
        """Wrap the phase methods of `engine` (an LLMEngine) and of its parts."""
        runner, scheduler = engine.runner, engine.scheduler
        self._wrap(engine, "step", "other", count_step=True)
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(runner, "compute_logits", "prepare")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner.sampler, "sample_on_device", "sample")
        self._wrap(scheduler, "postprocess", "postprocess")
        self._wrap(engine, "_advance_all", "outputs")

    def _wrap(self, owner: Any, name: str, phase: str, count_step: bool = False) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        timer = self.timers[phase]

        def timed(*args: Any, **kwargs: Any) -> Any:
            if count_step:
                self.num_steps += 1
                self.num_seqs += len(owner.scheduler.running) + len(owner.scheduler.waiting)
            nested = [0.0, 0.0]
            self._stack.append(nested)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                result = inner(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                self._stack.pop()
                timer.wall += wall - nested[0]
                timer.cpu += cpu - nested[1]
                if self._stack:  # the enclosing phase excludes this one
                    self._stack[-1][0] += wall
                    self._stack[-1][1] += cpu
            return result

        setattr(owner, name, timed)

    def host_us_per_step(self, cpu: bool = True) -> float:
        """Microseconds per step of everything but the device phases."""
        seconds = sum(getattr(self.timers[p], "cpu" if cpu else "wall")
                      for p in PHASES if p not in DEVICE_PHASES)
        return 1e6 * seconds / max(1, self.num_steps)

    def report(self) -> str:
        """One line per phase: us per step (wall, thread CPU) and its share of the step."""
        steps = max(1, self.num_steps)
        total_wall = sum(t.wall for t in self.timers.values())
        lines = [f"  step profile over {self.num_steps} steps "
                 f"({self.num_seqs / steps:.0f} unfinished sequences per step on average):",
                 f"    {'phase':<12} {'wall us/step':>12} {'cpu us/step':>12} {'of wall':>8}"]
        for phase, t in self.timers.items():
            lines.append(f"    {phase:<12} {1e6 * t.wall / steps:12.0f} {1e6 * t.cpu / steps:12.0f}"
                         f" {t.wall / max(total_wall, 1e-9):8.0%}")
        lines.append(f"    host work (all but {', '.join(DEVICE_PHASES)}): "
                     f"{self.host_us_per_step(cpu=False):.0f} us wall, "
                     f"{self.host_us_per_step():.0f} us thread CPU per step")
        return "\n".join(lines)
