"""Plain torch definition of a mixture-of-experts feed-forward: the spec its kernels and
its grouped CPU path are tested on.

x (N, H) tokens; w13 (E, 2 I, H) each expert's gate and up projections stacked (gate
first); w2 (E, H, I) its down projection; topk_ids (N, top_k) and topk_weights (N, top_k)
the router's choice. Every expert runs on every token (dense), then the chosen ones are
weighted and summed: slow and obviously right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """(N, H): sum over slots j of topk_weights[:, j] * expert[topk_ids[:, j]](x), SwiGLU."""
    inter = w2.shape[2]
    h13 = torch.einsum("nh,eoh->neo", x.float(), w13.float())  # (N, E, 2 I)
    act = F.silu(h13[..., :inter]) * h13[..., inter:]  # (N, E, I)
    every = torch.einsum("nei,ehi->neh", act, w2.float())  # (N, E, H)
    chosen = torch.gather(every, 1, topk_ids.long()[..., None].expand(-1, -1, every.shape[2]))
    return (chosen * topk_weights.float()[..., None]).sum(1).to(x.dtype)
