"""The service processes' garbage-collector settings: applied where a process serves,
never in a process that only builds an app (a test's client)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from core.gc_policy import OLDER_THRESHOLD, YOUNG_THRESHOLD
from tests.unit.api.conftest import ClientFactory


def test_settle_heap_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    code = (
        "import gc, json; from core.gc_policy import settle_heap; "
        "before = gc.get_threshold(); settle_heap(); "
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    before, after, frozen = json.loads(out)
    assert before[0] == 700  # CPython's default, so the change below is ours
    assert after == [YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD]
    assert frozen > 1_000  # every object the interpreter and its imports hold


def test_a_settled_process_ends_without_leak_reports() -> None:
    """Frozen objects are thawed at exit: Triton's bindings (which torch imports) would
    otherwise report each of their objects as leaked on stderr as the process ends."""
    pytest.importorskip("triton")
    code = "import triton; from core.gc_policy import settle_heap; settle_heap()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert "leaked" not in done.stderr


def test_an_app_built_for_a_test_leaves_the_collector_alone(make_client: ClientFactory) -> None:
    # Nothing frozen to start with: objects an earlier test of this process froze (an LLM
    # freezes what is imported) shrink the count as they die, whatever the app does.
    gc.unfreeze()
    threshold = gc.get_threshold()
    client = make_client()  # started: its lifespan ran
    assert client.get("/healthz").status_code == 200
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0
