"""Estimate arithmetic over one model's load reading: queue order, work ahead, times.

Pure (no I/O): the API's estimate board and the autoscaler's deadline floor both use it.
A job's work ahead is the queued jobs before it in the order workers take them (priority,
then deadline, earliest first and none last, then creation), each worth the model's
expected work (prompt tokens the engine computes plus output tokens, learned from
finished jobs; a share answered from caches costs nothing), and what the running jobs
have left. That is what the workers' engines report (tokens still to compute at each
job's max_tokens, the output part scaled by the share of max_tokens finished jobs used),
less what the worker's pace has done since its beat; running jobs no report covers (a
remote engine, jobs claimed since) count whole. Counting every running job whole was
wrong by a factor of two to three for batches of a few engine batches: the engine runs
hundreds of sequences at once, so lines finish in waves, and when a wave's first lines
finish the rest of it is nearly done (bench/eta_accuracy.py, SmolLM2, 300 lines).
A job starts once that work is done at the model's measured rate (tokens/s summed over its
live workers), less what the jobs that start beside it have left then (about a mean job's
run), and finishes its own output after that, one token a step: at the step time of the
width the fleet runs now while other work lasts, alone after it is drained. No sooner,
either, than the work ahead and its own at the model's rate. Its own output is its
`max_tokens` times the share of `max_tokens` finished jobs used, where both are known.

Worked example: rate 1,000 tokens/s, expected work 200 tokens (150 out), step 20 ms,
2 running with 300 tokens left between them, job 9th in line: ahead = 8 x 200 + 300 =
1,900 tokens, 1.9 s, less a mean job's 150 x 0.02 = 3.0 s: start = now; its own run
ends at now + 3.0 s, after the (1,900 + 200) / 1,000 = 2.1 s of work: now + 3.0 s.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from datetime import datetime

from core.topics import PRIORITIES
from storage.estimates import BatchTail, LoadReading, WorkerWork

# Before a model has finished anything: what a job is assumed to be.
DEFAULT_PROMPT_TOKENS = 64.0
DEFAULT_COMPLETION_TOKENS = 128.0

# (the deadline it is ordered by, created_at, its own deadline or inf), seconds since the
# epoch.
QueueKey = tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class Estimate:
    """Where a job stands: jobs ahead of it, and when it should start and finish."""

    queue_position: int | None
    estimated_start_at: float | None
    estimated_completion_at: float | None


@dataclass(slots=True)
class ModelQueue:
    """One model's reading, arranged for estimates."""

    at: float  # seconds since the epoch
    num_workers: int
    tokens_per_s: float | None
    step_s: float | None
    work_per_job: float  # expected engine tokens of one queued job
    completion_tokens: float
    prompt_tokens: float = DEFAULT_PROMPT_TOKENS  # engine-computed prompt tokens of a job
    cost_share: float = 1.0  # the share of jobs the engine runs (the rest: cache answers)
    output_fill: float | None = None  # output tokens / max_tokens of finished jobs
    # Per priority rank: queued jobs' keys, sorted.
    queued: list[list[QueueKey]] = field(default_factory=list)
    # Running jobs' started_at (seconds since the epoch), sorted.
    running: list[float] = field(default_factory=list)
    # Engine tokens the running jobs have left (None: no worker reports it; each then
    # counts as a whole job's work).
    running_work: float | None = None
    # Batch id -> its queued and running jobs as this reading has them.
    batch_tails: dict[str, BatchTail] = field(default_factory=dict)
    # Lines of the model's batches in progress not yet enqueued as jobs.
    num_unqueued_lines: int = 0
    # A decode step of one sequence alone (None: no worker reports it).
    solo_step_s: float | None = None

    @classmethod
    def of(cls, reading: LoadReading, at: float) -> ModelQueue:
        """Arrange a reading."""
        prompt = reading.mean_prompt_tokens
        completion = reading.mean_completion_tokens
        prompt = DEFAULT_PROMPT_TOKENS if prompt is None else prompt
        completion = DEFAULT_COMPLETION_TOKENS if completion is None else completion
        queued: list[list[QueueKey]] = [[] for _ in PRIORITIES]
        for priority, deadline, created_at in reading.queued:
            rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
            queued[rank].append(queue_key(deadline, created_at))
        for keys in queued:
            keys.sort()
        cost_share = 1 - reading.cache_hit_fraction
        running = sorted(t.timestamp() for t in reading.running_started)
        return cls(
            at=at,
            num_workers=reading.num_workers,
            tokens_per_s=reading.tokens_per_s,
            step_s=reading.step_s,
            work_per_job=(prompt + completion) * cost_share,
            completion_tokens=completion,
            prompt_tokens=prompt,
            cost_share=cost_share,
            output_fill=reading.mean_output_fill,
            queued=queued,
            running=running,
            running_work=running_work(reading.work_left, at,
                                      num_unreported=reading.num_running_unreported,
                                      work_per_job=(prompt + completion) * cost_share,
                                      output_fill=reading.mean_output_fill),
            batch_tails=reading.batch_tails,
            num_unqueued_lines=reading.num_unqueued_lines,
            solo_step_s=reading.solo_step_s,
        )

    @property
    def num_running(self) -> int:
        """Jobs claimed by workers and not finished."""
        return len(self.running)

    def work_running(self, now: float | None = None) -> float:
        """Engine tokens the running jobs have left at `now` (the reading's time when
        None): what the workers reported, less what the fleet's pace has done since the
        reading (readings are up to `estimate_refresh_s` old)."""
        if self.running_work is None:
            return self.num_running * self.work_per_job
        since_s = 0.0 if now is None else max(0.0, now - self.at)
        return max(0.0, self.running_work - since_s * (self.tokens_per_s or 0.0))

    def work_per_running_job(self, now: float | None = None) -> float:
        """What one running job has left at `now`, on average."""
        if self.running_work is None or not self.running:
            return self.work_per_job
        return self.work_running(now) / self.num_running

    def jobs_ahead(self, rank: int, key: QueueKey) -> int:
        """Queued jobs a job of this rank and key comes after."""
        more_urgent = sum(len(keys) for keys in self.queued[:rank])
        return more_urgent + bisect.bisect_left(self.queued[rank], key)

    def expected_output(self, max_tokens: int | None = None) -> float:
        """Output tokens a job should produce: its `max_tokens` times the share of it that
        finished jobs used, or the mean output when either is unknown (never above
        `max_tokens`)."""
        if max_tokens is None:
            return self.completion_tokens
        if self.output_fill is not None:
            return max_tokens * self.output_fill
        return min(float(max_tokens), self.completion_tokens)

    def own_seconds(self, max_tokens: int | None = None) -> float:
        """How long one job runs once started: its output, one step per token."""
        return self.expected_output(max_tokens) * (self.step_s or 0.0)

    def own_work(self, max_tokens: int | None = None) -> float:
        """Engine tokens of one job with this `max_tokens` (its prompt and its output)."""
        return (self.prompt_tokens + self.expected_output(max_tokens)) * self.cost_share

    def seconds_to_drain_all(self, now: float) -> float | None:
        """How long the fleet has work, counting the batches' lines not yet enqueued (they
        keep the engine's batch as wide as the queued jobs do)."""
        if not self.tokens_per_s:
            return None
        num_queued = sum(len(keys) for keys in self.queued) + self.num_unqueued_lines
        return (num_queued * self.work_per_job + self.work_running(now)) / self.tokens_per_s

    def run_end(self, start: float, now: float, max_tokens: int | None = None) -> float:
        """When a job that starts at `start` has decoded its output, one token a step.

        While the fleet has other work, a step takes `step_s` (the width it runs at now);
        once that work is drained the job decodes alone, a step taking `solo_step_s` (the
        workers' fitted cost of a one-sequence step; without it, every step at `step_s`).
        A 256-token job that starts near the end of a backlog of 64-token lines spends
        most of its steps alone: counting all of them at the backlog's width put it +27%
        late (bench/eta_accuracy.py, tiny model).

        Example: step 0.1 s, alone 0.01 s, 200 tokens out, starting now with 5 s of other
        work: 50 steps by then, the other 150 alone in 1.5 s: now + 6.5 s.
        """
        step_s = self.step_s or 0.0
        num_steps = self.expected_output(max_tokens)
        end = start + num_steps * step_s
        drain_s = self.seconds_to_drain_all(now)
        if drain_s is None or not step_s or self.solo_step_s is None:
            return end
        drained_at = now + drain_s
        if end <= drained_at:
            return end
        num_wide = max(0.0, drained_at - start) / step_s
        return max(start, drained_at) + (num_steps - num_wide) * self.solo_step_s

    def estimate_queued(self, rank: int, key: QueueKey, now: float,
                        max_tokens: int | None = None) -> Estimate:
        """A queued job's (or a new one's) position and times.

        It starts once the work ahead of it is done, less what the jobs that start beside
        it have left then (about one mean job's run at the current width: the engine
        admits it as they leave their slots), and finishes its own run after that. So a
        job longer than the mean finishes later than the work ahead says, by its extra
        steps: counting its own work at the fleet's pace, as if it shared each step's
        time with the rest, put 256-token jobs behind 64-token lines up to 41% early
        (bench/eta_accuracy.py). No sooner, either, than the work ahead and its own work
        at the fleet's pace.
        """
        ahead = self.jobs_ahead(rank, key)
        if not self.tokens_per_s:
            return Estimate(ahead, None, None)
        work_ahead = ahead * self.work_per_job + self.work_running(now)
        start = now + max(0.0, work_ahead / self.tokens_per_s - self.own_seconds())
        completion = max(self.run_end(start, now, max_tokens),
                         now + (work_ahead + self.own_work(max_tokens)) / self.tokens_per_s)
        return Estimate(ahead, min(start, completion), completion)

    def estimate_running(self, started_at: float, now: float,
                         max_tokens: int | None = None, *, is_last: bool = False) -> Estimate:
        """A running job's times: the running jobs claimed before it (those claimed in the
        same instant: half of them, or all when `is_last`) and its own work at the
        model's pace; no sooner than its own run after it started, nor than a step away.
        Where the workers report what their jobs have left, each running job is worth
        the mean of it, its own included (the last one: all of it)."""
        if not self.tokens_per_s:
            return Estimate(0, started_at, None)
        earlier = bisect.bisect_left(self.running, started_at)
        same = bisect.bisect_right(self.running, started_at) - earlier
        # The job itself is among the `same` when it is counted in the reading.
        before = earlier + (max(0, same - 1) if is_last else max(0, same - 1) / 2)
        if self.running_work is None:
            work = before * self.work_per_job + self.own_work(max_tokens)
        else:
            work = (before + 1) * self.work_per_running_job(now)
        completion = max(now + work / self.tokens_per_s,
                         self.run_end(started_at, now, max_tokens), now + (self.step_s or 0.0))
        return Estimate(0, started_at, completion)

    def finish_unqueued(self, after: float | None, now: float, *, num_unqueued: int,
                        num_ahead: int = 0, num_unread: int = 0,
                        budget_tokens_per_s: float | None = None) -> float | None:
        """When `num_unqueued` more jobs (a batch's lines not yet enqueued) finish, run
        after `after` (now when None), `num_unread` jobs this reading does not hold yet
        (queued since it was read) and `num_ahead` other lines the fan-out serves first,
        at the model's pace, and no sooner than a token budget of `budget_tokens_per_s`
        lets the unqueued lines' own work through.

        Example: 100 lines of 50 tokens at 500 tokens/s take 10 s (20 s behind 100 lines
        of a nearer deadline); under a budget of 20,000 tokens a minute (333 tokens/s)
        they take 15 s from now.
        """
        if not self.tokens_per_s:
            return None
        tokens = num_unqueued * self.work_per_job
        num_jobs = num_unqueued + num_unread + num_ahead
        finish = max(after or now, now) + num_jobs * self.work_per_job / self.tokens_per_s
        if budget_tokens_per_s:
            finish = max(finish, now + tokens / budget_tokens_per_s)
        return finish

    def seconds_to_drain(self) -> float | None:
        """How long the model's fleet needs for all the work it has now."""
        if not self.tokens_per_s:
            return None
        num_queued = sum(len(keys) for keys in self.queued)
        return (num_queued * self.work_per_job + self.work_running()) / self.tokens_per_s

    def tokens_per_s_for_deadlines(self, now: float) -> float:
        """The pace (tokens/s) at which every queued job with a deadline would meet it:
        the most, over those jobs, of the work up to and including each divided by the
        time left to its deadline (0.0 when none has one; past deadlines are left to
        expiry)."""
        needed = 0.0
        work_before = self.work_running(now)
        for keys in self.queued:
            for _, _, deadline in keys:
                work_before += self.work_per_job
                if math.isfinite(deadline) and deadline > now:
                    needed = max(needed, work_before / (deadline - now))
        return needed


