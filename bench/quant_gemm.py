"""Decode-shaped matmuls with quantized weights against bf16, on one GPU.

For each projection shape of a Llama-3-8B layer and each batch of rows, times the int4
(GPTQ group 128) and FP8 (per-channel) dequantize-in-GEMM kernels and torch's bf16 matmul
in the same run, checks each against its dequantized matrix, and prints the times, the
weight bytes each read per second, and the speed-up over bf16. A decode step is
memory-bound at these batches, so int4 should approach 4x and FP8 2x of bf16.

    python -m bench.quant_gemm                      # CUDA, Llama-3-8B shapes, batch 1-64
    TRITON_INTERPRET=1 python -m bench.quant_gemm --device cpu --shapes 128x256 --batches 1 4
        # the same code path on the CPU under Triton's interpreter (correctness only)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from workers.engine.kernels.quant_gemm import fp8_weight_gemm, int_weight_gemm
from workers.engine.quantized_layouts import pack_rows

# (out, in) of a Llama-3-8B layer's projections: q/k/v fused, o, gate/up fused, down.
LLAMA3_8B = ["6144x4096", "4096x4096", "28672x4096", "4096x14336"]


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    """Median seconds of one call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _int4(n: int, k: int, device: torch.device, group: int = 128
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int4 weights in the kernel's layout and the matrix they stand for."""
    q = torch.randint(0, 16, (k, n), device=device)
    scales = torch.rand(k // group, n, device=device) / 64 + 1e-3
    zeros = torch.randint(0, 16, (k // group, n), device=device).float()
    groups = torch.arange(k, device=device) // group
    matrix = ((q.float() - zeros[groups]) * scales[groups]).t()
    return pack_rows(q, 4), scales, zeros, matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=LLAMA3_8B, help="OUTxIN")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          "times are medians; GB/s counts the weight bytes each path reads")
    print(f"{'shape':>12} {'rows':>4} | {'bf16 us':>8} {'GB/s':>6} | {'int4 us':>8} {'GB/s':>6} "
          f"{'x':>5} | {'fp8 us':>8} {'GB/s':>6} {'x':>5}")
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        qweight, scales, zeros, matrix = _int4(n, k, device)
        dense = matrix.to(dtype).contiguous()
        fp8_scale = matrix.abs().amax(1, keepdim=True) / 448
        fp8 = (matrix / fp8_scale).to(torch.float8_e4m3fn)
        for rows in args.batches:
            x = torch.randn(rows, k, device=device, dtype=dtype) / k**0.5
            expected = x.float() @ matrix.t()
            got = int_weight_gemm(x, qweight, scales, zeros, bits=4, group_size=128)
            torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=5e-2)
            bf16_s = _timed(partial(torch.matmul, x, dense.t()), device, args.repeats)
            int4_s = _timed(partial(int_weight_gemm, x, qweight, scales, zeros, bits=4,
                                    group_size=128), device, args.repeats)
            dense_gb = n * k * 2 / 1e9
            int4_gb = (n * k / 2 + 2 * scales.numel() * 4) / 1e9
            line = (f"{shape:>12} {rows:>4} | {bf16_s * 1e6:8.1f} {dense_gb / bf16_s:6.0f} | "
                    f"{int4_s * 1e6:8.1f} {int4_gb / int4_s:6.0f} {bf16_s / int4_s:5.2f}")
            if fp8_ok:
                fp8_s = _timed(partial(fp8_weight_gemm, x, fp8, fp8_scale, block_n=1,
                                       block_k=k), device, args.repeats)
                line += f" | {fp8_s * 1e6:8.1f} {n * k / 1e9 / fp8_s:6.0f} {bf16_s / fp8_s:5.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
