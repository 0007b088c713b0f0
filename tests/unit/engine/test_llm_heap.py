"""The offline LLM's garbage-collector policy: what the process imported is frozen out of
later collections; the LLM's own engine is not, so a dropped one is still collected."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from tests.unit.engine.test_engine import make_llm
from tests.unit.engine.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-heap")
    save_tiny_llama(path, seed=2)
    return path


def test_the_imported_heap_is_frozen_and_a_dropped_llm_is_collected(model_dir: Path) -> None:
    gc.unfreeze()  # what earlier tests froze: this test's count starts from nothing
    llm = make_llm(model_dir, skip_tokenizer_init=True)
    assert gc.get_freeze_count() > 10_000  # torch, transformers and the rest
    pool = weakref.ref(llm.engine.runner.kv_cache)
    engine = llm.engine
    engine.cycle = [engine]  # type: ignore[attr-defined]  # only a collection frees this
    del llm, engine
    gc.collect()
    assert pool() is None
