"""A GPU decode step against the device's memory bandwidth: what `bench.engine_throughput
--roofline` prints (a decode step moves every weight and every sequence's KV once)."""

from __future__ import annotations

import argparse
import time

import torch

from workers.engine import LLM, SamplingParams

# Peak HBM bandwidth by device name, GB/s (override with --peak-bandwidth-gbs).
PEAK_BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0}


def sync() -> None:
    """Wait for the GPU, where there is one: timings then cover the work they name."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_roofline(
    llm: LLM, args: argparse.Namespace, batch: int = 128, context: int = 512
) -> None:
    """Time decode steps at `batch` sequences of `context` tokens against HBM bandwidth."""
    runner = llm.engine.runner
    if runner.device.type != "cuda":
        print("  roofline: needs CUDA, skipped")
        return
    from workers.engine.sequence import Sequence

    blocks_per_seq = -(-(context + 16) // runner.block_size)
    if batch * blocks_per_seq > runner.num_kv_blocks:
        print("  roofline: KV pool too small for the probe, skipped")
        return
    seqs = []
    for i in range(batch):
        seq = Sequence(f"probe-{i}", [100 + i % 50] * context, SamplingParams(temperature=0))
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(seq)
    for i in range(0, batch, 8):  # prefill in slices that fit the token budget
        runner.execute(seqs[i : i + 8], [context] * len(seqs[i : i + 8]))
    for seq in seqs:
        seq.num_computed_tokens = context
        seq.append_token(5)
    steps = 16
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        sampled = runner.execute(seqs, [1] * batch)
        sync()
        times.append(time.perf_counter() - start)
        for seq, token in zip(seqs, sampled, strict=True):
            seq.num_computed_tokens += 1
            seq.append_token(token.token_id if token else 5)
    step = sorted(times)[len(times) // 2]
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.kv_cache[:, :, 0, 0].numel() * runner.kv_cache.element_size()
    kv_bytes = batch * (context + steps // 2) * kv_per_token
    moved = weights + kv_bytes
    name = torch.cuda.get_device_name(runner.device)
    peak = args.peak_bandwidth_gbs or next(
        (bw for key, bw in PEAK_BANDWIDTH_GBS.items() if key in name), None
    )
    achieved = moved / step / 1e9
    line = f"  roofline ({name}): {moved / 1e9:.3f} GB moved per decode step at batch {batch}"
    line += f", {step * 1e3:.2f} ms/step, {achieved:.0f} GB/s"
    if peak:
        line += f" = {achieved / peak:.0%} of {peak:.0f} GB/s peak"
    print(line)
