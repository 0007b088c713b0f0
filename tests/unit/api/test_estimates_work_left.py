"""Estimate arithmetic with the work the workers' engines report left for running jobs."""

from __future__ import annotations

import pytest

from storage.estimates import WorkerWork
from storage.queue_estimates import ModelQueue, queue_key, running_work
from tests.unit.api.test_estimates import NOW, at, reading


def work(num_requests: int, to_compute: int, output: int, *, ago_s: float = 0.0,
         tokens_per_s: float | None = 1000.0, num_claimed_since: int = 0) -> WorkerWork:
    return WorkerWork(at(100 - ago_s), num_requests, to_compute, output, tokens_per_s,
                      num_claimed_since)


def test_the_docstring_example() -> None:
    """Rate 1,000 tok/s, 200 tokens a job (150 out), step 20 ms, 2 running with 300 tokens
    left, 9th in line: (8 x 200 + 300 + 200) / 1,000 = 2.1 s, below its own 3.0 s."""
    queued = [("normal", None, at(i)) for i in range(9)]
    queue = ModelQueue.of(reading(queued=queued, running_started=[at(0), at(1)],
                                  work_left=[work(2, 300, 200)]), NOW)
    assert queue.work_running() == pytest.approx(300)
    estimate = queue.estimate_queued(1, queue_key(None, at(8)), NOW)
    assert estimate.estimated_completion_at == pytest.approx(NOW + 3.0, abs=1e-6)
    queue.step_s = 0.0  # without the floor: the work ahead
    estimate = queue.estimate_queued(1, queue_key(None, at(8)), NOW)
    assert estimate.estimated_completion_at == pytest.approx(NOW + 2.1, abs=1e-6)


def test_running_work_example() -> None:
    """A beat 2 s old: 180 requests, 9,000 tokens to compute (6,000 output), at 1,000
    tokens/s, 20 jobs claimed since; jobs use half their max_tokens, 50 tokens a job."""
    left = running_work([work(180, 9000, 6000, ago_s=2.0, num_claimed_since=20)], NOW,
                        num_unreported=0, work_per_job=50.0, output_fill=0.5)
    assert left == pytest.approx(9000 - 3000 + 20 * 50 - 2000)


def test_a_wave_replaced_since_the_beat_is_not_counted_twice() -> None:
    """At the beat 256 jobs had 512 tokens left; since, they finished and 256 new ones
    of 200 tokens were claimed, and 2 s at 1,000 tokens/s went by: 512 + 51,200 - 2,000
    tokens are left (not the new jobs whole beside a report emptied by the pace)."""
    left = running_work([work(256, 512, 256, ago_s=2.0, num_claimed_since=256)], NOW,
                        num_unreported=0, work_per_job=200.0, output_fill=None)
    assert left == pytest.approx(512 + 256 * 200 - 2000)


def test_a_wave_nearly_done_leaves_only_its_tail() -> None:
    """A 300-line batch on an engine of 256 sequences: the first wave has 2 tokens left
    each, the other 44 lines their whole 200. The batch's last line finishes when that is
    done, (256 x 2 + 44 x 200) / 1,000 = 9.3 s; counting each running line whole put it
    at 300 x 200 / 1,000 = 60 s."""
    running = [at(0)] * 300
    reported = [work(300, 256 * 2 + 44 * 200, 256 * 2 + 44 * 150)]
    queue = ModelQueue.of(reading(running_started=running, work_left=reported,
                                  step_s=0.0), NOW)
    last = queue.estimate_running(at(0).timestamp(), NOW, is_last=True)
    assert last.estimated_completion_at == pytest.approx(NOW + 9.312, abs=1e-6)
    whole = ModelQueue.of(reading(running_started=running, step_s=0.0), NOW)
    assert whole.estimate_running(at(0).timestamp(), NOW, is_last=True) \
        .estimated_completion_at == pytest.approx(NOW + 60.0, abs=1e-6)
    # Any one line of them: on average behind half the others, each worth the mean left.
    some = queue.estimate_running(at(0).timestamp(), NOW)
    assert some.estimated_completion_at == pytest.approx(NOW + (149.5 + 1) * 9.312 / 300,
                                                         abs=1e-6)
    assert queue.seconds_to_drain() == pytest.approx(9.312)


def test_what_the_pace_did_since_the_beat_is_done() -> None:
    """Reported 5,000 tokens 3 s ago at 1,000 tokens/s: 2,000 left; a report older than
    its work lasts leaves nothing, not less."""
    assert running_work([work(10, 5000, 0, ago_s=3.0)], NOW, num_unreported=0,
                        work_per_job=200.0, output_fill=None) == pytest.approx(2000)
    assert running_work([work(10, 5000, 0, ago_s=9.0)], NOW, num_unreported=0,
                        work_per_job=200.0, output_fill=None) == 0.0
    # A worker without a measured pace: its report as it is.
    assert running_work([work(10, 5000, 0, ago_s=3.0, tokens_per_s=None)], NOW,
                        num_unreported=0, work_per_job=200.0, output_fill=None) == 5000


