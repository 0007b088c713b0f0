"""What a served model can take: its context length and its tokenizer, read from disk.

Responsible for: finding a served model's directory the way workers do (a Hugging Face
directory given by path, the dequantized copy of a GGUF file under `models_dir/gguf/`, or
a name prepared under `models_dir`) without converting or loading weights; reading its
context length (`max_position_embeddings`, the limit a worker's engine takes) and its
vocabulary size (the token ids a prompt or `logit_bias` may name); loading its
tokenizer once; and counting a request's prompt tokens exactly as the engine does (the
chat template with the generation prompt, or the text with special tokens). A model whose
directory is not on this machine has no ModelContext; its requests are then checked
without a context limit and the worker stays the judge of their length.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from workers.engine.prompts import render_chat
from workers.engine.tokenizing import encode_ids

logger = logging.getLogger(__name__)

# Files whose presence says the directory carries a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class PromptRenderError(ValueError):
    """The model's chat template refused these messages (the worker would too)."""


@dataclass(slots=True)
class ModelContext:
    """One served model's limits: its context length, and a tokenizer to count prompts."""

    name: str
    max_model_len: int | None
    tokenizer: Any | None = None
    vocab_size: int | None = None  # token ids in [0, vocab_size) are the model's
    # Fast tokenizers are Rust objects that refuse concurrent mutable use ("Already
    # borrowed"); the API tokenizes on a thread pool, so calls take turns.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Tokens a text prompt can have beyond one per UTF-8 byte; None when no such bound
    # holds (see `prompt_tokens_at_most`).
    _tokens_beyond_bytes: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._tokens_beyond_bytes = tokens_beyond_bytes(self.tokenizer)

    def surely_fits(self, body: dict[str, Any], max_tokens: int | None) -> bool:
        """True when the prompt and `max_tokens` fit the context by `prompt_tokens_at_most`
        alone: no tokenizing needed to accept it."""
        at_most = self.prompt_tokens_at_most(body)
        return (at_most is not None and self.max_model_len is not None
                and at_most + (max_tokens or 0) <= self.max_model_len)

    def prompt_tokens_at_most(self, body: dict[str, Any]) -> int | None:
        """An upper bound on the prompt's tokens without tokenizing it; None when unknown.

        Counting is the API's largest cost per short prompt, and nearly every prompt fits
        its model's context by a wide margin: a bound that fits settles it for the price
        of a UTF-8 length. Chat messages are rendered by a template first, so they have
        no such bound.
        """
        prompt = body.get("prompt")
        if self._tokens_beyond_bytes is None or "messages" in body or not isinstance(prompt, str):
            return None
        return len(prompt.encode("utf-8", "surrogatepass")) + self._tokens_beyond_bytes

    def count_prompt_tokens(self, body: dict[str, Any]) -> int | None:
        """Prompt tokens of a normalised body as the engine counts them; None without a tokenizer.

        PromptRenderError when the chat template refuses the messages.
        """
        if self.tokenizer is None:
            return None
        with self._lock:
            if "messages" in body:
                # As the worker renders them: its tools, and tool history, included.
                try:
                    _, token_ids = render_chat(self.tokenizer, body["messages"],
                                               body.get("tools"),
                                               body.get("chat_template_kwargs"))
                except ValueError as e:
                    raise PromptRenderError(str(e).removeprefix("prompt: ")) from e
                return len(token_ids)
            prompt = body["prompt"]
            if isinstance(prompt, list):  # token ids, as the engine takes them
                return len(prompt)
            return self._count(prompt, add_special_tokens=True)

    def _count(self, text: str, *, add_special_tokens: bool) -> int:
        """Tokens of `text`, as `len(tokenizer(text).input_ids)` counts them."""
        assert self.tokenizer is not None
        return len(encode_ids(self.tokenizer, text, add_special_tokens=add_special_tokens))


