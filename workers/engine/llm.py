"""Offline batch generation: many prompts in, their finished outputs out, in order."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

from core.gc_policy import freeze_heap
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.prompts import Prompt
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizing import encode_ids_batch

logger = logging.getLogger(__name__)


class LLM:
    """`LLM(model=..., **engine_options).generate(prompts, params)`, as in vLLM."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        # What the process has imported (torch, transformers and the rest: millions of
        # objects) lives as long as it does: out of every later collection, so that a full
        # one during generate() no longer walks it; 1-token jobs ran 1.45-1.53x faster
        # (bench/RESULTS.md). Frozen before the engine exists, so that a dropped LLM (its
        # engine holds reference cycles) is still collected.
        freeze_heap()
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None with skip_tokenizer_init)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        `prompts` is one prompt or a list of them; a prompt is text, a list of token ids
        or a list of chat messages. `sampling_params` is one for all or one per prompt.
        """
        batch = _as_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(batch)} prompts"
                )
        request_ids = [f"generate-{next(self._ids)}" for _ in batch]
        encoded = self._encode_texts(batch)
        try:
            for request_id, prompt, p, ids in zip(request_ids, batch, params, encoded,
                                                   strict=True):
                self.engine.add_request(request_id, prompt, p, prompt_token_ids=ids)
            return self._run(request_ids, use_tqdm)
        finally:
            # On bad input (or an interrupt) leave nothing of this batch behind.
            for request_id in request_ids:
                self.engine.abort(request_id)

    def _encode_texts(self, batch: list[Prompt]) -> list[list[int] | None]:
        """The ids of each non-empty text prompt, encoded in one call; None for the rest."""
        texts = [p for p in batch if isinstance(p, str) and p]
        if self.engine.tokenizer is None or len(texts) < 2:
            return [None] * len(batch)
        ids = iter(encode_ids_batch(self.engine.tokenizer, texts))
        return [next(ids) if isinstance(p, str) and p else None for p in batch]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="generate", unit="req")
        try:
            while len(finished) < len(request_ids):
                for output in self.engine.step(finished_only=True):
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]


def _as_batch(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """A single prompt becomes a batch of one; a list of prompts stays as it is."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts)}")
    if not prompts:
        return []
    first = prompts[0]
    if isinstance(first, int) or isinstance(first, dict):
        return [list(prompts)]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