def test_output_jobs_will_not_use_is_not_counted() -> None:
    """Jobs use 40% of max_tokens: of 1,000 output tokens left at max_tokens, 600 will
    never be computed. Without a learned share, all of it counts."""
    assert running_work([work(4, 1200, 1000)], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=0.4) == pytest.approx(600)
    assert running_work([work(4, 1200, 1000)], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=None) == pytest.approx(1200)


def test_running_jobs_no_report_covers_count_whole() -> None:
    """Two workers report 1,500 tokens left; 10 running jobs belong to a worker that
    reports nothing: 200 tokens each. No report at all: None, and every running job
    counts whole."""
    reports = [work(20, 1000, 500), work(10, 500, 200)]
    assert running_work(reports, NOW, num_unreported=10, work_per_job=200.0,
                        output_fill=None) == pytest.approx(1500 + 10 * 200)
    assert running_work([], NOW, num_unreported=40, work_per_job=200.0,
                        output_fill=None) is None
    queue = ModelQueue.of(reading(running_started=[at(0)] * 40), NOW)
    assert queue.running_work is None and queue.work_running() == pytest.approx(40 * 200)


def test_the_deadline_pace_counts_the_running_work_left() -> None:
    """100 running jobs with 1,000 tokens left and one queued job of 200 tokens due in
    12 s: 1,200 / 12 = 100 tokens/s (counting the running jobs whole: 20,200 / 12)."""
    queued = [("normal", at(112), at(50))]
    running = [at(0)] * 100
    queue = ModelQueue.of(reading(queued=queued, running_started=running,
                                  work_left=[work(100, 1000, 0)]), NOW)
    assert queue.tokens_per_s_for_deadlines(NOW) == pytest.approx(100.0)
    whole = ModelQueue.of(reading(queued=queued, running_started=running), NOW)
    assert whole.tokens_per_s_for_deadlines(NOW) == pytest.approx(20_200 / 12)


def test_a_reading_ages_by_the_fleets_pace() -> None:
    """Read with 3,000 tokens left at 1,000 tokens/s: a second later 2,000 are left, and
    the last running job's estimate stays put (it does not slide a second per second of
    the reading's age); after 3 s nothing is left."""
    running = [at(0)] * 10
    queue = ModelQueue.of(reading(running_started=running, work_left=[work(10, 3000, 0)],
                                  step_s=0.0), NOW)
    assert queue.work_running(NOW + 1) == pytest.approx(2000)
    assert queue.work_running(NOW + 5) == 0.0
    for now in (NOW, NOW + 1, NOW + 2):
        last = queue.estimate_running(at(0).timestamp(), now, is_last=True)
        assert last.estimated_completion_at == pytest.approx(NOW + 3.0, abs=1e-6)


def test_jobs_claimed_before_the_beat_but_not_yet_in_the_engine_count_whole() -> None:
    """A worker had claimed 512 jobs by its beat but its engine held only 164 of them
    (the others on their way in): the 348 missing are 200 tokens each. Jobs claimed
    before the beat that finished since make the count smaller, never negative."""
    claimed = WorkerWork(at(100), 164, 1000, 500, 1000.0, num_claimed_before=512)
    assert running_work([claimed], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=None) == pytest.approx(1000 + 348 * 200)
    finished = WorkerWork(at(100), 164, 1000, 500, 1000.0, num_claimed_before=100)
    assert running_work([finished], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=None) == pytest.approx(1000)


def test_a_worker_idle_at_its_beat_works_only_since_its_first_claim() -> None:
    """It beat 4 s ago holding nothing, and claimed 100 jobs of 200 tokens 0.5 s ago: at
    1,000 tokens/s it got through 500 tokens of them, not the 4,000 that 4 s of its pace
    would take off (which put a batch's first wave a fifth done before it started)."""
    claimed_at = at(100 - 0.5)
    idle = WorkerWork(at(100 - 4.0), 0, 0, 0, 1000.0, num_claimed_since=100,
                      first_claimed_since=claimed_at)
    assert running_work([idle], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=None) == pytest.approx(20_000 - 500)
    # Busy at its beat: its pace ran all along, on its reported jobs and the new ones.
    busy = WorkerWork(at(100 - 4.0), 10, 1000, 500, 1000.0, num_claimed_since=100,
                      num_claimed_before=10, first_claimed_since=claimed_at)
    assert running_work([busy], NOW, num_unreported=0, work_per_job=200.0,
                        output_fill=None) == pytest.approx(1000 + 20_000 - 4000)
    # Idle and nothing claimed since: nothing left, nothing taken off.
    assert running_work([WorkerWork(at(90), 0, 0, 0, 1000.0)], NOW, num_unreported=0,
                        work_per_job=200.0, output_fill=None) == 0.0
