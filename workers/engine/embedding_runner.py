"""The embedding runner: encoder models (BERT / MiniLM family) turning texts into vectors.

Responsible for:
- loading a local encoder directory through transformers' AutoModel and AutoTokenizer
  (never the hub) with its sentence-transformers pooling (see embedding_pooling);
- tokenizing texts (or taking token ids), truncating at the model's length when asked to
  and saying so per input, refusing over-long inputs otherwise;
- batching by a token budget: inputs sorted by length, so each batch pads to nearly its
  own length, and as many rows per batch as the budget allows (short texts go in large
  batches, long ones in small), but never an input padded past twice its length; when
  less than a full batch per stream waits, the streams share it (`batch_budget`);
  results come back in input order;
- on a CPU, running batches side by side in several single-threaded streams (one per core)
  rather than one after another with every core on each: an encoder this small splits each
  matrix product too finely for the cores to share it well, and one OpenMP team whose
  threads wait at every barrier is what collapses when another process takes a core.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer

from workers.engine.config import DEFAULT_MODELS_DIR
from workers.engine.embedding_pooling import PoolingConfig, pool, read_pooling_config
from workers.engine.encoder_packing import pack_encoder
from workers.engine.registry import resolve_model
from workers.engine.tokenizing import texts_encoder_of

logger = logging.getLogger(__name__)

EmbeddingInput = str | list[int]

# The smallest batch split off for another stream: a forward costs ~12 ms of fixed work
# (one text takes 13 ms, two 15) against ~4,000 tokens a second a stream, so a smaller
# piece would spend more on that than the idle stream saves.
MIN_SPLIT_TOKENS = 512


def batch_budget(num_waiting_tokens: int, budget: int, streams: int) -> int:
    """The token budget of the next batch when `num_waiting_tokens` wait to be embedded.

    The full budget while every stream can have a full batch; below that a stream's even
    share (at least MIN_SPLIT_TOKENS), so a small request runs on every stream instead of
    one while the others idle, and a large one's last batches shrink towards its end
    instead of leaving one stream a whole batch to finish alone.
    """
    if streams <= 1 or num_waiting_tokens >= streams * budget:
        return budget
    return min(budget, max(MIN_SPLIT_TOKENS, -(-num_waiting_tokens // streams)))


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's vector (float32, on the CPU), how many tokens it used, and whether it
    was cut at the model's length."""

    embedding: torch.Tensor
    num_tokens: int
    is_truncated: bool


@dataclass(slots=True)
class EncodedInput:
    """One input as the model will see it: its position, token ids (special tokens
    included) and whether it was cut at the model's length."""

    index: int
    token_ids: list[int]
    is_truncated: bool


