"""Grammar-constrained decoding: JSON schemas turned into per-step token bitmasks (xgrammar).

Responsible for:
- compiling a request's JSON schema against the model's vocabulary, once per distinct
  schema while it stays in a bounded cache, and refusing a schema it cannot compile (ValueError);
- one matcher per constrained sequence, which follows the tokens the sequence accepted;
- filling the allowed-token bitmask of every constrained sequence that samples in a step,
  on a background thread, so the work overlaps the forward pass instead of lengthening
  the step. The matchers catch up on the tokens sampled since their last fill first, so
  accepting a token costs the step nothing either.

The bitmask is xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set when
token `t` is allowed; a stop token is allowed only where the grammar may end.

A JSON-schema sequence given a budget (its max_tokens) is closed within it: as the
budget runs low its row is narrowed to the shortest way out of the document
(grammar_budget), so a model that loops inside a value still returns JSON that parses.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.engine.grammar_budget import CLOSE_MARGIN, BudgetCloser

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used go first). xgrammar keeps all of
# them by default: each new 20,000-value enum held ~150 MB of a worker for good, so a
# client sending fresh schemas could grow it until it was killed with its jobs.
GRAMMAR_CACHE_BYTES = 256 << 20


@dataclass(slots=True)
class GrammarState:
    """One sequence's matcher and how many of its output tokens the matcher has accepted."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    failed: bool = False  # a sampled token the grammar refused: the row runs unconstrained
    schema: str | None = None  # the JSON schema; None for a structural tag
    # Output tokens the sequence may still have in all (max_tokens, or the context left);
    # None: never closed early.
    budget: int | None = None
    # Tokens left at (or under) which the way out is measured next; None: not yet measured.
    next_check: int | None = None
    in_string: bool = False  # the JSON lexer's state after the accepted tokens
    escaped: bool = False
    close_path: list[int] | None = None  # the way out being followed, once closing
    close_from: int = 0  # the output index of its first token
    closed_early: bool = False  # the document was ended by the budget, not the model

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Accept the output tokens sampled since the last call."""
        for token_id in output_token_ids[self.num_accepted :]:
            if not self.failed and not self.matcher.accept_token(token_id):
                # The mask allowed only tokens the grammar takes, so this is a bug; the
                # sequence carries on unconstrained rather than taking the engine down.
                logger.error("grammar refused sampled token %d; row unconstrained", token_id)
                self.failed = True
        self.num_accepted = len(output_token_ids)


@dataclass(slots=True)
class StepMasks:
    """Allowed-token bitmasks of the constrained rows among one step's sampled rows."""

    rows: list[int]  # indices into the step's sampled rows
    bitmask: torch.Tensor  # (len(rows), ceil(vocab / 32)) int32, on the host


class GrammarCompiler:
    """The model's vocabulary for xgrammar, a schema cache and the mask-filling thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._closer = BudgetCloser(info.decoded_vocab, vocab_size, stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def new_state(self, json_schema: str) -> GrammarState:
        """A fresh matcher for `json_schema` (JSON text); ValueError if it cannot compile."""
        try:
            compiled = self._compiler.compile_json_schema(
                json_schema, any_whitespace=False, strict_mode=True
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"response_format: the JSON schema cannot be compiled: {e}") from e
        return GrammarState(self._xgr.GrammarMatcher(compiled), schema=json_schema)

    def new_tag_state(self, structural_tag: str) -> GrammarState:
        """A fresh matcher for a structural tag (JSON text); ValueError if it cannot
        compile."""
        try:
            grammar = self._xgr.Grammar.from_structural_tag(structural_tag)
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"tools: the functions' parameters cannot be enforced: {e}") from e
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def fill_async(
        self, states: list[GrammarState | None], output_token_ids: list[list[int]]
    ) -> Future[StepMasks] | None:
        """Masks for the rows whose state is not None, computed on the background thread.

        `output_token_ids[i]` are row i's generated tokens so far; they must not change
        until the future is resolved (the engine appends tokens only after sampling).
        """
        rows: list[int] = []
        work: list[tuple[GrammarState, list[int]]] = []
        for i, state in enumerate(states):
            if state is not None and not state.failed:
                rows.append(i)
                work.append((state, output_token_ids[i]))
        if not rows:
            return None
        return self._pool.submit(self._fill, rows, work)

    def _fill(self, rows: list[int], work: list[tuple[GrammarState, list[int]]]) -> StepMasks:
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        matchers = []
        for state, output_ids in work:
            if state.budget is not None:
                state.in_string, state.escaped = self._closer.in_string_after(
                    state.in_string, state.escaped, output_ids[state.num_accepted :]
                )
            state.catch_up(output_ids)
            matchers.append(state.matcher)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        for row, (state, output_ids) in enumerate(work):
            if state.budget is not None and not state.failed:
                self._close_within_budget(state, len(output_ids), bitmask[row].numpy())
        return StepMasks(rows, bitmask)

    def _close_within_budget(self, state: GrammarState, num_output: int,
                             words: np.ndarray) -> None:
        """Narrow the row's mask (`words`) to the way out of the document once that way
        only just fits in the tokens left; measure it when it is due."""
        assert state.budget is not None
        left = state.budget - num_output
        if state.close_path is None:
            if state.next_check is not None and left > state.next_check:
                return
            path: list[int] | None = None
            if state.next_check is None and state.num_accepted == 0 and state.schema:
                # The empty document's way out is the schema's: measured once per schema.
                distance = self._closer.schema_distance(state.schema, state.matcher, left)
            else:
                path = self._closer.walk(state.matcher, state.in_string, state.escaped, left)
                distance = None if path is None else len(path)
            if distance is not None and distance + CLOSE_MARGIN < left:
                slack = left - distance - CLOSE_MARGIN
                state.next_check = distance + CLOSE_MARGIN + slack // 2
                return
            if path is None and distance is not None:
                path = self._closer.walk(state.matcher, state.in_string, state.escaped, left)
            if path is None:
                state.budget = None  # no way out fits: the output is cut where it stands
                return
            state.close_path, state.close_from = path, num_output
            state.closed_early = True
        step = num_output - state.close_from
        if step < len(state.close_path):
            _allow_only(words, state.close_path[step])
        else:
            stop = self._closer.stop_token(words)
            if stop is not None:
                _allow_only(words, stop)

    def close(self) -> None:
        """Stop the mask thread (after the fill in flight, if any)."""
        self._pool.shutdown(wait=True)


def _allow_only(words: np.ndarray, token_id: int) -> None:
    """Make `token_id` the only token a bitmask row allows."""
    words[:] = 0
    words[token_id >> 5] = np.uint32(1 << (token_id & 31)).view(np.int32)


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 bitmask → (R, vocab_size) bool, True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32): bit j of word w = token 32w+j
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
