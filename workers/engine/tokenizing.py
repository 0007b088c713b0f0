"""Encoding and decoding through a fast tokenizer's Rust backend, wherever that is exactly
what the transformers call would do.

A fast tokenizer's `__call__` sets its backend's truncation, padding and special-token
options, runs the same Rust encode and wraps the result in a BatchEncoding; its `decode`
converts the ids, runs the Rust decode and may clean up spaces. For a short job those
wrappers cost more than the Rust work (~40 us of an encode, ~8 of each decode, several
decodes a token): a large share of the engine's time per 1-token job. Where the backend's
options are the ones the call would set, the backend is called directly; otherwise the
transformers call runs. The ids and the text are the same either way.

Imports nothing heavy: the API counts prompt tokens with `encode_ids` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# ids, skip_special_tokens -> text
Decode = Callable[[list[int], bool], str]
# texts -> the ids of each, without special tokens
EncodeTexts = Callable[[list[str]], list[list[int]]]


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust backend when its options are the ones a call would set, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(
                getattr(tokenizer, "split_special_tokens", False))):
        return backend
    return None


def encode_ids(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`list(tokenizer(text, add_special_tokens=...).input_ids)`, without its wrappers."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        ids: list[int] = backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def encode_ids_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`encode_ids` of each text (special tokens added), in one call: the backend encodes a
    batch on its own threads, and the per-call wrappers are paid once."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
    return [list(ids) for ids in tokenizer(texts).input_ids]


def texts_encoder_of(tokenizer: Any) -> EncodeTexts:
    """A function equal to `tokenizer(texts, add_special_tokens=False).input_ids`.

    The call turns its backend's truncation and padding off before it encodes (a saved
    tokenizer.json may carry both: all-MiniLM's truncates at 128 and pads to it), so the
    shortcut encodes with its own copy of the backend with both off, which nothing set on
    the tokenizer's shared backend reaches. One text goes through `encode`, as
    `encode_batch` may hand even one to a thread pool. A backend that cannot be copied (a
    custom pre-tokenizer written in Python does not serialize) leaves the call.
    """
    def encode_slow(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return encode_slow
    try:
        own = type(backend).from_str(backend.to_str())
    except Exception:  # tokenizers raises its own Exception for what it cannot serialize
        return encode_slow
    own.no_truncation()
    own.no_padding()

    def encode_fast(texts: list[str]) -> list[list[int]]:
        own.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        if len(texts) == 1:
            return [own.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in own.encode_batch(texts, add_special_tokens=False)]
    return encode_fast


def decoder_of(tokenizer: Any) -> Decode:
    """A function equal to `tokenizer.decode(ids, skip_special_tokens=...)`.

    The backend alone decodes unless the tokenizer cleans up spaces afterwards (its
    `clean_up_tokenization_spaces`), which only transformers knows how to do.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        def decode_fast(ids: list[int], skip_special_tokens: bool) -> str:
            text: str = backend.decode(ids, skip_special_tokens=skip_special_tokens)
            return text
        return decode_fast

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        text: str = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text
    return decode
