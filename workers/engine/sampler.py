"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every row is processed independently of the others, and a seeded request draws its
uniform number from (seed, number of tokens it has generated so far) alone, so its output
does not depend on what else shares the batch, nor on being preempted and recomputed.
Sampling is inverse-CDF: one uniform per row, one cumulative sum, one search.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.engine.grammar import StepMasks
from workers.engine.logit_adjustments import adjust_logits, needs_adjusting
from workers.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SampledToken:
    """One token picked for one sequence."""

    token_id: int
    logprob: float | None  # set when the request asked for logprobs


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step) (splitmix64 mixing)."""
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


class Sampler:
    """Picks the next token of each row of a logits matrix, honouring each row's params."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        # Unseeded requests share one generator: reproducible for a whole run, not per request.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        *,
        output_token_ids: list[list[int]] | None = None,
        masks: StepMasks | None = None,
    ) -> list[SampledToken]:
        """logits (R, V) float32; params and steps (tokens generated so far) per row.

        `output_token_ids` (each row's generated tokens) are needed when a row has a
        penalty; `masks` constrain the rows a grammar governs (see logit_adjustments).
        Transfers the results to the host once: the only device sync of a step.
        """
        token_ids, logprobs = self.sample_on_device(
            logits, params, steps, output_token_ids=output_token_ids, masks=masks
        )
        return self.to_host(token_ids, logprobs, params)

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        *,
        output_token_ids: list[list[int]] | None = None,
        masks: StepMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids (R,) int64 and, when any row asked, logprobs (R,) float64 (NaN for the
        rows that did not), both still on the logits' device: no host sync."""
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(steps) != num_rows:
            raise ValueError("params and steps must have one entry per logits row")
        if needs_adjusting(params, masks):
            logits = adjust_logits(logits, params, output_token_ids, masks)
        token_ids = self._pick(logits, params, steps)
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs]
        if not want_logprobs:
            return token_ids, None
        rows = _on(want_logprobs, torch.int64, logits.device)
        logprobs = torch.full((num_rows,), float("nan"), device=logits.device, dtype=torch.float64)
        picked = torch.log_softmax(logits[rows], dim=-1).gather(1, token_ids[rows, None])
        logprobs[rows] = picked.squeeze(1).double()
        return token_ids, logprobs

    @staticmethod
    def to_host(
        token_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        params: list[SamplingParams],
    ) -> list[SampledToken]:
        """One device-to-host transfer of sample_on_device()'s results."""
        if logprobs is None:
            return [SampledToken(t, None) for t in token_ids.tolist()]
        host = torch.stack([token_ids.double(), logprobs]).tolist()
        return [
            SampledToken(int(t), lp if params[i].logprobs else None)
            for i, (t, lp) in enumerate(zip(host[0], host[1], strict=True))
        ]

    def _pick(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """Token id per row (R,) int64, still on the device."""
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return greedy
        rows_params = [params[i] for i in random_rows]
        index = _on(random_rows, torch.int64, logits.device)
        # (r, V): temperature-scaled scores of the rows that sample at random.
        temps = _on([p.temperature for p in rows_params], logits.dtype, logits.device)
        scores = logits[index] / temps[:, None]
        if any(p.top_k is not None for p in rows_params):
            scores = _apply_top_k(scores, [p.top_k for p in rows_params])
        if any(p.top_p < 1.0 for p in rows_params):
            scores = _apply_top_p(scores, [p.top_p for p in rows_params])
        probs = torch.softmax(scores, dim=-1)
        uniforms = self._uniforms(rows_params, [steps[i] for i in random_rows])
        cdf = probs.cumsum(dim=-1)
        # First token whose cumulative mass exceeds u * total: zero-mass tokens never win.
        targets = (uniforms * cdf[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cdf, targets, right=True)
        # Rounding can put the target at the total; fall back to the last token with mass.
        last_with_mass = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
        picked = torch.minimum(picked, last_with_mass).squeeze(1)
        return greedy.index_copy(0, index, picked)

    def _uniforms(self, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
        """One uniform per row: from the request's seed when it has one, else shared."""
        uniforms = torch.rand(
            len(params), generator=self.generator, device=self.device, dtype=torch.float32
        )
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            values = [seeded_uniform(params[i].seed or 0, steps[i]) for i in seeded]
            uniforms[_on(seeded, torch.int64, self.device)] = _on(
                values, torch.float32, self.device
            )
        return uniforms


def _apply_top_k(scores: torch.Tensor, top_ks: list[int | None]) -> torch.Tensor:
    """Keep each row's k best scores (rows with None keep all); ties at the k-th stay."""
    vocab = scores.shape[1]
    ks = [min(k, vocab) if k is not None else vocab for k in top_ks]
    max_k = max(ks)
    top = scores.topk(max_k, dim=-1).values  # (r, max_k), descending
    kth = top.gather(1, _on(ks, torch.int64, scores.device)[:, None] - 1)  # (r, 1)
    return scores.masked_fill(scores < kth, float("-inf"))


def _apply_top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep each row's smallest set of best tokens whose mass reaches top_p."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (r, V): mass of strictly better tokens
    # top_p == 1 must keep everything, even where rounding lifts the running sum to 1 early.
    limits = [p if p < 1.0 else float("inf") for p in top_ps]
    top_p = _on(limits, probs.dtype, scores.device)[:, None]
    drop_sorted = mass_before >= top_p  # the best token always stays (mass_before = 0)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _on(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`; pinned and asynchronous on CUDA, so no host sync."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
