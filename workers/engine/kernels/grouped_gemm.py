"""Expert matmuls of a mixture-of-experts layer as one Triton grouped GEMM.

A router sends each of N tokens to `top_k` experts; the P = N * top_k (token, slot) pairs
are the rows of the grouped product. `align_pairs` sorts the pairs by expert and pads each
expert's run to a multiple of BLOCK_M rows, so that every BLOCK_M tile of the sorted order
belongs to one expert: a program multiplies one tile by one expert's weight, reading that
weight tile once for up to BLOCK_M rows.

Tensors (one CUDA device, or CPU under TRITON_INTERPRET=1):
- a: (R, K) contiguous; pair p reads row p // rows_per_a_row: p // top_k in the first
  GEMM (a token's row serves its top_k pairs), p in the second (one row per pair);
- weight: (E, N_out, K) contiguous, nn.Linear's (out, in) layout per expert;
- sorted_pair_ids: (L,) int32, pairs in expert order, each expert's run padded with the
  sentinel P (L >= P + E * (BLOCK_M - 1), an upper bound known without a host sync);
- block_expert_ids: (L / BLOCK_M,) int32, the expert of each tile, -1 for tiles past the
  last run (their programs return at once);
- pair_weights: (P,) float32 routing weights, multiplied into the rows when given;
- out: (P, N_out), a's dtype, row p for pair p.

Grid: (L / BLOCK_M, cdiv(N_out, BLOCK_N)). Accumulation in fp32.

Example of the alignment with E = 3, BLOCK_M = 4, top_k = 1 and experts [2, 0, 2, 2, 2]:
expert 0 gets pair 1, expert 2 gets pairs 0, 2, 3, 4; padded runs are [1, P, P, P] and
[0, 2, 3, 4], so sorted_pair_ids = [1, 5, 5, 5, 0, 2, 3, 4, 5...] and block_expert_ids =
[0, 2, -1, ...] (expert 1 has no run; the tail tiles are unused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernels.interpreter import dot_options


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, pair_weights_ptr,
    num_pairs, n_out, k_dim,
    stride_am, stride_we, stride_wn, stride_om,
    ROWS_PER_A_ROW: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ids_ptr + tile)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)
    is_pair = pairs < num_pairs
    a_rows = pairs // ROWS_PER_A_ROW
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        is_k = ks < k_dim
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=is_pair[:, None] & is_k[None, :], other=0.0)
        # (BLOCK_K, BLOCK_N): column j of the tile is output feature cols[j].
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=is_k[:, None] & is_col[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_WEIGHTS:
        acc *= tl.load(pair_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & is_col[None, :])


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids (L,), block_expert_ids (L / block_m,)) for topk_ids (N, top_k).

    Device ops only (no host sync), so the sizes depend on N, top_k and E alone: a graph
    captured for one batch size replays for any routing.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    length = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded, 0)
    run_starts = run_ends - padded
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    experts_in_order = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_in_order]
    sorted_pair_ids = torch.full((length,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[run_starts[experts_in_order] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, length, block_m, device=device)
    block_expert_ids = torch.searchsorted(run_ends, tile_starts, right=True)
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1)
    return sorted_pair_ids, block_expert_ids.to(torch.int32)


def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert_ids: torch.Tensor,
    *,
    num_pairs: int,
    rows_per_a_row: int,
    block_m: int,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out (num_pairs, N_out): row p is a[p // rows_per_a_row] @ weight[expert of p].T,
    times pair_weights[p] when given; see the module docstring."""
    if a.dim() != 2 or weight.dim() != 3 or a.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)} and weight {tuple(weight.shape)} "
                         "must be (R, K) and (E, N_out, K)")
    if not (a.is_contiguous() and weight.is_contiguous()):
        raise ValueError("grouped_gemm: a and weight must be contiguous")
    n_out, k_dim = weight.shape[1], weight.shape[2]
    out = torch.empty(num_pairs, n_out, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    upcast, precision = dot_options(a.dtype)
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid = (block_expert_ids.shape[0], triton.cdiv(n_out, block_n))
    weights = pair_weights if pair_weights is not None else out  # unread without weights
    _grouped_gemm_kernel[grid](
        a, weight, out, sorted_pair_ids, block_expert_ids, weights,
        num_pairs, n_out, k_dim,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ROWS_PER_A_ROW=rows_per_a_row,
        HAS_WEIGHTS=pair_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
    )  # fmt: skip
    return out
