"""A job's outcome written down: its result or error stored, cached, announced and counted.

Responsible for: shaping the engine's output into the OpenAI result object, re-stamping a
cached result for the job it now answers, turning a refusal into the stored error (with
the request field it names as `param`), and the outcome metrics by priority. Storage
writes go through `JobStore`, whose calls are idempotent: a job finished twice (after a
redelivery) is stored and counted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from core import metrics
from core.messages import JobMessage
from core.responses_api import with_request_echoed
from storage.models import utcnow
from workers.engine import RequestOutput
from workers.inference.embedding_jobs import build_embedding_result
from workers.inference.job_store import JobStore, Success, epoch_to_datetime
from workers.inference.remote_requests import RemoteOutput, build_remote_result
from workers.inference.results import (
    Completion,
    EchoedPrompt,
    build_result,
    error_body,
    param_of,
)
from workers.inference.tool_calls import tool_calls_of

logger = logging.getLogger(__name__)

# Request fields an error message may name (for the stored error's `param`).
REQUEST_FIELDS = (
    "max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "top_logprobs", "logprobs", "ignore_eos", "messages", "prompt", "model", "n",
    "response_format", "tool_choice", "tools", "logit_bias", "presence_penalty",
    "frequency_penalty",
)  # fmt: skip


def created_at_of(message: JobMessage) -> int:
    """The `created` / `created_at` of a job's result: a `response`'s is its job's creation,
    as the response read back or streamed before it finished says; a completion's, now."""
    if message.kind == "response" and message.created_at is not None:
        return int(message.created_at)
    return int(time.time())


class OutcomeRecorder:
    """Stores and counts how jobs ended (see the module docstring)."""

    def __init__(self, store: JobStore, *, tokenizer: Callable[[], Any]) -> None:
        self._store = store
        # The engine's tokenizer (None for an engine without one): token ids as text.
        self._tokenizer = tokenizer

    def _token_text(self, token_id: int) -> str:
        """One token as logprobs list it (its id where there is no tokenizer)."""
        tokenizer = self._tokenizer()
        return str(token_id) if tokenizer is None else str(tokenizer.decode([token_id]))

    def succeeded(
        self, finished: list[tuple[JobMessage, RequestOutput | RemoteOutput, datetime]],
        choices: dict[str, list[RequestOutput]] | None = None,
    ) -> None:
        """Store finished engine outputs as their jobs' results, in one transaction.

        Each item is (message, output, the job's created_at); `choices` has every choice's
        output of the jobs with `n` > 1, by job id.
        """
        choices = choices or {}
        successes = [
            Success(message, self._result_of(message, output, choices.get(message.job_id)),
                    epoch_to_datetime(output.metrics.first_token_time))
            for message, output, _ in finished
        ]
        stored = self._store.succeed_many(successes)
        for message, _, created_at in finished:
            if message.job_id in stored:
                self._count_success(message, created_at)

    def answered_from_cache(
        self, hits: list[tuple[JobMessage, dict[str, Any], datetime, str | dict[str, Any]]]
    ) -> None:
        """Store earlier answers as these jobs' results, each with its own id, marked cached.

        Each item is (message, the cached result, the job's created_at, the `cached`
        marker: "exact", or {"kind": "semantic", "similarity", "matched_job_id"}). No
        completion token was computed for them, and their usage says so.
        """
        successes = []
        for message, cached, _, marker in hits:
            result = dict(cached)
            if message.kind == "response":
                result = with_request_echoed(result, job_id=message.job_id, body=message.body)
                result.update(id=f"resp_{message.job_id}", created_at=created_at_of(message),
                              cached=marker)
            else:
                prefix = "chatcmpl" if message.kind == "chat.completion" else "cmpl"
                result.update(id=f"{prefix}-{message.job_id}", created=int(time.time()),
                              cached=marker)
            usage = dict(result.get("usage") or {})
            if usage and message.kind == "response":
                usage["output_tokens"] = 0
                usage["total_tokens"] = usage.get("input_tokens", 0)
                result["usage"] = usage
            elif usage:
                usage["completion_tokens"] = 0
                usage["total_tokens"] = usage.get("prompt_tokens", 0)
                result["usage"] = usage
            successes.append(Success(message, result, None, fill_cache=False))
        stored = self._store.succeed_many(successes)
        for message, _, created_at, marker in hits:
            if message.job_id in stored:
                kind = marker if isinstance(marker, str) else str(marker["kind"])
                metrics.RESULT_CACHE_HITS.labels(message.priority).inc()
                metrics.CACHE_LOOKUPS.labels(kind, "hit").inc()
                self._count_success(message, created_at)

    def _result_of(self, message: JobMessage, output: RequestOutput | RemoteOutput,
                   choices: list[RequestOutput] | None = None) -> dict[str, Any]:
        if isinstance(output, RemoteOutput):  # an engine server's answer
            return build_remote_result(message, output, created=created_at_of(message),
                                       system_fingerprint=self._store.system_fingerprint)
        if message.kind == "embedding":
            # The embedding engine's EmbeddingRequestOutput, through the same engine loop.
            return build_embedding_result(output, model=message.model,  # type: ignore[arg-type]
                                          body=message.body)
        first, *others = choices or [output]
        echoes = message.kind == "text_completion" and message.body.get("echo") is True

        def completion(o: RequestOutput) -> Completion:
            return _completion(o, self._echoed(o) if echoes else None)

        return build_result(
            message.kind,
            job_id=message.job_id,
            model=message.model,
            completion=completion(first),
            created=created_at_of(message),
            token_text=self._token_text,
            system_fingerprint=self._store.system_fingerprint,
            tool_calls=_tool_calls(message, first),
            body=message.body,
            others=[(completion(o), _tool_calls(message, o)) for o in others],
        )

    def _echoed(self, output: RequestOutput) -> EchoedPrompt:
        """The prompt an `echo` request shows before its output."""
        ids = list(output.prompt_token_ids)
        tokenizer = self._tokenizer()
        if output.prompt is not None:
            text = output.prompt
        elif tokenizer is not None:
            text = str(tokenizer.decode(ids))
        else:
            text = "".join(map(str, ids))
        return EchoedPrompt(text, ids, output.prompt_logprobs, output.prompt_top_logprobs)

    def failed(self, message: JobMessage, reason: str, *, code: str | None = None,
               type: str = "invalid_request_error") -> None:
        """Store `reason` as the job's error (`code` and `type` as the API's errors have)."""
        logger.info("job %s failed: %s", message.job_id, reason)
        error = error_body(reason, param=param_of(reason, REQUEST_FIELDS), code=code, type=type)
        if self._store.fail(message, error=error):
            metrics.JOBS_FAILED.labels(message.priority).inc()

    def _count_success(self, message: JobMessage, created_at: datetime) -> None:
        metrics.JOBS_COMPLETED.labels(message.priority).inc()
        metrics.END_TO_END_SECONDS.labels(message.priority).observe(
            max(0.0, (utcnow() - created_at).total_seconds())
        )


def _completion(output: RequestOutput, echo: EchoedPrompt | None = None) -> Completion:
    return Completion(
        echo=echo,
        text=output.text,
        token_ids=list(output.token_ids),
        finish_reason=output.finish_reason or "stop",
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        logprobs=output.logprobs,
        top_logprobs=output.top_logprobs,
    )


def _tool_calls(message: JobMessage, output: RequestOutput) -> list[dict[str, Any]] | None:
    if not message.body.get("tools"):
        return None
    return tool_calls_of(message.body, output.text, is_cut=output.finish_reason == "length")