class EmbeddingRunner:
    """Embeds batches of inputs with one encoder model (see the module docstring)."""

    def __init__(
        self,
        model: str | Path,
        *,
        models_dir: Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_num_batched_tokens: int | None = None,  # None: 4,096
        max_batch_size: int = 512,
        streams: int | None = None,
    ) -> None:
        max_num_batched_tokens = 4096 if max_num_batched_tokens is None else max_num_batched_tokens
        if max_num_batched_tokens < 1 or max_batch_size < 1:
            raise ValueError("max_num_batched_tokens and max_batch_size must be >= 1, got "
                             f"{max_num_batched_tokens} and {max_batch_size}")
        if streams is not None and streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.model_dir = resolve_model(str(model), models_dir or DEFAULT_MODELS_DIR)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self.dtype = _pick_dtype(dtype, self.device)
        self.pooling: PoolingConfig = read_pooling_config(self.model_dir)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self._encode_texts = texts_encoder_of(self.tokenizer)
        self.model: Any = AutoModel.from_pretrained(
            self.model_dir, local_files_only=True, dtype=self.dtype).to(self.device).eval()
        num_packed = pack_encoder(self.model, self.device, self.dtype)
        positions = int(getattr(self.model.config, "max_position_embeddings", 512))
        self.max_model_len = min(self.pooling.max_seq_length or positions, positions)
        self.dimensions = int(self.model.config.hidden_size)
        self.max_num_batched_tokens = max(max_num_batched_tokens, self.max_model_len)
        self.max_batch_size = max_batch_size
        # A GPU runs one batch at a time; a CPU one single-threaded stream per core.
        self.streams = streams or (torch.get_num_threads() if self.device.type == "cpu" else 1)
        self._pool = (ThreadPoolExecutor(self.streams, thread_name_prefix="embedding-stream",
                                         initializer=_one_thread_per_stream)
                      if self.streams > 1 else None)
        # What wrapping one sequence adds around its tokens: [CLS] ... [SEP] for BERT.
        self._prefix_ids, self._suffix_ids = _special_tokens_around(self.tokenizer)
        self._num_special = len(self._prefix_ids) + len(self._suffix_ids)
        logger.info("embedding runner ready: %s, %s on %s (%d stream%s), %d dims, %d tokens, "
                    "%s pooling%s, %d projections packed", self.model_dir.name, self.dtype,
                    self.device, self.streams, "s" if self.streams > 1 else "", self.dimensions,
                    self.max_model_len, self.pooling.mode,
                    " + normalisation" if self.pooling.normalize else "", num_packed)

    def encode(
        self, inputs: Sequence[EmbeddingInput], *, truncate: bool = True
    ) -> list[EncodedInput]:
        """Token ids per input, special tokens added; ValueError (naming `input[i]`) for an
        input over max_model_len when truncate is off, or an empty token list."""
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        encoded: dict[int, list[int]] = {}
        if texts:
            ids = self._encode_texts([t for _, t in texts])
            encoded.update((i, row) for (i, _), row in zip(texts, ids, strict=True))
        results = []
        limit = self.max_model_len - self._num_special
        for i, item in enumerate(inputs):
            content = encoded[i] if isinstance(item, str) else list(item)
            if not isinstance(item, str):
                if not content:
                    raise ValueError(f"input[{i}] is an empty list of token ids")
                vocab = len(self.tokenizer)
                bad = [t for t in content if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"input[{i}] holds token id {bad[0]}, outside the "
                                     f"vocabulary of {vocab}")
            is_truncated = len(content) > limit
            if is_truncated and not truncate:
                raise ValueError(
                    f"input[{i}] has {len(content) + self._num_special} tokens, more than the "
                    f"model's {self.max_model_len}; shorten it or allow truncation")
            content = content[:limit]
            results.append(EncodedInput(i, [*self._prefix_ids, *content, *self._suffix_ids],
                                    is_truncated))
        return results

    def embed(
        self, inputs: Sequence[EmbeddingInput], *, truncate: bool = True
    ) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per input, in input order (see `encode` for refusals)."""
        return self.embed_encoded(self.encode(inputs, truncate=truncate))

    def embed_encoded(self, encoded: list[EncodedInput]) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per encoded input, ordered by their `index` (0..n-1)."""
        outputs: list[EmbeddingOutput | None] = [None] * len(encoded)
        batches = self.batches(encoded)
        # Longest batches first, so the streams finish close together.
        results = (self._pool.map(self._run, batches) if self._pool and len(batches) > 1
                   else map(self._run, batches))
        for batch, vectors in zip(batches, results, strict=True):
            for row, item in zip(vectors, batch, strict=True):
                outputs[item.index] = EmbeddingOutput(row, len(item.token_ids),
                                                      item.is_truncated)
        assert all(o is not None for o in outputs), "every input belongs to one batch"
        return [o for o in outputs if o is not None]

    def submit(self, batch: list[EncodedInput]) -> Future[torch.Tensor]:
        """Start one batch (from `batches`) on a free stream: its pooled vectors (rows in
        batch order) when done. Without streams it runs here and returns done."""
        if self._pool is not None:
            return self._pool.submit(self._run, batch)
        done: Future[torch.Tensor] = Future()
        try:
            done.set_result(self._run(batch))
        except BaseException as e:  # raised again where the caller reads the result
            done.set_exception(e)
        return done

    @property
    def is_concurrent(self) -> bool:
        """True when `submit` returns at once and batches run on the streams' threads."""
        return self._pool is not None

    def batches(self, encoded: list[EncodedInput]) -> list[list[EncodedInput]]:
        """Longest first; each batch's rows × its longest row stays within the budget (see
        `batch_budget`), and no row is padded past twice its own length."""
        ordered = sorted(encoded, key=lambda e: len(e.token_ids), reverse=True)
        num_waiting = sum(len(e.token_ids) for e in ordered)
        batches: list[list[EncodedInput]] = []
        current: list[EncodedInput] = []
        limit = 0
        for item in ordered:
            length = len(item.token_ids)
            # Sorted longest first, so current[0] sets the batch's padded length.
            width = len(current[0].token_ids) if current else length
            if current and ((len(current) + 1) * width > limit
                            or len(current) == self.max_batch_size or width > 2 * length):
                batches.append(current)
                current = []
            if not current:
                limit = batch_budget(num_waiting, self.max_num_batched_tokens, self.streams)
            current.append(item)
            num_waiting -= length
        if current:
            batches.append(current)
        return batches

    def close(self) -> None:
        """Stop the streams' threads (the runner embeds one batch at a time afterwards)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @torch.inference_mode()
    def _run(self, batch: list[EncodedInput]) -> torch.Tensor:
        """Pooled vectors (len(batch), H) of one right-padded batch, on the CPU."""
        width = max(len(e.token_ids) for e in batch)
        pad_id = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, item in enumerate(batch):
            input_ids[row, : len(item.token_ids)] = torch.tensor(item.token_ids)
            attention_mask[row, : len(item.token_ids)] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return pool(hidden, attention_mask, self.pooling).cpu()


def _one_thread_per_stream() -> None:
    # OpenMP's and MKL's counts are per OS thread: the caller's own count is left as it was.
    torch.set_num_threads(1)


def _special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after one sequence's own tokens."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    wrapped = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(wrapped) - len(bare) + 1):
        if wrapped[start:start + len(bare)] == bare:
            return list(wrapped[:start]), list(wrapped[start + len(bare):])
    raise ValueError("cannot tell the tokenizer's special tokens from a sequence's own")


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp16 halves the work on a GPU and keeps cosine similarity to fp32 near 1.
        return torch.float16 if device.type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in choices:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return choices[dtype]
