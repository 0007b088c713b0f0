"""The engine loop on a real tiny engine: joins, refusals and aborts come back as results."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.token_streams import StreamEntry
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from workers.inference.engine_loop import EngineLoop, EngineRequest, FinishedRequest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=16 * 1024 * 1024))


@pytest.fixture
def loop(engine: LLMEngine) -> Iterator[EngineLoop]:
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    try:
        yield engine_loop
    finally:
        engine_loop.stop()


class Sink:
    """Collects what the loop hands its token sink, one list per call (per step)."""

    def __init__(self) -> None:
        self.calls: list[list[StreamEntry]] = []

    def __call__(self, entries: list[StreamEntry]) -> None:
        self.calls.append(entries)

    def of(self, request_id: str) -> list[StreamEntry]:
        return [e for call in self.calls for e in call if e.job_id == request_id]


def collect(loop: EngineLoop, n: int, timeout: float = 60.0) -> dict[str, FinishedRequest]:
    """The first `n` finished requests, keyed by id in the order they finished."""
    finished: dict[str, FinishedRequest] = {}
    deadline = time.monotonic() + timeout
    while len(finished) < n:
        assert time.monotonic() < deadline, f"only {len(finished)} of {n} finished"
        finished.update((f.request_id, f) for f in loop.take_finished(timeout=0.1))
    return finished


def collect_until(loop: EngineLoop, request_id: str,
                  timeout: float = 60.0) -> dict[str, FinishedRequest]:
    """Everything the loop hands back up to and including `request_id` (a marker added
    last: once it is back, whatever the loop was going to hand back before it is too)."""
    finished: dict[str, FinishedRequest] = {}
    deadline = time.monotonic() + timeout
    while request_id not in finished:
        assert time.monotonic() < deadline, f"{request_id} never finished: {list(finished)}"
        for f in loop.take_finished(timeout=0.1):
            assert f.request_id not in finished, f"{f.request_id} handed back twice"
            finished[f.request_id] = f
    return finished


def wait_for_text(sink: Sink, request_id: str, timeout: float = 60.0) -> None:
    """Until the sink got some of the request's text: it is past prefill, mid-decode."""
    deadline = time.monotonic() + timeout
    while not any(e.text for e in sink.of(request_id)):
        assert time.monotonic() < deadline, f"{request_id} produced no text"
        time.sleep(0.005)


def test_requests_added_while_running_join_and_finish(loop: EngineLoop) -> None:
    sink = Sink()
    loop.token_sink = sink
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    loop.add("long", "hello world", long, priority=2, stream=True)
    wait_for_text(sink, "long")  # the long request is mid-decode when the short one arrives
    loop.add("short", [5, 6, 7], short, priority=0)
    finished = collect(loop, 2)
    # The short one came in after the long one was decoding and finished first: the two
    # were in the running batch together, not one after the other.
    assert list(finished) == ["short", "long"]
    short_output, long_output = finished["short"].output, finished["long"].output
    assert isinstance(short_output, RequestOutput) and len(short_output.token_ids) == 3
    assert isinstance(long_output, RequestOutput) and len(long_output.token_ids) == 200
    assert long_output.finish_reason == "length"
    assert loop.is_healthy


def test_requests_added_together_run_most_urgent_first_whatever_their_order(
        model_dir: Path) -> None:
    # Two sequences at a time: a worker's start (a poll's jobs) lists a batch's lines
    # before two urgent jobs; none of the batch may run before them.
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=2,
                                    kv_cache_memory_bytes=16 * 1024 * 1024))
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine_loop.add_all(
            [EngineRequest(f"batch-{i}", [5, 6, 7 + i], params, priority=2) for i in range(6)]
            + [EngineRequest(f"urgent-{i}", [9, 8, 7 + i], params, priority=0)
               for i in range(2)])
        finished = collect(engine_loop, 8)
    finally:
        engine_loop.stop()
    assert set(list(finished)[:2]) == {"urgent-0", "urgent-1"}, list(finished)
    assert all(isinstance(f.output, RequestOutput) for f in finished.values())


