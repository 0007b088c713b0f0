"""The embedding runner behind the engine's request surface, for the worker's engine loop.

Responsible for: taking requests (each a list of inputs) with `add_request`, refusing bad
ones at once (ValueError, for that request only), and embedding the waiting requests'
inputs in batches that many requests share (chosen by `WaitingInputs`: oldest of the most
urgent first, with the inputs nearest it in length); a request finishes in the step that
completes its last batch.

Why batches flow instead of steps embedding everything waiting: on a CPU the runner's
streams (one per core) must never wait for the engine thread. Each `step` keeps one
batch more than there are streams submitted, returns as soon as any batch completes
(with the requests it finished) and refills the streams before returning, so the worker
writes results and hands over new jobs while the streams compute.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.engine.embedding_pool import WaitingInputs
from workers.engine.embedding_runner import (
    EmbeddingInput,
    EmbeddingRunner,
    EncodedInput,
    batch_budget,
)
from workers.engine.outputs import EngineStats, RequestMetrics


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
class _Request:
    request_id: str
    encoded: list[EncodedInput]
    vectors: list[torch.Tensor | None]
    remaining: int  # inputs without a vector yet
    seqs: list[int]  # its inputs' places in the pool, for an abort
    num_pooled: int  # of its inputs, those not yet in a batch
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))


@dataclass(slots=True)
class _Batch:
    """A batch for the runner and, row by row, whose input each row is."""

    rows: list[EncodedInput]
    owners: list[tuple[_Request, int]]  # (request, index of the input in the request)


class EmbeddingEngine:
    """add_request / abort / step over an EmbeddingRunner (see the module docstring)."""

    def __init__(self, runner: EmbeddingRunner) -> None:
        self.runner = runner
        self.tokenizer: Any = runner.tokenizer
        self.max_model_len = runner.max_model_len
        self.dimensions = runner.dimensions
        self._requests: dict[str, _Request] = {}  # every unfinished, unaborted request
        self._pool = WaitingInputs()
        self._running: deque[tuple[Future[torch.Tensor], _Batch]] = deque()
        self._num_computed_tokens = 0
        self._busy_seconds = 0.0
        self._busy_since: float | None = None

    def add_request(self, request_id: str, prompt: list[EmbeddingInput],
                    params: EmbeddingParams, *, priority: int = 0,
                    deadline: float | None = None, tenant: str | None = None,
                    tenant_weight: float = 1.0) -> None:
        """Queue one request's inputs; ValueError (naming `input[i]`) for a bad input.

        `deadline`, `tenant` and `tenant_weight` are accepted for the generator's surface;
        an encoder step takes whole requests by token budget, so they do not reorder them."""
        if not isinstance(params, EmbeddingParams) or not isinstance(prompt, list) or not all(
                isinstance(item, str | list) for item in prompt):
            # A chat or completion request routed here (a batch line, an older message).
            raise ValueError("model is an embedding model: it takes `input` (POST "
                             "/v1/embeddings), not messages or a prompt to complete")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already waiting")
        if not prompt:
            raise ValueError("input must hold at least one text or token list")
        encoded = self.runner.encode(prompt, truncate=params.truncate)
        request = _Request(request_id, encoded, [None] * len(encoded), len(encoded), [],
                           len(encoded))
        request.seqs = [self._pool.add(priority, item, (request, i))
                        for i, item in enumerate(encoded)]
        self._requests[request_id] = request

    def abort(self, request_id: str) -> None:
        """Drop a request; rows of it already running finish and are thrown away."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                self._pool.discard(seq)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run."""
        return bool(self._requests)

    def step(self) -> list[EmbeddingRequestOutput]:
        """Wait for the next batch to complete; the requests it finished (maybe none)."""
        self._submit()
        if not self._running:
            return []
        wait([future for future, _ in self._running], return_when=FIRST_COMPLETED)
        outputs = []
        for done in [entry for entry in self._running if entry[0].done()]:
            self._running.remove(done)
            outputs.extend(self._collect(*done))
        # Refill before the worker handles these results, so no stream waits for it.
        if self.runner.is_concurrent:
            self._submit()
        self._note_busy()
        return outputs

    def stats(self, *, work_left: bool = True) -> EngineStats:
        """Load and totals; an encoder has no KV cache and generates nothing (its work
        left is not counted, whatever `work_left` asks)."""
        busy = self._busy_seconds
        if self._busy_since is not None:
            busy += time.perf_counter() - self._busy_since
        # Read from other threads (the worker's heartbeat) while the engine thread adds and
        # removes requests: the copy is retried if the dict changed size during it.
        for _ in range(3):
            try:
                requests = list(self._requests.values())
                break
            except RuntimeError:
                continue
        else:
            requests = []
        num_waiting = sum(1 for r in requests if r.num_pooled == len(r.encoded))
        return EngineStats(num_running=len(requests) - num_waiting,
                           num_waiting=num_waiting, num_kv_blocks_used=0,
                           num_kv_blocks_free=0, num_prefix_cache_hit_tokens=0,
                           num_preemptions=0, num_computed_tokens=self._num_computed_tokens,
                           num_generated_tokens=0, busy_seconds=busy)

    def _submit(self) -> None:
        """Keep one batch more than there are streams running (one at a time without)."""
        limit = self.runner.streams + 1 if self.runner.is_concurrent else 1
        while len(self._running) < limit:
            budget = batch_budget(self._pool.num_tokens, self.runner.max_num_batched_tokens,
                                  self.runner.streams if self.runner.is_concurrent else 1)
            chosen = self._pool.take_batch(budget, self.runner.max_batch_size)
            if not chosen:
                return
            now = time.time()
            for entry in chosen:
                request, _ = entry.owner
                request.num_pooled -= 1
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
            rows = [EncodedInput(i, e.encoded.token_ids, e.encoded.is_truncated)
                    for i, e in enumerate(chosen)]
            self._note_busy()
            self._running.append((self.runner.submit(rows),
                                  _Batch(rows, [e.owner for e in chosen])))

    def _collect(self, future: Future[torch.Tensor],
                 batch: _Batch) -> list[EmbeddingRequestOutput]:
        """Give each row's vector to its request; the requests that now have them all."""
        vectors = future.result()  # a failed batch fails the engine, as a failed step would
        finished = []
        for row, vector, (request, index) in zip(batch.rows, vectors, batch.owners,
                                                  strict=True):
            if self._requests.get(request.request_id) is not request:
                continue  # aborted while its batch ran
            request.vectors[index] = vector
            self._num_computed_tokens += len(row.token_ids)
            request.remaining -= 1
            if request.remaining == 0:
                del self._requests[request.request_id]
                finished.append(self._output(request))
        return finished

    def _output(self, request: _Request) -> EmbeddingRequestOutput:
        request.metrics.finish_time = time.time()
        return EmbeddingRequestOutput(
            request_id=request.request_id,
            embeddings=[v for v in request.vectors if v is not None],
            num_tokens_per_input=[len(e.token_ids) for e in request.encoded],
            truncated_indices=[i for i, e in enumerate(request.encoded) if e.is_truncated],
            metrics=request.metrics,
        )

    def _note_busy(self) -> None:
        """Busy time = time with a batch running, however many streams run one."""
        now = time.perf_counter()
        if self._running and self._busy_since is None:
            self._busy_since = now
        elif not self._running and self._busy_since is not None:
            self._busy_seconds += now - self._busy_since
            self._busy_since = None
