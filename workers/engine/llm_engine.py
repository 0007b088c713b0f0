"""The engine's online surface: add requests, step, abort, report.

Responsibilities:
- turn prompts (text, token ids or chat messages) into token ids with the model's tokenizer
  and chat template, rejecting bad input with a ValueError naming the field, for that
  request only;
- own the Scheduler and the ModelRunner and run the step loop: schedule, execute,
  postprocess; on CUDA, detokenize and build the previous step's outputs while the GPU
  runs the current step (`overlap_output_processing`);
- compile each request's grammar and start its next mask while the model runs;
- detokenize incrementally, apply stop strings, and emit one RequestOutput per request
  that progressed (with its deltas) or finished;
- keep per-request timings and engine-wide counters for `stats()`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.detokenizer import Detokenizer
from workers.engine.grammar import GrammarCompiler, GrammarState, StepMasks
from workers.engine.kv_tier import KVTier
from workers.engine.kv_tier_link import KVTierLink
from workers.engine.model_runner import ModelRunner
from workers.engine.models import kv_window
from workers.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from workers.engine.prompts import Prompt, tokenize_prompt
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.work_left import FinishedShape, live_work_left

logger = logging.getLogger(__name__)


def _in_background(build: Callable[[], GrammarCompiler]) -> Future[GrammarCompiler]:
    """Run `build` on a daemon thread; its result (or error) in the future."""
    future: Future[GrammarCompiler] = Future()

    def run() -> None:
        try:
            future.set_result(build())
        except BaseException as e:  # handed to whoever waits for it
            future.set_exception(e)

    threading.Thread(target=run, name="grammar-vocab", daemon=True).start()
    return future

# A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).


@dataclass(slots=True)
class _Request:
    """Engine-side bookkeeping of one live request."""

    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer | None
    metrics: RequestMetrics
    num_cached_tokens: int | None = None  # at first admission
    num_reported_tokens: int = 0


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer: Any = None
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = int(self.runner.hf_config.vocab_size)
        block_manager = BlockManager(
            self.runner.num_kv_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=set(self.runner.eos_token_ids),
            enable_chunked_prefill=config.enable_chunked_prefill,
            watermark=config.watermark,
            step_time_targets=config.step_time_targets,
            step_slowdowns=config.step_slowdowns,
            max_prefill_step_time=config.max_prefill_step_time,
            tenant_max_loss=config.tenant_max_loss,
            kv_window=kv_window(self.runner.hf_config),
            rope_switch=self.runner.longrope_switch,
        )
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._num_computed_tokens = 0
        self._num_generated_tokens = 0
        self._busy_seconds = 0.0
        # Wall time while requests were live: the steps and the caller's work between them
        # (see EngineStats.loaded_seconds); `_loaded_since` is the end of the last step
        # that left requests unfinished.
        self._loaded_seconds = 0.0
        self._loaded_since: float | None = None
        # Prompt tokens of the requests admitted so far, and the part of them found in the
        # prefix cache: what a waiting request's prompt is expected to cost (_work_left).
        self._num_admitted_prompt_tokens = 0
        self._num_admitted_cached_tokens = 0
        # What the finished requests were (the pace of new work while none is held).
        self._finished_shape = FinishedShape()
        overlap = config.overlap_output_processing
        self._overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        # Sequences that got a token in the last step, their outputs not built yet (overlap).
        self._deferred: list[Sequence] = []
        # Reading the whole vocabulary into the grammar library takes seconds for a large
        # one: it starts now, on its own thread, so the first constrained request (which
        # waits for it) does not stall the running batch that long.
        self._grammars: GrammarCompiler | None = None
        self._grammars_future: Future[GrammarCompiler] | None = None
        if self.tokenizer is not None:
            # A copy: a fast tokenizer refuses use from two threads at once.
            vocab_tokenizer = copy.deepcopy(self.tokenizer)
            eos_ids = sorted(self.runner.eos_token_ids)
            self._grammars_future = _in_background(
                lambda: GrammarCompiler(vocab_tokenizer, self.vocab_size, eos_ids)
            )
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d",
            block_manager.num_blocks,
            block_manager.block_size,
            self.max_model_len,
        )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request; ValueError naming the field if it is malformed or cannot fit.

        `deadline` (seconds since the epoch) orders requests within a priority, earliest
        first; requests without one come after those with one. Then `tenant` (any string,
        opaque here) shares admissions with the other tenants by `tenant_weight`, over
        tokens (tenant_clock); requests without one share as one more tenant. `tools` (OpenAI's tool
        objects) are rendered into a chat prompt (see tool_prompt), and `chat_template_kwargs`
        are the chat template's own variables. `prompt_token_ids`:
        a text prompt's ids, encoded already (`encode_ids_batch`, as LLM.generate does).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float)
        ):
            raise ValueError(f"deadline must be seconds since the epoch, got {deadline!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {tenant!r}")
        if (isinstance(tenant_weight, bool) or not isinstance(tenant_weight, int | float)
                or not 0 < tenant_weight < math.inf):
            raise ValueError(f"tenant_weight must be a number > 0, got {tenant_weight!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; skip_tokenizer_init is set")
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias has token ids outside [0, {self.vocab_size}): "
                             f"{bad_bias[:5]}")
        grammar = self._grammar_state(params)
        prompt_text: str | None
        if prompt_token_ids is not None and isinstance(prompt, str) and prompt:
            prompt_text, token_ids = prompt, list(prompt_token_ids)
            if not token_ids or any(not 0 <= t < self.vocab_size for t in token_ids):
                raise ValueError(f"prompt_token_ids must be non-empty ids in [0, "
                                 f"{self.vocab_size})")
        else:
            prompt_text, token_ids = tokenize_prompt(self.tokenizer, self.vocab_size, prompt,
                                                     tools, chat_template_kwargs)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than max_model_len {self.max_model_len}"
            )
        seq = Sequence(
            request_id,
            token_ids,
            params,
            priority=priority,
            arrival_order=next(self._arrivals),
            deadline=None if deadline is None else float(deadline),
            tenant=tenant,
            weight=float(tenant_weight),
        )
        if grammar is not None and grammar.schema is not None and not params.ignore_eos:
            # The document is closed within what the sequence may still generate (not
            # where the client asked for max_tokens tokens whatever the stop token).
            grammar.budget = min(params.max_tokens, self.max_model_len - len(token_ids))
        seq.grammar = grammar
        self.scheduler.add(seq)  # may raise: the pool could never hold it
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = Detokenizer(self.tokenizer, token_ids, params.stop)
        self._requests[request_id] = _Request(
            seq, prompt_text, detokenizer, RequestMetrics(arrival_time=time.time())
        )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; an unknown or finished id is a no-op."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.seq.is_finished:  # finished in the last step, its output not built yet
            return
        self.scheduler.finish(request.seq, SequenceStatus.FINISHED_ABORTED)
        logger.debug("aborted %s", request_id)

    def attach_kv_tier(self, tier: KVTier, *, write_through: bool = False) -> KVTierLink:
        """Keep prefix blocks in `tier` beyond the pool, and load prefixes the pool misses."""
        link = KVTierLink(tier, self.runner.kv_cache, write_through=write_through)
        self.scheduler.block_manager.kv_link = link
        return link

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or has an output to come."""
        return self.scheduler.has_unfinished() or bool(self._deferred)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batch: new tokens for running requests, outputs for those that moved.

        With `finished_only`, outputs only of the requests that finished (what a caller
        waiting for whole results needs): the others' are not built. With overlap, a step
        returns the outputs of the tokens sampled by the step before: their detokenization
        runs on the host while the GPU computes this step, and a sequence a stop string
        ends there has its extra token of this step discarded.
        """
        start = time.perf_counter()
        if self._loaded_since is not None:
            self._loaded_seconds += start - self._loaded_since
            self._loaded_since = None
        out = self.scheduler.schedule()
        if out.is_empty:
            outputs = self._advance_all(self._deferred, finished_only)
            self._deferred = []
            return outputs
        now = time.time()
        for seq in out.seqs:
            # Only at its first step has a sequence computed just its cached prefix (and
            # never been preempted): the others need no look-up.
            if seq.num_computed_tokens != seq.num_cached_tokens or seq.num_preemptions:
                continue
            request = self._requests[seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = seq.num_cached_tokens
                self._num_admitted_prompt_tokens += seq.num_prompt_tokens
                self._num_admitted_cached_tokens += seq.num_cached_tokens
        kv_link = self.scheduler.block_manager.kv_link
        if kv_link is not None:  # blocks evicted this step are overwritten by this forward
            kv_link.flush()
        masks = self._fill_masks(out.seqs, out.num_scheduled_tokens)
        pending = self.runner.execute_async(out.seqs, out.num_scheduled_tokens, masks)
        # Host work while the GPU runs.
        outputs = self._advance_all(self._deferred, finished_only)
        sampled = pending.result()
        updated = self.scheduler.postprocess(out, sampled)
        if kv_link is not None:  # write-through: this step's blocks now, not at the next step
            kv_link.flush()
        self._num_computed_tokens += out.total_num_scheduled_tokens
        self._num_generated_tokens += len(updated)
        if self._overlap:
            self._deferred = updated
        else:
            outputs = self._advance_all(updated, finished_only)
        end = time.perf_counter()
        seconds = end - start
        self._busy_seconds += seconds
        self._loaded_seconds += seconds
        if self.scheduler.has_unfinished():
            self._loaded_since = end
        # The whole step is what a running sequence waits between two tokens.
        self.scheduler.cost_model.observe(out.shape, seconds)
        return outputs

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's schema or structural tag into the grammar cache, on any
        thread (the library releases the GIL), so that `add_request` finds it compiled:
        a large schema takes seconds that every running sequence would otherwise wait.
        ValueError as `add_request` would raise it."""
        self._grammar_state(params)

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A matcher for the request's schema or structural tag (compiled once per schema);
        None without either."""
        if params.json_schema is None and params.structural_tag is None:
            return None
        if self._grammars is None:
            if self._grammars_future is None:
                raise ValueError("response_format needs a tokenizer; skip_tokenizer_init is set")
            try:
                self._grammars = self._grammars_future.result()
            except Exception as e:  # the library failed to load: this request cannot run
                raise ValueError(f"response_format: grammar library unavailable: {e}") from e
        if params.structural_tag is not None:
            return self._grammars.new_tag_state(params.structural_tag)
        assert params.json_schema is not None
        return self._grammars.new_state(params.json_schema)

    def _fill_masks(
        self, seqs: list[Sequence], num_scheduled_tokens: list[int]
    ) -> Future[StepMasks] | None:
        """Start filling the masks of the constrained sequences that sample this step."""
        if self._grammars is None:
            return None
        sampling = [
            seq for seq, n in zip(seqs, num_scheduled_tokens, strict=True)
            if seq.num_computed_tokens + n == seq.num_tokens
        ]
        if all(seq.grammar is None for seq in sampling):
            return None
        return self._grammars.fill_async(
            [seq.grammar for seq in sampling], [seq.output_token_ids for seq in sampling]
        )

    @property
    def finished_shape(self) -> FinishedShape:
        """What its recently finished requests were, on average (see work_left)."""
        return self._finished_shape

    def stats(self, *, work_left: bool = True) -> EngineStats:
        """Current load and totals since start; the work left (a sum over the live
        requests) only if asked, as the heartbeat does and the 1 s gauges need not."""
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            num_prefix_cache_hit_tokens=self.scheduler.num_prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_tokens=self._num_computed_tokens,
            num_generated_tokens=self._num_generated_tokens,
            busy_seconds=self._busy_seconds,
            loaded_seconds=self._loaded_seconds,
            num_held_back_steps=self.scheduler.num_held_back_steps,
            num_steps=self.scheduler.cost_model.num_steps,
            **(self._work_left() if work_left else {}),
        )

    def _work_left(self) -> dict[str, Any]:
        """`EngineStats`' work-left fields, summed over the live requests.

        Read from other threads (a worker's heartbeat) while the engine steps: the requests
        are copied first (retried if a step adds or removes one during the copy), and each
        sequence's counters are read once, so a sum is at worst a step old. A request not
        admitted yet is expected to find the share of its prompt in the prefix cache that
        the admitted ones found (a batch's lines share a chat template and system prompt:
        counted whole, they put SmolLM2 batch ETAs 30% late until every line was admitted).
        """
        for _ in range(3):
            try:
                requests = list(self._requests.values())
                break
            except RuntimeError:  # the dict changed size during the copy
                continue
        else:
            return {}
        num_admitted = self._num_admitted_prompt_tokens
        cost_model = self.scheduler.cost_model
        return live_work_left(
            [(r.seq, r.metrics.first_scheduled_time is not None) for r in requests],
            cached_share=self._num_admitted_cached_tokens / num_admitted if num_admitted
            else 0.0,
            max_model_len=self.max_model_len, max_num_seqs=self.scheduler.max_num_seqs,
            coefficients=cost_model.coefficients() if cost_model.is_fitted else None,
            finished=self._finished_shape)

    def _advance_all(
        self, seqs: list[Sequence], finished_only: bool = False
    ) -> list[RequestOutput]:
        """Outputs for sequences that got a token, skipping requests aborted since (and,
        with `finished_only`, the unfinished ones once their new token is detokenized)."""
        now = time.time()
        outputs: list[RequestOutput] = []
        get = self._requests.get
        for seq in seqs:
            request = get(seq.request_id)
            if request is None:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.detokenizer is None and not seq.status.is_finished:
                if not finished_only:
                    outputs.append(self._output(request, ""))
                continue
            delta_text = self._detokenize(request)
            if seq.is_finished:
                request.metrics.finish_time = now
                del self._requests[seq.request_id]
                self._finished_shape.add(prompt_tokens=seq.num_prompt_tokens,
                                         cached_tokens=request.num_cached_tokens or 0,
                                         output_tokens=seq.num_output_tokens)
            elif finished_only:
                continue
            outputs.append(self._output(request, delta_text))
        return outputs

    def _detokenize(self, request: _Request) -> str:
        """Detokenize a request's new token and apply stop strings; its new text."""
        seq = request.seq
        delta_text = ""
        detok = request.detokenizer
        if detok is not None:
            if detok.add_tokens([seq.last_token_id]):
                if seq.is_finished:
                    seq.status = SequenceStatus.FINISHED_STOPPED  # a stop string outranks length
                else:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.is_finished:
                detok.flush()
            delta_text = detok.take_delta(finished=seq.is_finished)
        return delta_text

    def _output(self, request: _Request, delta_text: str) -> RequestOutput:
        """The request's output after this step (its new tokens since the last one)."""
        seq = request.seq
        detok = request.detokenizer
        output_ids = seq.output_token_ids
        delta_ids = output_ids[request.num_reported_tokens :]
        request.num_reported_tokens = len(output_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=detok.text if detok is not None else "",
            token_ids=output_ids,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=replace(request.metrics),  # a snapshot: later steps move on
            top_logprobs=list(seq.output_top_logprobs) if seq.params.top_logprobs else None,
            prompt_logprobs=(list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None
                             and seq.is_finished else None),
            prompt_top_logprobs=(list(seq.prompt_top_logprobs)
                                 if seq.params.prompt_logprobs and seq.is_finished else None),
        )
