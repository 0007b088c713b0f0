"""Requests held back while their grammar compiles off the engine thread.

Why: a schema not compiled lately was compiled inside `add_request`, on the engine thread,
and every running sequence waited for it (a 5,000-property schema: ~0.85 s on two cores,
a 55,000-value enum ~50 s before the API's size limits). The engine loop instead holds
such a request here while a thread of its own compiles (xgrammar releases the GIL), and
starts it when the compile reports back through the loop's inbox (`Compiled`).

Responsible for: a digest per schema or structural tag, the ones compiled lately (the
engine's grammar cache holds them, within its own bound; one it has dropped is compiled
again by `add_request`), and the held requests by id, which an abort or a watch may reach
while they wait.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Grammars remembered as compiled.
MAX_COMPILED_KEYS = 1024


@dataclass(slots=True)
class Compiled:
    """A held-back request's grammar finished compiling, or failed to (`error`)."""

    request_id: str
    key: bytes
    error: str | None = None


def grammar_key(params: object) -> bytes | None:
    """A digest of the request's schema or structural tag; None without either (an
    embedding request's parameters have neither)."""
    schema = getattr(params, "json_schema", None)
    text = schema if schema is not None else getattr(params, "structural_tag", None)
    if not isinstance(text, str):
        return None
    kind = b"schema" if schema is not None else b"tag"
    return kind + hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                  digest_size=16).digest()


class GrammarCompiles(Generic[T]):
    """The requests (`T`, the loop's own) held back for a compile, and what was compiled."""

    def __init__(self, compile_grammar: Callable[[Any], None],
                 report: Callable[[Compiled], None]) -> None:
        """`compile_grammar(params)` runs on the compile thread; `report` gets each
        outcome there too (it must only hand it on, e.g. to the loop's inbox)."""
        self._compile_grammar = compile_grammar
        self._report = report
        self._held: dict[str, T] = {}
        self._compiled: OrderedDict[bytes, None] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def is_compiled(self, key: bytes) -> bool:
        """Whether `key`'s grammar was compiled lately (and is kept the longest, so)."""
        if key not in self._compiled:
            return False
        self._compiled.move_to_end(key)
        return True

    def hold(self, request_id: str, request: T, params: Any, key: bytes) -> None:
        """Hold `request` back while its grammar compiles."""
        self._held[request_id] = request
        future = self._pool.submit(self._compile_grammar, params)

        def compiled(done: Future[None]) -> None:
            error = "the worker stopped" if done.cancelled() else done.exception()
            if error is not None and not isinstance(error, ValueError | str):
                logger.error("compiling %s's grammar failed", request_id, exc_info=error)
                error = f"the grammar could not be compiled: {type(error).__name__}: {error}"
            self._report(Compiled(request_id, key, None if error is None else str(error)))

        future.add_done_callback(compiled)

    def held(self, request_id: str) -> T | None:
        """The request held for `request_id`, if one is."""
        return self._held.get(request_id)

    def replace(self, request_id: str, request: T) -> None:
        """Hold `request` in place of the one held for its id."""
        self._held[request_id] = request

    def release(self, request_id: str) -> T | None:
        """Stop holding the request of `request_id` (aborted); it, or None."""
        return self._held.pop(request_id, None)

    def finished(self, outcome: Compiled) -> T | None:
        """Note a compile's outcome; the request it held, unless released meanwhile."""
        if outcome.error is None:
            self._compiled[outcome.key] = None
            if len(self._compiled) > MAX_COMPILED_KEYS:
                self._compiled.popitem(last=False)
        return self._held.pop(outcome.request_id, None)

    def shutdown(self) -> None:
        """Cancel compiles not started; their requests are reported with an error."""
        self._pool.shutdown(wait=False, cancel_futures=True)
