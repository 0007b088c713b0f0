"""The consumer's fetch wait: short while records flow, the configured one while none come.

Why: the embedded broker (Tansu 0.6) does not answer a held fetch when a record arrives.
It reads its log and, while it finds nothing, sleeps half of the wait left before reading
again (its storage service's `fetch`). So a fetch that reaches it a moment before a record
holds that record for up to half of `fetch_max_wait_ms`. At 100 ms, with 32 jobs in flight
through one worker, a record reached the worker 19-29 ms (p50) after it was produced: most
of a 1-token job's life. A 40 ms wait while records flow took that run from 449-467 to
593-618 jobs a second (runs in turn; see BUSY_FETCH_MAX_WAIT_MS).

A short wait costs an answer, mostly empty, every few milliseconds, and kafka-python builds
and parses every fetch in Python: an idle service at 20 ms burned 175 ms of CPU a second
instead of 65, the worker and the broker most of it. So the wait is short only while the
worker has fetched records within the last second and would start the next one at once
(room in the engine, nothing waiting in its prefetch). A full worker, as an embeddings
batch keeps one for most of its run, gains nothing from a record sooner, and any empty
answer would be pure cost. Kafka itself answers a held fetch as soon as records arrive;
with it the short wait only adds empty answers in the second after the last record.

A worker that holds seconds of work (in its engine and its prefetch, at the pace its jobs
have been finishing) gains nothing from ten empty answers a second either, nor from a new
record a few milliseconds sooner: it would wait behind that work. Each empty answer costs
the worker and the broker ~5 ms of CPU, and a 10,000-line embeddings batch spent ~7 CPU s
on them beside its embedding streams (Kafka's I/O thread, the poll and the broker). So
then the wait is LONG_FETCH_MAX_WAIT_MS. What that risks is a fetch held when the work at
hand runs out (a partition resumed after its prefetch drained is only fetched once the
fetch in flight returns), so the long wait needs at least four times its length of work
at hand, at a pace measured over a whole PACE_WINDOW_S of being busy. And only while no
record could come that would start ahead of that work: a worker holding a `low` batch's
lines (in flight and prefetched) starts a `normal` or `high` record at once (intake), and
on the embedded broker the long wait held such a record up to a quarter of a second
before it was fetched at all: another tenant's normal jobs behind a 1,000-line low batch
of SmolLM2 waited 204 and 258 ms (medians) from acceptance to their claim, 23 and 59 ms
without it (bench/tenant_fairness.py --model smollm2-135m-instruct --lines 1000 --num-b 5
--b-after 5).

The short wait also follows the moment a worker's work runs out: a client that sends its
requests one after another sends the next when the last is answered, and a job longer than
BUSY_WINDOW_S (a 16-token stream on SmolLM2 here) had let the window close, so the next
request's record waited for up to half the configured wait. A `high` stream's record took
19 ms median, 51 ms worst, from the produce's acknowledgement to the worker's poll (load
average 4 on two cores). A worker whose work ran out pays for at most BUSY_WINDOW_S of
short fetches (about 15 more empty answers than at the configured wait); a worker that
stays busy, as in bulk runs, never passes through it.

That moment is sharper still: such a client's next record lands a few milliseconds after
the worker's last job ends, and the fetch that goes out then finds nothing and is held
half its wait before the broker reads again. A streamed SmolLM2 job sent on the previous
one's `[DONE]` waited 16-17 ms (median) from its row to its claim, most of it that half
of the 40 ms wait, where the engine took 77-79 ms to its first token: the largest part of
what the service adds. So for EXPECT_WINDOW_S after the work runs out, while nothing new
has come, fetches carry EXPECT_FETCH_MAX_WAIT_MS, and the loop's poll lasts no longer than
the window (`poll_timeout_ms`), so the wait goes back to the busy one when it ends. The
short wait only while the engine is empty: at 10 ms throughout (while records flow) the
row-to-claim time halved, but the empty answers' CPU beside the engine's steps made its
first token 13 ms later.

A worker with nothing to do for DORMANT_AFTER_S (nothing in flight or prefetched, no
record fetched) waits LONG_FETCH_MAX_WAIT_MS as well: an idle service's worker and broker
spent most of its CPU answering ten empty fetches a second. On Kafka that costs nothing, as
a held fetch is answered when a record lands; on the embedded broker the first record after
such a lull waits up to half the long wait (a quarter of a second) longer, once.

kafka-python has no public way to change the wait of a live consumer. Its fetcher reads
`fetch_max_wait_ms` from its own config dict each time it builds a request, so that dict
is changed in place; a fetcher without one leaves the wait as configured (and says so).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from kafka import KafkaConsumer

logger = logging.getLogger(__name__)

# The fetch wait while records flow: a record that lands just after an empty read waits
# up to half of it. With 32 jobs in flight, in the same minutes: 30, 40 and 60 ms all gave
# 593-618 jobs/s at 0.65-0.79 ms of worker CPU per job; 20 ms gave 544 and 628 at 0.83 and
# 1.00 (more empty answers); 100 ms throughout, 449 and 467.
BUSY_FETCH_MAX_WAIT_MS = 40
# Seconds without a fetched record after which the wait goes back to the configured one.
BUSY_WINDOW_S = 1.0
# The fetch wait for a moment after the worker's work runs out (module docstring), and
# that moment's length: a few empty answers at most, once per lull.
EXPECT_FETCH_MAX_WAIT_MS = 10
EXPECT_WINDOW_S = 0.05
# The fetch wait of a worker holding at least LONG_WAIT_WORK_FACTOR times as long of work.
LONG_FETCH_MAX_WAIT_MS = 500
LONG_WAIT_WORK_FACTOR = 4
# Seconds of having nothing to do after which an idle worker fetches with the long wait.
DORMANT_AFTER_S = 10.0
# Seconds over which the pace of finishing jobs is measured, and that a worker must have
# been busy before its pace counts (a pace read from a fraction of it would be too slow).
PACE_WINDOW_S = 2.0


class WorkPace:
    """How many seconds of work a busy worker holds, at the pace its jobs have finished."""

    def __init__(self, window_s: float = PACE_WINDOW_S) -> None:
        self._window_s = window_s
        self._finished: deque[tuple[float, int]] = deque()  # (when, how many)
        self._num_finished = 0  # their sum
        self._busy_since: float | None = None

    def on_loop(self, *, num_finished: int, num_inflight: int,
                now: float | None = None) -> None:
        """Once per worker loop: jobs finished in it, and jobs in the engine after it."""
        now = time.monotonic() if now is None else now
        if num_finished:
            self._finished.append((now, num_finished))
            self._num_finished += num_finished
        self._forget_before(now - self._window_s)
        if num_inflight == 0:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now

    def seconds_of_work(self, num_jobs: int, now: float | None = None) -> float:
        """How long `num_jobs` (in flight and waiting) last at the pace of the last window;
        0 until the worker has been busy for a whole window."""
        now = time.monotonic() if now is None else now
        if self._busy_since is None or now - self._busy_since < self._window_s:
            return 0.0
        self._forget_before(now - self._window_s)
        if not self._num_finished:
            return math.inf  # nothing finished in a whole window: long generations
        return num_jobs * self._window_s / self._num_finished

    def _forget_before(self, when: float) -> None:
        while self._finished and self._finished[0][0] <= when:
            self._num_finished -= self._finished.popleft()[1]


class FetchWait:
    """Switches a consumer's fetch wait by whether records came lately and how long the
    worker's work at hand lasts (module docstring)."""

    def __init__(self, consumer: KafkaConsumer, *, busy_ms: int = BUSY_FETCH_MAX_WAIT_MS,
                 long_ms: int = LONG_FETCH_MAX_WAIT_MS,
                 window_s: float = BUSY_WINDOW_S, expect_ms: int = EXPECT_FETCH_MAX_WAIT_MS,
                 expect_window_s: float = EXPECT_WINDOW_S) -> None:
        config = getattr(getattr(consumer, "_fetcher", None), "config", None)
        self._config: dict[str, Any] | None = config if isinstance(config, dict) else None
        self.idle_ms = int(consumer.config["fetch_max_wait_ms"])
        self.busy_ms = min(busy_ms, self.idle_ms)
        self.long_ms = max(long_ms, self.idle_ms)
        self._window_s = window_s
        self.expect_ms = min(expect_ms, self.busy_ms)
        self._expect_window_s = expect_window_s
        self._expect_until = -math.inf
        self._last_records_at = -math.inf
        self._idle_since: float | None = None
        self._was_busy = False
        if self._config is None:
            logger.warning("this kafka-python's fetcher keeps no config to change: the fetch "
                           "wait stays %d ms, and on the embedded broker a record may wait "
                           "up to half of it", self.idle_ms)

    @property
    def current_ms(self) -> int:
        """The wait the next fetch request carries."""
        return int(self._config["fetch_max_wait_ms"]) if self._config else self.idle_ms

    def before_poll(self, *, is_idle: bool, now: float | None = None) -> float | None:
        """Before each poll: whether the worker has nothing to do now. The moment its work
        runs out the next fetch carries the expectant wait (module docstring); returns how
        many seconds that lasts yet, or None outside it."""
        now = time.monotonic() if now is None else now
        if is_idle and self._was_busy:
            self._was_busy = False
            self._last_records_at = now  # the short wait follows the window (see on_poll)
            self._expect_until = now + self._expect_window_s
            self._set(self.expect_ms)
        if not is_idle or now >= self._expect_until:
            return None
        return self._expect_until - now

    def on_poll(self, batches: Mapping[Any, list[Any]], *, is_hungry: bool = True,
                seconds_of_work: float = 0.0, is_idle: bool = False,
                can_overtake: bool = False, now: float | None = None) -> None:
        """After each poll: what it returned, whether the worker would start another record
        at once (`is_hungry`), how long its work at hand lasts (`seconds_of_work`, see
        WorkPace), whether it has nothing at all to do (`is_idle`) and whether a record
        more urgent than all its work would start at once (`can_overtake`: that work is
        then no reason to fetch seldom), decide the wait of the fetches that follow."""
        now = time.monotonic() if now is None else now
        if batches or (is_idle and self._was_busy):
            # Records came; or the worker's work just ran out, and a client that waited on
            # it sends its next request now as often as not (module docstring).
            self._last_records_at = now
        self._was_busy = not is_idle
        if batches or not is_idle or now >= self._expect_until:
            self._expect_until = -math.inf
        if not is_idle or batches:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        is_flowing = now - self._last_records_at < self._window_s
        is_dormant = self._idle_since is not None and now - self._idle_since >= DORMANT_AFTER_S
        if now < self._expect_until:
            wait_ms = self.expect_ms
        elif is_dormant or (not can_overtake
                            and seconds_of_work * 1000 >= LONG_WAIT_WORK_FACTOR * self.long_ms):
            wait_ms = self.long_ms
        elif is_flowing and is_hungry:
            wait_ms = self.busy_ms
        else:
            wait_ms = self.idle_ms
        self._set(wait_ms)

    def _set(self, wait_ms: int) -> None:
        if self._config is not None and self._config["fetch_max_wait_ms"] != wait_ms:
            self._config["fetch_max_wait_ms"] = wait_ms


def num_finishable(seconds_of_work: float, *, num_jobs: int, seconds_left: float) -> int:
    """How many of `num_jobs` can finish in `seconds_left`, at a pace at which all of them
    take `seconds_of_work` (0: not known yet, so all may; inf: none finish at all)."""
    if seconds_of_work <= 0:
        return num_jobs
    if math.isinf(seconds_of_work) or seconds_left <= 0:
        return 0
    return min(num_jobs, int(num_jobs * seconds_left / seconds_of_work))