def test_a_refused_request_comes_back_with_its_error(loop: EngineLoop) -> None:
    loop.add("too-long", list(range(3, 10)) * 300, SamplingParams(max_tokens=2), priority=0)
    loop.add("fine", "hi", SamplingParams(max_tokens=2, temperature=0), priority=0)
    finished = collect(loop, 2)
    refused = finished["too-long"]
    assert refused.output is None and refused.error and "max_model_len" in refused.error
    assert finished["fine"].output is not None
    assert loop.is_healthy


def test_abort_frees_the_request_and_reports_it_once(loop: EngineLoop) -> None:
    sink = Sink()
    loop.token_sink = sink
    loop.add("doomed", "go", SamplingParams(max_tokens=900, ignore_eos=True), priority=1,
             stream=True)
    wait_for_text(sink, "doomed")  # aborted mid-decode, with its blocks held
    loop.abort("doomed")
    loop.abort("doomed")  # a second abort of the same id is a no-op
    loop.abort("never-added")
    finished = collect(loop, 1)
    assert finished["doomed"].aborted and finished["doomed"].output is None
    # A marker added after the abort comes back alone: the loop ran whole steps after the
    # abort and reported nothing more of the doomed request.
    loop.add("marker", "go", SamplingParams(max_tokens=2), priority=1)
    assert list(collect_until(loop, "marker")) == ["marker"]
    assert not loop.engine.has_unfinished_requests()


def test_a_signal_handler_wakes_a_waiting_take_at_once(loop: EngineLoop) -> None:
    """SIGTERM's handler wakes the worker's wait for finished jobs (up to FULL_WAIT_S
    while full), so the drain's timeout counts from the signal."""
    previous = signal.signal(signal.SIGALRM, lambda *_: loop.wake())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        start = time.monotonic()
        assert loop.take_finished(timeout=5.0) == []  # the wake-up itself is not a result
        assert time.monotonic() - start < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    loop.add("after", "go", SamplingParams(max_tokens=2), priority=1)
    assert collect(loop, 1)["after"].output is not None


def joined(entries: list[StreamEntry]) -> str:
    """The text the entries' offsets and texts spell, checking they neither skip nor repeat."""
    text = ""
    for entry in entries:
        if entry.offset is not None:
            assert entry.offset == len(text)
            text += entry.text
    return text


def test_streamed_requests_hand_their_text_to_the_sink_step_by_step(loop: EngineLoop) -> None:
    sink = Sink()
    loop.token_sink = sink
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    loop.add("streamed", "hello", params, priority=0, stream=True)
    loop.add("plain", "hello", params, priority=0)
    finished = collect(loop, 2)
    entries = sink.of("streamed")
    assert entries[0].event == "started"
    output = finished["streamed"].output
    assert isinstance(output, RequestOutput)
    assert joined(entries) == output.text
    assert entries[-1].finish_reason == "length"
    assert sum(1 for e in entries if e.text) > 1, "the text came in one piece"
    assert sink.of("plain") == []  # a request that did not ask pays nothing
    # One call per step, each holding at most one entry per request.
    assert all(len({e.job_id for e in call}) == len(call) for call in sink.calls)


def test_a_request_watched_late_gets_its_text_so_far_first(loop: EngineLoop) -> None:
    sink = Sink()
    loop.token_sink = sink
    loop.add("late", "go", SamplingParams(max_tokens=300, temperature=0, ignore_eos=True),
             priority=0)
    deadline = time.monotonic() + 60
    while not (num_chars_before := loop._num_emitted_chars.get("late", 0)):
        assert time.monotonic() < deadline, "late produced no text"
        time.sleep(0.005)
    loop.watch("late")  # into its decode: it has handed out text unwatched
    loop.watch("unknown")  # not live: nothing
    output = collect(loop, 1)["late"].output
    assert isinstance(output, RequestOutput)
    entries = sink.of("late")
    assert entries[0].event == "started"
    assert joined(entries) == output.text
    first_text = next(e for e in entries if e.text)
    assert first_text.offset == 0 and len(first_text.text) >= num_chars_before
    assert sink.of("unknown") == []
