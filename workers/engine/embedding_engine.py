"""The embedding runner behind the engine's request surface, for the worker's engine loop.

Responsible for: taking requests (each a list of inputs) with `add_request`, refusing bad
ones at once (ValueError, for that request only), and on each `step` embedding the
waiting requests most urgent first, many requests' inputs in one run of the runner so
that small requests share batches; every request finishes in the step that runs it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.engine.embedding_runner import EmbeddingInput, EmbeddingRunner, EncodedInput
from workers.engine.outputs import EngineStats, RequestMetrics

# Inputs one step embeds at most: enough for many requests' worth of batches, few enough
# that an abort or a more urgent request waits one step of a few seconds at most.
MAX_INPUTS_PER_STEP = 4096


@dataclass(frozen=True, slots=True)
class EmbeddingParams:
    """How to embed a request's inputs: cut over-long ones at the model's length, or refuse."""

    truncate: bool = True


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """A finished embedding request: one float32 vector per input, in input order."""

    request_id: str
    embeddings: list[torch.Tensor]
    num_tokens_per_input: list[int]
    truncated_indices: list[int]
    metrics: RequestMetrics
    finished: bool = True
    finish_reason: str = "stop"

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens the model read over all inputs (what usage reports)."""
        return sum(self.num_tokens_per_input)


@dataclass(slots=True)
class _Waiting:
    request_id: str
    priority: int
    arrival: int
    encoded: list[EncodedInput]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))


class EmbeddingEngine:
    """add_request / abort / step over an EmbeddingRunner (see the module docstring)."""

    def __init__(self, runner: EmbeddingRunner) -> None:
        self.runner = runner
        self.tokenizer: Any = runner.tokenizer
        self.max_model_len = runner.max_model_len
        self.dimensions = runner.dimensions
        self._waiting: dict[str, _Waiting] = {}
        self._arrivals = itertools.count()
        self._num_computed_tokens = 0
        self._busy_seconds = 0.0

    def add_request(self, request_id: str, prompt: list[EmbeddingInput],
                    params: EmbeddingParams, *, priority: int = 0) -> None:
        """Queue one request's inputs; ValueError (naming `input[i]`) for a bad input."""
        if not isinstance(params, EmbeddingParams) or not isinstance(prompt, list) or not all(
                isinstance(item, str | list) for item in prompt):
            # A chat or completion request routed here (a batch line, an older message).
            raise ValueError("model is an embedding model: it takes `input` (POST "
                             "/v1/embeddings), not messages or a prompt to complete")
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} is already waiting")
        if not prompt:
            raise ValueError("input must hold at least one text or token list")
        encoded = self.runner.encode(prompt, truncate=params.truncate)
        self._waiting[request_id] = _Waiting(request_id, priority, next(self._arrivals), encoded)

    def abort(self, request_id: str) -> None:
        """Drop a waiting request (a running step finishes its requests regardless)."""
        self._waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait."""
        return bool(self._waiting)

    def step(self) -> list[EmbeddingRequestOutput]:
        """Embed the most urgent waiting requests (at least one) and return them finished."""
        chosen: list[_Waiting] = []
        num_inputs = 0
        for request in sorted(self._waiting.values(), key=lambda r: (r.priority, r.arrival)):
            if chosen and num_inputs + len(request.encoded) > MAX_INPUTS_PER_STEP:
                break
            chosen.append(request)
            num_inputs += len(request.encoded)
        for request in chosen:
            del self._waiting[request.request_id]
        start = time.perf_counter()
        now = time.time()
        # One run over every chosen input: renumber them 0..n-1, then split back.
        combined: list[EncodedInput] = []
        for request in chosen:
            request.metrics.first_scheduled_time = now
            for item in request.encoded:
                combined.append(EncodedInput(len(combined), item.token_ids, item.is_truncated))
        vectors = self.runner.embed_encoded(combined) if combined else []
        self._busy_seconds += time.perf_counter() - start
        outputs, position = [], 0
        finish = time.time()
        for request in chosen:
            mine = vectors[position:position + len(request.encoded)]
            position += len(request.encoded)
            request.metrics.finish_time = finish
            outputs.append(EmbeddingRequestOutput(
                request_id=request.request_id,
                embeddings=[v.embedding for v in mine],
                num_tokens_per_input=[v.num_tokens for v in mine],
                truncated_indices=[i for i, v in enumerate(mine) if v.is_truncated],
                metrics=request.metrics,
            ))
            self._num_computed_tokens += sum(v.num_tokens for v in mine)
        return outputs

    def stats(self) -> EngineStats:
        """Load and totals; an encoder has no KV cache and generates nothing."""
        return EngineStats(num_running=0, num_waiting=len(self._waiting), num_kv_blocks_used=0,
                           num_kv_blocks_free=0, num_prefix_cache_hit_tokens=0,
                           num_preemptions=0, num_computed_tokens=self._num_computed_tokens,
                           num_generated_tokens=0, busy_seconds=self._busy_seconds)