def running_work(work_left: list[WorkerWork], at: float, *, num_unreported: int,
                 work_per_job: float, output_fill: float | None) -> float | None:
    """Engine tokens the running jobs have left, from the workers' reports (None without
    any). Per worker: its tokens to compute at max_tokens, less the output its jobs will
    not use (1 - `output_fill` of what is left of it), plus `work_per_job` for each job it
    claimed since its beat, less what its pace got through since (on those jobs or the
    reported ones: a wave that finished and was replaced since the beat is not counted
    twice), and for each job it had claimed by its beat beyond those its engine counted
    (on their way from the claim to the engine then); and `work_per_job` for each of the
    `num_unreported` running jobs of workers that report nothing.

    Example: a worker beat 2 s ago with 180 requests, 9,000 tokens to compute of which
    6,000 output, at 1,000 tokens/s, and claimed 20 jobs since; jobs use 0.5 of
    max_tokens and are 50 tokens: 9,000 - 0.5 x 6,000 + 20 x 50 - 2 x 1,000 = 5,000 tokens.
    Had it held nothing at that beat and claimed the 20 jobs 0.5 s ago: 20 x 50 - 0.5 x
    1,000 = 500 tokens (its pace ran only since the claim).
    """
    if not work_left:
        return None
    fill = 1.0 if output_fill is None else min(max(output_fill, 0.0), 1.0)
    work = 0.0
    for worker in work_left:
        since_s = max(0.0, at - worker.reported_at.timestamp())
        if worker.is_idle_at_beat:
            # It did nothing between an idle beat and its first claim: a beat up to an
            # interval old would otherwise take that many seconds of its pace off the
            # jobs it claimed since (a batch's first wave counted half done).
            first = worker.first_claimed_since
            since_s = 0.0 if first is None else max(0.0, at - first.timestamp())
        left = (worker.num_tokens_to_compute - (1 - fill) * worker.num_output_tokens
                + worker.num_claimed_since * work_per_job
                + max(0, worker.num_claimed_before - worker.num_requests) * work_per_job
                - since_s * (worker.tokens_per_s or 0.0))
        work += max(0.0, left)
    return work + num_unreported * work_per_job


def queue_key(deadline: datetime | None, created_at: datetime) -> QueueKey:
    """How queued jobs are ordered within a priority: deadline (none last), then creation.

    Not the engine's order for a job without a deadline (after deadlines within
    DEFAULT_DUE_S, shared by tenant): the engine orders only the jobs a worker holds,
    and a job queued behind a batch's lines in the priority's topic reaches a worker after them
    (bench/eta_accuracy.py: ordering such jobs before far-off batch lines put their ETAs
    44-77% early).
    """
    created = created_at.timestamp()
    if deadline is None:
        return (math.inf, created, math.inf)
    return (deadline.timestamp(), created, deadline.timestamp())


def workers_for_deadlines(queue: ModelQueue, *, now: float) -> int:
    """Workers whose measured pace meets every queued deadline (0 without a measurement)."""
    if not queue.tokens_per_s or queue.num_workers < 1:
        return 0
    per_worker = queue.tokens_per_s / queue.num_workers
    return math.ceil(queue.tokens_per_s_for_deadlines(now) / per_worker)