def tokens_beyond_bytes(tokenizer: Any | None) -> int | None:
    """How many tokens a text can have beyond one per UTF-8 byte, or None if unbounded.

    Without a normalizer nothing can lengthen the text before it is split, and every
    token a BPE, WordPiece, Unigram or word-level model emits covers at least one byte
    of it (a byte-fallback token exactly one, an unknown character's token a whole
    character). What is added on top: one prefix space or `▁` a pre-tokenizer may put in
    front, and the special tokens the post-processor wraps the text in. A normalizer
    (NFKC turns one character into up to 18) leaves no such bound: those prompts are
    counted.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    try:
        return 1 + backend.num_special_tokens_to_add(False)
    except Exception:  # an unusual post-processor: count instead
        return None


def find_model_dir(name: str, models_dir: Path) -> Path | None:
    """The directory a worker would load for `name`, if it is already on this machine."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    gguf: Path | None = None
    if path.is_file() and path.suffix == ".gguf":
        gguf = path
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        gguf = ggufs[0] if len(ggufs) == 1 else None
    if gguf is not None:
        converted = Path(models_dir) / "gguf" / gguf.stem
        return converted if (converted / "config.json").is_file() else None
    prepared = Path(models_dir) / name
    if "/" not in name and (prepared / "config.json").is_file():
        return prepared
    return None


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; empty if it is missing or unreadable."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s/config.json: %s", model_dir, e)
        return {}
    return config if isinstance(config, dict) else {}


def read_max_model_len(model_dir: Path) -> int | None:
    """`max_position_embeddings` of config.json; None if it is missing or unreadable."""
    return _positive_int(read_config(model_dir).get("max_position_embeddings"))


def read_vocab_size(config: dict[str, Any]) -> int | None:
    """The token ids the model embeds (`vocab_size`, a multimodal config's text part's)."""
    text_config = config.get("text_config")
    return _positive_int(config.get("vocab_size")) or (
        _positive_int(text_config.get("vocab_size")) if isinstance(text_config, dict) else None)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer from its directory (never the hub); None if it has none."""
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        # Imported here: transformers takes seconds to import, and only processes that
        # serve a model found on disk need it.
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # a broken tokenizer must not take the API down
        logger.warning("cannot load the tokenizer of %s (prompts go unchecked): %s",
                       model_dir, e)
        return None


class ModelContexts:
    """ModelContext per served name, loaded on first use and kept.

    A name whose directory is missing is looked up again next time (a few stat calls), so
    a model pulled after start-up is picked up without a restart.
    """

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir)
        self._lock = threading.Lock()
        self._name_to_context: dict[str, ModelContext] = {}

    def loaded(self, name: str) -> ModelContext | None:
        """The context of `name` if it is already loaded; never loads (or waits for) one."""
        return self._name_to_context.get(name)

    def get(self, name: str, *, announced_dir: str | None = None) -> ModelContext | None:
        """The context of served model `name`, or None when its directory is not here.

        `announced_dir` is the directory its workers said they loaded (their model card):
        the one way to find a model served under a name of its own (`--served-model-name`).
        """
        context = self._name_to_context.get(name)
        if context is not None:
            return context
        with self._lock:
            context = self._name_to_context.get(name)
            if context is not None:
                return context
            model_dir = find_model_dir(name, self.models_dir)
            if model_dir is None and announced_dir:
                announced = Path(announced_dir)
                model_dir = announced if (announced / "config.json").is_file() else None
            if model_dir is None:
                return None
            config = read_config(model_dir)
            context = ModelContext(
                name=name, max_model_len=_positive_int(config.get("max_position_embeddings")),
                tokenizer=load_tokenizer(model_dir), vocab_size=read_vocab_size(config))
            self._name_to_context[name] = context
            logger.info("model %s: context %s tokens, prompts %s", name,
                        context.max_model_len,
                        "counted by its tokenizer" if context.tokenizer else "not counted")
            return context


    def warm_up(self, names: list[str],
                announced_dirs: dict[str, str] | None = None) -> threading.Thread:
        """Load these models' contexts on a daemon thread, so no request waits for it.

        Loading a tokenizer (and importing transformers) takes seconds, a minute on a
        loaded two-core machine; a request that arrives meanwhile waits for the same load
        instead of starting its own. `announced_dirs` names the directory of a model
        served under a name of its own, as `get` takes it.
        """
        def load() -> None:
            for name in names:
                try:
                    self.get(name, announced_dir=(announced_dirs or {}).get(name))
                except Exception:  # a broken model must not take the process down
                    logger.exception("could not read the context of model %s", name)

        thread = threading.Thread(target=load, name="model-contexts", daemon=True)
        thread.start()
        return thread


@lru_cache(maxsize=8)
def model_contexts(models_dir: Path) -> ModelContexts:
    """The process's ModelContexts for `models_dir`, shared by every request."""
    return ModelContexts(models_dir)
