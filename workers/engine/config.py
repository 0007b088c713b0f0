"""Engine options, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODELS_DIR = Path.home() / ".cache" / "batchinfer" / "models"

# Tokens per step when `max_num_batched_tokens` is not given. A GPU wants wide steps to fill
# its cores; a CPU's prefill runs fastest in chunks whose activations stay in its caches
# (SmolLM2-135M prefill on 2 EPYC cores: 2,048 tokens 1.3x faster than 8,192 in fp32, 1.1x
# in bf16; see bench/RESULTS.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes one engine instance.

    `block_size=None` lets the attention backend choose (flash-attn's paged KV needs a
    multiple of 256; Triton a power of two >= 16, default 16; the torch path any, default
    16). The KV pool is sized from
    `kv_cache_memory_bytes` when given, else from `gpu_memory_utilization` of free CUDA
    memory, else (CPU) 1 GiB or what `max_num_seqs` full-length sequences need, if less;
    `num_kv_blocks` overrides both, for tests that want preemption.
    """

    model: str
    models_dir: Path = DEFAULT_MODELS_DIR
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto | cpu | torch | triton | flash
    block_size: int | None = None
    # What the KV pool stores: "auto" the model's dtype; "fp8" (or "fp8_e4m3") e4m3 bytes,
    # divided by the checkpoint's calibrated K/V scales where it has them (kv_scales), as
    # vLLM's: half a bf16 pool's bytes a token, so twice the sequences fit. Attention reads
    # them back into the model's dtype.
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the device's default (above)
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Keep this fraction of blocks free when admitting new work, so running sequences
    # rarely need preempting to grow.
    watermark: float = 0.01
    enforce_eager: bool = False  # True disables CUDA graphs
    # Build step N's outputs (detokenize, stop strings) while the GPU runs step N+1; steps
    # then return the previous step's outputs. None: on for CUDA, off on the CPU (no GPU
    # to overlap with).
    overlap_output_processing: bool | None = None
    skip_tokenizer_init: bool = False  # token-id-only use, e.g. random-weight models
    # Latency classes: priority value -> seconds a decode step may take while it holds
    # sequences of that priority (less urgent ones sit steps out to keep it); a priority
    # not listed has no target. Empty: every step runs as wide as the budget allows.
    step_time_targets: dict[int, float] = field(default_factory=dict)
    # And priority value -> how many times the cost of its own work (with any more urgent
    # work) a step holding it may take: a bound that scales with the device and the model,
    # where seconds bind only where full steps are slower than them.
    step_slowdowns: dict[int, float] = field(default_factory=dict)
    # Seconds the prefill chunks of one step may add to it (the cost model prices them): a
    # request arriving mid-step waits for the step, so this bounds how long wide prefill
    # of less urgent work keeps it out. None: the token budget alone sizes a step.
    max_prefill_step_time: float | None = None
    # Within a priority, tenants over their weighted share of its running sequences sit
    # steps out so that tenants under it take shorter steps, losing at most this fraction
    # of their throughput over a long run (tenant_share). None: no cap.
    tenant_max_loss: float | None = None
    # A quantized checkpoint's projections: "auto" keeps them quantized on CUDA (Triton
    # dequantize-in-GEMM kernels) and dequantizes them at load on the CPU; "packed" or
    # "dequantize" forces one (loader.keeps_packed).
    quantized_weights: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        self.models_dir = Path(self.models_dir)
        if self.dtype not in {"auto", "float32", "bfloat16", "float16"}:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.attention_backend not in {"auto", "cpu", "torch", "triton", "flash"}:
            raise ValueError(
                "attention_backend must be auto, cpu, torch, triton or flash, "
                f"got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantized_weights not in {"auto", "packed", "dequantize"}:
            raise ValueError("quantized_weights must be auto, packed or dequantize, "
                             f"got {self.quantized_weights!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_prefill_step_time is not None and not self.max_prefill_step_time > 0:
            raise ValueError("max_prefill_step_time must be > 0 seconds, got "
                             f"{self.max_prefill_step_time}")
        if self.tenant_max_loss is not None and not 0 < self.tenant_max_loss < 1:
            raise ValueError(f"tenant_max_loss must be in (0, 1), got {self.tenant_max_loss}")
        for priority, seconds in self.step_time_targets.items():
            if not seconds > 0:
                raise ValueError(
                    f"step_time_targets[{priority}] must be > 0 seconds, got {seconds}"
                )
        for priority, factor in self.step_slowdowns.items():
            if not factor >= 1:
                raise ValueError(f"step_slowdowns[{priority}] must be >= 1, got {factor}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
