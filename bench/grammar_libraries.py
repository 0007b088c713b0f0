"""xgrammar against llguidance, as the engine would use them: the figures behind the choice.

For each library and each tokenizer (the test suite's 300-token byte-level tokenizer and
SmolLM2's 49,152-token one): the time to compile each JSON schema of the structured-output
bench, and the time per generated token to fill one sequence's bitmask and advance its
matcher, walking a valid document token by token (the work the engine does per sequence
per step). Run: `python bench/grammar_libraries.py [--model smollm2-135m-instruct]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_schemas import SCHEMAS, example_document  # noqa: E402


def _compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


def _tiny_tokenizer() -> Any:
    from tests.unit.engine.tiny_models import byte_level_tokenizer

    return byte_level_tokenizer()


def _model_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    from core.settings import get_settings
    from workers.engine.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(name, get_settings().models_dir))


def _bench_xgrammar(tokenizer: Any, vocab_size: int) -> tuple[list[float], list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compile_s, mask_s = [], []
    for schema in SCHEMAS:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        compile_s.append(time.perf_counter() - start)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        ids = tokenizer.encode(_compact(example_document(schema)), add_special_tokens=False)
        start = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            if not matcher.accept_token(t):
                raise RuntimeError("xgrammar refused a valid document")
        mask_s.append((time.perf_counter() - start) / len(ids))
    return compile_s, mask_s


def _bench_llguidance(tokenizer: Any, vocab_size: int) -> tuple[list[float], list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    compile_s, mask_s = [], []
    for schema in SCHEMAS:
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        # llguidance compiles lazily: the first mask pays for the lexer; count it here.
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        compile_s.append(time.perf_counter() - start)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        ids = tokenizer.encode(_compact(example_document(schema)), add_special_tokens=False)
        start = time.perf_counter()
        for t in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused a valid document: {matcher.get_error()}")
        mask_s.append((time.perf_counter() - start) / len(ids))
    return compile_s, mask_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="also measure this model's tokenizer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizers = [("tiny (300)", _tiny_tokenizer())]
    if args.model:
        tokenizers.append((args.model, _model_tokenizer(args.model)))
    for label, tokenizer in tokenizers:
        vocab_size = len(tokenizer)
        for name, bench in (("xgrammar", _bench_xgrammar), ("llguidance", _bench_llguidance)):
            compile_s, mask_s = bench(tokenizer, vocab_size)
            print(  # noqa: T201
                f"{label:>24} {name:>10}: compile median "
                f"{statistics.median(compile_s) * 1e3:7.2f} ms"
                f" max {max(compile_s) * 1e3:7.2f} ms; mask+advance per token median "
                f"{statistics.median(mask_s) * 1e6:6.1f} us max {max(mask_s) * 1e6:6.1f} us"
            )


if __name__ == "__main__":
    main()
