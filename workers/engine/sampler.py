"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every row is processed independently of the others, and a seeded request draws its
uniform number from (seed, number of tokens it has generated so far) alone, so its output
does not depend on what else shares the batch, nor on being preempted and recomputed.
Sampling is inverse-CDF: one uniform per row, one cumulative sum, one search.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine import cpu_kernels
from workers.engine.grammar import StepMasks
from workers.engine.logit_adjustments import adjust_logits, needs_adjusting
from workers.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# Best tokens per row a top-k or nucleus (top-p) row is drawn among, where its filters fit
# in them (see _pick_among_candidates), tried in turn; other rows are drawn over the whole
# vocabulary. A nucleus at temperature 1 can hold thousands of tokens.
CANDIDATES = (256, 4096)


@dataclass(slots=True)
class SampledToken:
    """One token picked for one sequence."""

    token_id: int
    logprob: float | None  # set when the request asked for logprobs
    # The request's `top_logprobs` most likely (token id, logprob), best first.
    top_logprobs: list[tuple[int, float]] | None = None


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
        """Token ids (R,) int64 and, when any row asked, logprobs (R, 1 + 2 K) float64, both
        still on the logits' device (no host sync): the sampled token's (NaN for the rows
        that did not ask), then the K most likely tokens' logprobs and ids (K the most any
        row asked for in `top_logprobs`; 0 for none)."""
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
        k = max(params[i].top_logprobs for i in want_logprobs)
        logprobs = torch.full((num_rows, 1 + 2 * k), float("nan"), device=logits.device,
                              dtype=torch.float64)
        log_probs = torch.log_softmax(logits[rows], dim=-1)
        logprobs[rows, 0] = log_probs.gather(1, token_ids[rows, None]).squeeze(1).double()
        if k:
            values, ids = log_probs.topk(k, dim=-1)
            logprobs[rows, 1:] = torch.cat([values.double(), ids.double()], dim=1)
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
        host = torch.cat([token_ids.double()[:, None], logprobs], dim=1).tolist()
        k = (logprobs.shape[1] - 1) // 2
        tokens = []
        for p, (t, lp, *top) in zip(params, host, strict=True):
            alternatives = None
            if p.top_logprobs:
                alternatives = [(int(top[k + j]), top[j]) for j in range(p.top_logprobs)]
            tokens.append(SampledToken(int(t), lp if p.logprobs else None, alternatives))
        return tokens

    def _pick(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """Token id per row (R,) int64, still on the device."""
        greedy = _greedy(logits)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return greedy
        rows_params = [params[i] for i in random_rows]
        index = _on(random_rows, torch.int64, logits.device)
        uniforms = self._uniforms(rows_params, [steps[i] for i in random_rows])
        picked = torch.empty(len(random_rows), dtype=torch.int64, device=logits.device)
        # On a CPU, top-k and nucleus rows are drawn among candidates first (a sort of the
        # vocabulary costs hundreds of ms there), and the others by one kernel that reads
        # the logits in place; on a GPU the sort is cheap, and deciding which rows fit
        # would sync the host each step.
        on_cpu = logits.device.type == "cpu"
        filtered = [i for i, p in enumerate(rows_params)
                    if on_cpu and (p.top_k is not None or p.top_p < 1.0)]
        candidates_first = set(filtered)
        wide = [i for i in range(len(rows_params)) if i not in candidates_first]
        if on_cpu and wide and _draws_in_kernel():
            rows = _on(wide, torch.int64, logits.device)
            picked[rows] = _draw_tokens(logits.float(), index[rows], _on(
                [1.0 / rows_params[i].temperature for i in wide], torch.float32,
                logits.device), uniforms[rows])
            wide = []
        for num_candidates in CANDIDATES:
            if not filtered:
                break
            rows = _on(filtered, torch.int64, logits.device)
            chosen, fits = _pick_among_candidates(
                _rows_of(logits, [random_rows[i] for i in filtered], index[rows]),
                [rows_params[i] for i in filtered], uniforms[rows], num_candidates)
            picked[rows] = chosen
            filtered = [i for i, ok in zip(filtered, fits.tolist(), strict=True) if not ok]
        wide += filtered
        if wide:
            wide.sort()
            rows = _on(wide, torch.int64, logits.device)
            temps = _on([rows_params[i].temperature for i in wide], logits.dtype,
                        logits.device)
            # (r, V): temperature-scaled scores of these rows.
            scores = _scaled(_rows_of(logits, [random_rows[i] for i in wide], index[rows]),
                             temps[:, None])
            picked[rows] = _pick_in_vocabulary(scores, [rows_params[i] for i in wide],
                                               uniforms[rows])
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


def _best(logits: torch.Tensor) -> torch.Tensor:
    """(r, 1): each row's best logit, the bar weights are taken from; -inf where every
    token is masked is kept finite, since -inf - -inf is NaN."""
    return logits.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)


