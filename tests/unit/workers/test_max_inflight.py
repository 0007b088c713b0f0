"""How many jobs a worker holds at once depends on the engine it runs, and how long its
loop waits on them on how many it holds."""

from __future__ import annotations

from types import SimpleNamespace

from core.settings import Settings
from workers.engine.config import EngineConfig
from workers.engine.embedding_engine import EmbeddingEngine
from workers.engine.embedding_runner import EmbeddingRunner
from workers.inference.loop_pacing import (
    BUSY_WAIT_S,
    FULL_WAIT_S,
    IDLE_POLL_TIMEOUT_MS,
    POLL_TIMEOUT_MS,
    empty_polls_after,
    finished_wait_s,
    max_inflight,
    poll_timeout_ms,
)


def test_an_embedding_worker_holds_more_jobs_than_a_generating_one() -> None:
    settings = Settings(worker_max_inflight=16, embedding_worker_max_inflight=512)
    encoder = EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1))
    assert max_inflight(settings, encoder) == 512
    assert max_inflight(settings, object()) == 16
    engine = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=EngineConfig("m").max_num_seqs))
    assert Settings().embedding_worker_max_inflight > max_inflight(Settings(), engine)


def test_a_generating_worker_holds_twice_its_engines_batch_unless_told() -> None:
    """A finished step's places refill from jobs at hand while the next step runs."""
    engine = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=40))
    assert max_inflight(Settings(), engine) == 80
    assert max_inflight(Settings(worker_max_inflight=50), engine) == 50
    # The engine's own default, vLLM's, unless the settings name one.
    assert Settings().engine_max_num_seqs is None and EngineConfig("m").max_num_seqs == 256


def test_a_worker_waits_for_finished_jobs_longest_when_nothing_new_could_start() -> None:
    # Idle: the broker's poll does the waiting, long, as a record ends it at once.
    assert finished_wait_s(0, 8) == 0.0
    assert poll_timeout_ms(0) == IDLE_POLL_TIMEOUT_MS >= 10 * POLL_TIMEOUT_MS
    assert poll_timeout_ms(1) == 0
    # Room left: a short wait, so fetched records start soon.
    assert finished_wait_s(3, 8) == BUSY_WAIT_S
    # Full: only a finished job can change anything, and it wakes the loop anyway.
    assert finished_wait_s(8, 8) == FULL_WAIT_S > POLL_TIMEOUT_MS / 1000 > BUSY_WAIT_S


def test_a_worker_with_room_backs_off_while_the_broker_brings_nothing() -> None:
    waits = [finished_wait_s(3, 8, num_empty_polls=n) for n in range(8)]
    assert waits[0] == BUSY_WAIT_S
    assert waits[1] == 2 * BUSY_WAIT_S
    assert waits == sorted(waits)
    assert waits[-1] == POLL_TIMEOUT_MS / 1000
    assert finished_wait_s(3, 8, num_empty_polls=10_000) == POLL_TIMEOUT_MS / 1000


def test_records_waiting_for_room_do_not_keep_the_loop_polling() -> None:
    """At its bound with a batch's backlog in the prefetch, the loop backs off as when the
    broker brings nothing: those records start when a job ends, which wakes it anyway."""
    num_empty, waits = 0, []
    for _ in range(8):
        # 512 low jobs in flight: a more urgent record could still start.
        waits.append(finished_wait_s(512, 512, num_empty, can_take_more_urgent=True))
        num_empty = empty_polls_after(num_empty, brought_records=False, num_started=0)
    assert waits[0] == BUSY_WAIT_S and waits[-1] == POLL_TIMEOUT_MS / 1000
    # Records fetched, or jobs started from the prefetch: more may come at once.
    assert empty_polls_after(num_empty, brought_records=True, num_started=0) == 0
    assert empty_polls_after(num_empty, brought_records=False, num_started=3) == 0
