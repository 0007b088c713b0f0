"""How the worker's poll loop paces itself: how many jobs it holds, and how long each
turn waits in the broker's poll or on the engine's finished queue."""

from __future__ import annotations

import math

from core.settings import Settings
from workers.engine.embedding_engine import EmbeddingEngine
from workers.inference.remote_servers import RemoteEngine

# How long an idle worker (nothing in flight) waits in the broker's poll. Records end the
# wait as soon as a fetch brings them (within the consumer's fetch_max_wait_ms), so this
# only paces the loop around it: at 50 ms an idle worker looped 20 times a second, and it
# and the broker burned about twice the CPU. A stop request waits up to this long.
IDLE_POLL_TIMEOUT_MS = 500
# The longest a busy worker waits on its finished queue between polls (see below).
POLL_TIMEOUT_MS = 50
# ... and a full one (see below).
FULL_WAIT_S = 0.25
# While jobs run, the worker waits on the engine's finished queue instead, which wakes it
# the moment a job finishes (a poll cannot be woken), and polls the broker without blocking
# between waits: new records wait at most this long. Waiting in the poll as when idle left
# each finished job unstored for up to POLL_TIMEOUT_MS: a lone 1-token job took ~110 ms
# from acceptance to its long-poll's answer, and 32 in flight completed ~170 a second
# with cores to spare.
BUSY_WAIT_S = 0.005
def max_inflight(settings: Settings, engine: object) -> int:
    """Jobs one worker holds in its engine at once, by the kind of engine it runs: unless
    set, twice a generating engine's running batch."""
    if isinstance(engine, EmbeddingEngine):
        return settings.embedding_worker_max_inflight
    if settings.worker_max_inflight is not None:
        return settings.worker_max_inflight
    if isinstance(engine, RemoteEngine):
        return engine.max_num_inflight
    return 2 * int(getattr(engine, "scheduler").max_num_seqs)  # noqa: B009  (an LLMEngine)


# With the in-flight bound reached no record could start, so a worker whose engine is
# full waits on the finished queue up to FULL_WAIT_S: a finished job still wakes it at
# once, a stop request wakes it too (the drain's timeout counts from the signal), and a
# cancel waits at most that long. Looping every BUSY_WAIT_S there (poll, commit, cancel
# check) cost a full embedding worker's main thread a third of its CPU (0.97 -> 0.62 ms
# per text) beside its two streams; at 50 ms it still looped ~15 times a second between
# finished batches (main thread 0.38 -> 0.36 ms per text at 250 ms, Kafka's I/O thread
# 0.10 -> 0.08). The same holds once the broker has nothing more to give: the last 30 s
# of a 10,000-line embeddings batch, every record fetched and thousands still in the
# engine, looped 140 times a second. So each poll that brings nothing doubles the wait,
# up to POLL_TIMEOUT_MS; a record that comes after a quiet spell waits at most that long.


def poll_timeout_ms(num_inflight: int, expecting_s: float | None = None) -> int:
    """How long the loop's broker poll may wait: while jobs run, the finished queue does
    the waiting (see `finished_wait_s`), so the poll only takes what has arrived; while
    the fetch wait is the expectant one (`FetchWait.before_poll`), no longer than that
    lasts, so the wait changes back when it ends."""
    if num_inflight:
        return 0
    if expecting_s is not None:
        return max(1, min(IDLE_POLL_TIMEOUT_MS, math.ceil(1000 * expecting_s)))
    return IDLE_POLL_TIMEOUT_MS


def finished_wait_s(
    num_inflight: int, limit: int, num_empty_polls: int = 0, *, can_take_more_urgent: bool = False
) -> float:
    """How long the poll loop waits for a finished job before polling the broker, after
    `num_empty_polls` polls in a row brought no record and started no job (records left in
    the prefetch wait for room, which a finished job makes and ends this wait for).

    `can_take_more_urgent`: at the bound, a more urgent record could still start (see
    intake), so the broker is polled as often as when busy, not only when a job finishes.
    """
    if num_inflight == 0:
        return 0.0  # nothing can finish: the broker's poll waits instead
    longest = POLL_TIMEOUT_MS / 1000
    if num_inflight >= limit and not can_take_more_urgent:
        return FULL_WAIT_S  # nothing new could start until a job finishes
    return min(BUSY_WAIT_S * 2 ** min(num_empty_polls, 16), longest)


def empty_polls_after(num_empty_polls: int, *, brought_records: bool, num_started: int) -> int:
    """The count `finished_wait_s` backs off by, after a turn of the loop: none when its
    poll brought records or it started jobs (more may come at once), else one more.

    Records left in the prefetch do not hold the count down: they wait for room, and the
    job whose end makes it ends the wait on the finished queue at once. Counting them as
    work to come kept a worker at its bound with a batch's backlog behind it polling every
    BUSY_WAIT_S: its main thread took half a core beside the engine, and SmolLM2's decode
    steps ran 0.55-0.65 s against 0.30-0.35 s once the backlog was in (a 1,000-line batch
    at 653-720 tokens/s against 794-820 without the spin, bench/eta_accuracy.py).
    """
    return 0 if brought_records or num_started else num_empty_polls + 1