def _scaled(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """(logits - best) / T per row: the scores softmax would see, the best exactly 0.
    Shifted after the division, logits / T overflows to inf at tiny temperatures, and
    softmax's own shift makes that inf - inf = NaN; shifted first, a score can only
    overflow to -inf, a weight of 0."""
    return (logits - _best(logits)).div_(temps)


def _rows_of(matrix: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """`matrix[index]` (`index` holding `rows`), without the copy when `rows` are all of
    its rows in order."""
    return matrix if rows == list(range(matrix.shape[0])) else matrix[index]


def _pick_in_vocabulary(scores: torch.Tensor, params: list[SamplingParams],
                        uniforms: torch.Tensor) -> torch.Tensor:
    """Token id per row (r,), each row's filters applied over the whole vocabulary."""
    if any(p.top_k is not None for p in params):
        scores = _apply_top_k(scores, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        scores = _apply_top_p(scores, [p.top_p for p in params])
    if scores.device.type == "cpu" and _draws_in_kernel():
        rows = torch.arange(scores.shape[0], device=scores.device)
        return _draw_tokens(scores.float(), rows, torch.ones(len(params)), uniforms)
    return _inverse_cdf(torch.softmax(scores, dim=-1), uniforms)


def _total_weights(logits: torch.Tensor, temps: torch.Tensor, best: torch.Tensor
                   ) -> torch.Tensor:
    """(r, 1): each row's sum of exp((logits - best) / temperature) over the vocabulary,
    `best` (r, 1) its best logit."""
    if logits.device.type == "cpu" and _draws_in_kernel():
        return torch.ops.batchinfer_cpu.total_weights(
            logits.float().contiguous(), (1.0 / temps[:, 0]).float().contiguous(),
            best[:, 0].float().contiguous())[:, None]
    return torch.exp((logits - best) / temps).sum(dim=-1, keepdim=True)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (torch.argmax), by the CPU kernel where it is loaded:
    torch's CPU argmax is unvectorised, ~6x slower at 192 rows of 2,048 tokens."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _draws_in_kernel()
            and hasattr(torch.ops.batchinfer_cpu, "greedy_tokens")):
        return torch.ops.batchinfer_cpu.greedy_tokens(logits)
    return logits.argmax(dim=-1)


def _draws_in_kernel() -> bool:
    """The CPU sampling kernels (kernels/cpu_sampling.cpp) are built and loaded here."""
    return (cpu_kernels.load() is None and hasattr(torch.ops.batchinfer_cpu, "draw_tokens")
            and hasattr(torch.ops.batchinfer_cpu, "total_weights"))


def _draw_tokens(scores: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                 uniforms: torch.Tensor) -> torch.Tensor:
    """Per j, the token drawn from scores[rows[j]] x scales[j] with uniforms[j]: the rule
    of `_inverse_cdf` over its softmax (kernels/cpu_sampling.cpp)."""
    return torch.ops.batchinfer_cpu.draw_tokens(
        scores.contiguous(), rows.contiguous(), scales.float().contiguous(),
        uniforms.float().contiguous())


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative weight exceeds u * the row's total (the
    columns in token order): zero-weight columns never win."""
    cdf = weights.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, targets, right=True)
    # Rounding can put the target at the total; fall back to the last column with weight.
    last_with_mass = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.minimum(picked, last_with_mass).squeeze(1)


def _pick_among_candidates(logits: torch.Tensor, params: list[SamplingParams],
                           uniforms: torch.Tensor, num_candidates: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id per row (r,) of `logits` (r, V), at its params' temperature, drawn among
    its best `num_candidates` tokens (fewer where every row is top-k alone), and whether
    the row's top-k and nucleus fit in them (where not, its token must be drawn again
    among more).

    The same draw as over the whole vocabulary: the nucleus is the smallest set of best
    tokens whose mass (softmax over the vocabulary, or over the top-k kept) reaches top_p,
    and the token is the first, in token order, whose cumulative mass exceeds u times the
    kept mass. Only the candidates are sorted: sorting SmolLM2's 49,152 scores for 256
    rows took 446 ms on a 2-core CPU, the 256 best of each 18 ms.
    """
    vocab = logits.shape[1]
    if all(p.top_p >= 1.0 and p.top_k is not None for p in params):
        # One candidate past the largest k shows whether a tie of its k-th score goes on.
        num_candidates = min(num_candidates, max(p.top_k or 0 for p in params) + 1)
    num = min(num_candidates, vocab)
    device = logits.device
    temps = _on([p.temperature for p in params], logits.dtype, device)[:, None]
    # A positive temperature keeps the order: the best logits are the best scores.
    values, ids = logits.topk(num, dim=-1)  # (r, num), best first
    best = _best(values)  # the rows' best logits (values are sorted, best first)
    values = (values - best) / temps  # as _scaled(logits, temps): the best exactly 0
    has_k = _on([p.top_k is not None for p in params], torch.bool, device)
    ks = _on([min(p.top_k or vocab, vocab) for p in params], torch.int64, device)
    # top-k keeps the ties at the k-th score: the k-th candidate's score is the bar.
    kth = values.gather(1, ks.clamp(max=num)[:, None] - 1)
    keep = values >= kth
    # Where every token is a candidate everything fits; else a row's top-k fits when its
    # k-th score is a candidate's and no tie of it may go on past the last candidate.
    topk_fits = (ks <= num) & (values[:, -1] < kth[:, 0]) if num < vocab else (
        torch.ones_like(has_k))
    unnormalised = torch.exp(values) * keep
    # The nucleus is taken over the mass top-k kept (the whole vocabulary without top-k).
    whole = unnormalised.sum(dim=-1, keepdim=True)
    if not all(p.top_k is not None for p in params):
        whole = torch.where(has_k[:, None], whole, _total_weights(logits, temps, best))
    probs = unnormalised / whole
    top_p = _on([p.top_p if p.top_p < 1.0 else float("inf") for p in params], probs.dtype,
                device)
    cumulative = probs.cumsum(dim=-1)
    keep &= (cumulative - probs) < top_p[:, None]  # the best token always stays
    # Without top-k, a nucleus whose mass the candidates reach leaves out every other token.
    fits = (has_k & topk_fits) | (~has_k & (topk_fits | (cumulative[:, -1] >= top_p)))
    # Draw in token order among the kept candidates.
    order = ids.argsort(dim=-1)
    weights = (unnormalised * keep).gather(1, order)
    position = _inverse_cdf(weights, uniforms)
    return ids.gather(1, order).gather(1, position[:, None]).squeeze(1), fits


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


def _on(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
        device: torch.device) -> torch.Tensor:
    """A small host list on `device`; pinned and asynchronous on CUDA, so no host sync."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
