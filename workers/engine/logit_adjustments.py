"""What changes the logits before a token is picked: bias, penalties, grammar masks.

Each is one tensor operation over the rows that ask for it, not a loop over sequences:
- `logit_bias`: OpenAI's token id -> bias, added as one sparse scatter;
- `presence_penalty` / `frequency_penalty`: OpenAI's formula over the tokens generated so
  far, `logit -= frequency * count + presence * (count > 0)`, from one count matrix;
- grammar masks: tokens the grammar does not allow go to -inf, so greedy, top-k and top-p
  only ever see allowed ones.
The order is OpenAI's and vLLM's: bias and penalties first, the mask last (a bias can
never revive a token the grammar forbids).
"""

from __future__ import annotations

import torch

from workers.engine.grammar import StepMasks, bitmask_to_allowed
from workers.engine.sampling_params import SamplingParams


def needs_adjusting(params: list[SamplingParams], masks: StepMasks | None) -> bool:
    """True when some row's logits change before sampling."""
    return masks is not None or any(p.logit_bias or p.has_penalties for p in params)


def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]] | None,
    masks: StepMasks | None,
) -> torch.Tensor:
    """A copy of logits (R, V) with every row's bias, penalties and mask applied.

    `output_token_ids[i]` are row i's generated tokens (needed only when a row has a
    penalty). `masks` holds the bitmasks of the constrained rows, on the host.
    """
    logits = logits.clone()
    _add_bias(logits, params)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        if output_token_ids is None:
            raise ValueError("penalties need each row's output token ids")
        _penalise(logits, [params[i] for i in penalised],
                  [output_token_ids[i] for i in penalised], penalised)
    if masks is not None:
        rows = _on(masks.rows, torch.int64, logits.device)
        allowed = bitmask_to_allowed(_on_device(masks.bitmask, logits.device), logits.shape[1])
        logits.index_copy_(0, rows, logits[rows].masked_fill(~allowed, float("-inf")))
    return logits


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return
    device = logits.device
    logits.index_put_(
        (_on(rows, torch.int64, device), _on(token_ids, torch.int64, device)),
        _on(biases, logits.dtype, device),
        accumulate=True,
    )


def _penalise(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    rows: list[int],
) -> None:
    vocab = logits.shape[1]
    longest = max((len(ids) for ids in output_token_ids), default=0)
    if longest == 0:
        return
    # Rows padded with an extra column `vocab`, counted then dropped: (r, longest).
    padded = [ids + [vocab] * (longest - len(ids)) for ids in output_token_ids]
    device = logits.device
    index = _on(padded, torch.int64, device)  # type: ignore[arg-type]
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=logits.dtype))
    counts = counts[:, :vocab]  # (r, V): times each token was generated
    frequency = _on([p.frequency_penalty for p in params], logits.dtype, device)[:, None]
    presence = _on([p.presence_penalty for p in params], logits.dtype, device)[:, None]
    penalty = frequency * counts + presence * (counts > 0).to(logits.dtype)
    index_rows = _on(rows, torch.int64, device)
    logits.index_copy_(0, index_rows, logits[index_rows] - penalty)


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _on(values: list[int] | list[float] | list[list[int]], dtype: torch.dtype,
        device: torch.device) -> torch.Tensor:
    """A small host list on `device`; pinned and asynchronous on CUDA, so no host sync."""
    return _on_device(torch.tensor(values, dtype=dtype), device)
