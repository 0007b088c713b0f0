"""The inference worker on the real broker, Redis and PostgreSQL, with a real (tiny) model.

Workers run as `python -m workers.inference` child processes, so SIGTERM and SIGKILL are
the real thing. The model is a random-weight 2-layer Llama with a trained tokenizer: fast
on a CPU, and exercising the same engine code as any model. Jobs are written to the
database and produced to Kafka as the API does; results are read back from the database.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from statistics import median

import httpx
import redis
import sqlalchemy as sa

from core.kafka import consumer_lag, make_producer
from scheduler.embedded_services import free_port
from storage import jobs
from storage.events import publish_cancel
from storage.models import Job, JobStatus
from tests.utils.worker_service import Service, job_bodies


def _metric(port: int, name: str, labels: str = "") -> float:
    """The sum of the metric's samples (with labels); 0 when it has none."""
    return _metric_or_none(port, name, labels) or 0.0


def _metric_or_none(port: int, name: str, labels: str = "") -> float | None:
    """The sum of the metric's samples (with labels); None when it is not exported."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name and labels in line]
    return sum(samples) if samples else None


def test_worker_runs_jobs_end_to_end(service) -> None:
    """Results, errors, a malformed record, a cache hit, cancellation and metrics."""
    port = free_port()
    svc = service(worker_metrics_port=port)
    good = svc.submit("normal", job_bodies(6, tag="e2e", max_tokens=6))
    bad = svc.submit("high", [{"prompt": "x", "max_tokens": 4, "temperature": 0, "top_p": 7}])
    producer = make_producer(svc.settings)
    producer.send(svc.settings.job_topics["low"], value=b"{not a job")
    producer.flush()
    producer.close()
    worker = svc.start_worker()

    done = svc.wait_terminal(good + bad)
    for job_id in good:
        job = done[job_id]
        assert job.status == JobStatus.SUCCEEDED, job.error
        result = job.result
        assert result is not None
        choice = result["choices"][0]
        if job.kind == "chat.completion":
            assert result["object"] == "chat.completion"
            assert choice["message"]["role"] == "assistant"
        else:
            assert result["object"] == "text_completion" and "text" in choice
        assert choice["finish_reason"] in ("stop", "length")
        usage = result["usage"]
        assert usage["completion_tokens"] == job.completion_tokens <= 6
        assert usage["prompt_tokens"] == job.prompt_tokens > 0
        assert usage["prompt_tokens_details"]["cached_tokens"] == job.cached_tokens
        assert job.attempts == 1 and job.started_at and job.finished_at and job.worker_id
    failed = done[bad[0]]
    assert failed.status == JobStatus.FAILED
    assert failed.error is not None and failed.error["param"] == "top_p"

    # The same deterministic request again is answered from the exact-result cache.
    first = done[good[0]]
    (again,) = svc.submit("normal", [dict(first.request)])
    repeat = svc.wait_terminal([again])[again]
    assert repeat.status == JobStatus.SUCCEEDED and repeat.result is not None
    assert first.result is not None
    assert repeat.result["choices"] == first.result["choices"]
    assert repeat.result["id"].endswith(again)
    # Counted just after the row is written, so possibly a moment after the poll saw it.
    svc.wait_for(
        "the cache hit to be counted",
        lambda: _metric(port, "batchinfer_result_cache_hits_total") == 1,
        timeout=30,
    )

    # A long job is aborted in the engine when its cancellation is announced.
    (long_job,) = svc.submit(
        "high", [{"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}]
    )
    svc.wait_for(
        "the long job to run", lambda: svc.count_status([long_job], JobStatus.RUNNING) == 1
    )
    with svc.sessions() as session:
        assert jobs.cancel_job(session, job_id=long_job, tenant_id=svc.tenant_id)
        session.commit()
    publish_cancel(
        redis.Redis.from_url(svc.settings.redis_url),
        prefix=svc.settings.topic_prefix,
        job_id=long_job,
    )
    svc.wait_for(
        "the cancel to reach the engine",
        lambda: _metric(port, "batchinfer_jobs_cancelled_total") == 1,
        timeout=30,
    )
    (after,) = svc.submit("high", job_bodies(1, tag="after-cancel", max_tokens=4))
    assert svc.wait_terminal([after])[after].status == JobStatus.SUCCEEDED
    assert svc.jobs([long_job])[long_job].status == JobStatus.CANCELLED

    # As above: the last success is counted a moment after its row is written.
    svc.wait_for(
        "the last success to be counted",
        lambda: _metric(port, "batchinfer_jobs_completed_total")
        == _metric(port, "batchinfer_end_to_end_seconds_count")
        == len(good) + 2,
        timeout=30,
    )
    assert _metric(port, "batchinfer_jobs_failed_total", 'priority="high"') == 1
    assert _metric(port, "batchinfer_queue_wait_seconds_count") >= len(good) + 2
    usage = _metric_or_none(port, "batchinfer_kv_cache_usage_ratio")
    assert usage is not None and 0 <= usage <= 1, usage
    assert worker.stop() == 0, worker.log_tail()
    # Everything processed was committed, the malformed record included.
    assert sum(consumer_lag(svc.settings, group_id=svc.settings.consumer_group).values()) == 0


def test_high_priority_jobs_overtake_a_low_priority_flood(service) -> None:
    """High jobs produced after a flood of low ones finish before most of the flood."""
    svc = service(worker_max_inflight=2, engine_max_num_seqs=2)
    worker = svc.start_worker()
    low = svc.submit("low", job_bodies(24, tag="flood", max_tokens=160, ignore_eos=True))
    svc.wait_for(
        "the worker to start on the flood",
        lambda: svc.count_status(low, JobStatus.QUEUED) < len(low),
        timeout=120,
    )
    # Frozen while the high jobs are written and produced, so however fast the engine (or
    # slow this test) the flood does not get through while they are on their way.
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        high = svc.submit("high", job_bodies(4, tag="urgent", max_tokens=160, ignore_eos=True))
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    done = svc.wait_terminal(low + high)
    assert all(j.status == JobStatus.SUCCEEDED for j in done.values())

    finished = {i: j.finished_at for i, j in done.items() if j.finished_at is not None}
    # Measured from when the worker started the first high job, not from when the test
    # produced them: the fetch that brings them takes a moment the flood's pace says
    # nothing about (on a fast engine, a round of low jobs).
    first_high_started = min(j.started_at for i, j in done.items() if i in high and j.started_at)
    pending_low = [i for i in low if finished[i] > first_high_started]
    assert len(pending_low) >= 8, "the flood finished too fast for the comparison to mean much"
    last_high = max(finished[i] for i in high)
    overtaken = [i for i in pending_low if finished[i] > last_high]
    # Allowed to finish first: the low jobs in flight when the first high one started, and
    # one refill polled together with them.
    assert len(overtaken) >= len(pending_low) - 2 * svc.settings.worker_max_inflight, (
        f"{len(pending_low) - len(overtaken)} of {len(pending_low)} pending low jobs "
        "finished before the last high one"
    )
    assert median(finished[i].timestamp() for i in high) < median(
        finished[i].timestamp() for i in pending_low
    )
    assert worker.stop() == 0, worker.log_tail()


def _count_completion_writes(svc: Service) -> None:
    """A trigger that records every UPDATE leaving a job row `succeeded`."""
    with svc.sessions() as session:
        session.execute(sa.text("CREATE TABLE completion_writes (job_id text NOT NULL)"))
        session.execute(
            sa.text(
                "CREATE FUNCTION record_completion() RETURNS trigger AS $$ BEGIN "
                "INSERT INTO completion_writes (job_id) VALUES (NEW.id); RETURN NEW; END $$ "
                "LANGUAGE plpgsql"
            )
        )
        session.execute(
            sa.text(
                "CREATE TRIGGER jobs_completion_writes AFTER UPDATE ON jobs FOR EACH ROW "
                "WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION record_completion()"
            )
        )
        session.commit()


def test_sigkill_mid_run_loses_and_duplicates_nothing(service) -> None:
    """Kill -9 a busy worker, start another: every job succeeds exactly once."""
    # Two at a time and long enough that the kill lands with jobs done, running and queued.
    svc = service(worker_max_inflight=2, engine_max_num_seqs=2)
    _count_completion_writes(svc)
    job_ids = (
        svc.submit("high", job_bodies(6, tag="k-high", max_tokens=128, ignore_eos=True))
        + svc.submit("normal", job_bodies(6, tag="k-normal", max_tokens=128, ignore_eos=True))
        + svc.submit("low", job_bodies(6, tag="k-low", max_tokens=128, ignore_eos=True))
    )
    first = svc.start_worker()

    def done_and_running(rows: dict[str, Job]) -> bool:
        statuses = [j.status for j in rows.values()]
        return (statuses.count(JobStatus.SUCCEEDED) >= 2
                and statuses.count(JobStatus.RUNNING) >= 1)

    # Frozen first, so the rows read are the rows the kill leaves.
    at_kill = svc.freeze_when(first, "some jobs done and some running", job_ids,
                              done_and_running)
    first.kill()
    running_at_kill = [i for i, j in at_kill.items() if j.status == JobStatus.RUNNING]
    assert running_at_kill and len(running_at_kill) < len(job_ids)

    second = svc.start_worker()
    done = svc.wait_terminal(job_ids)
    assert all(j.status == JobStatus.SUCCEEDED and j.result for j in done.values())
    with svc.sessions() as session:
        rows = session.execute(
            sa.text("SELECT job_id, count(*) FROM completion_writes GROUP BY job_id")
        ).all()
    writes = dict(rows)
    assert set(writes) == set(job_ids)
    assert all(count == 1 for count in writes.values()), writes
    for job_id in running_at_kill:  # re-run by the second worker after redelivery
        assert done[job_id].attempts == 2
        assert done[job_id].worker_id != at_kill[job_id].worker_id
    finished_before_kill = [i for i, j in at_kill.items() if j.status == JobStatus.SUCCEEDED]
    for job_id in finished_before_kill:  # redelivered but skipped: never claimed again
        assert done[job_id].attempts == 1
    assert second.stop() == 0, second.log_tail()
    assert sum(consumer_lag(svc.settings, group_id=svc.settings.consumer_group).values()) == 0


def test_sigterm_drains_in_flight_jobs_and_commits(service) -> None:
    """SIGTERM: in-flight jobs finish, nothing new starts, offsets cover exactly the done."""
    # Two at a time and long enough that most jobs are still queued at the SIGTERM.
    svc = service(worker_drain_timeout_s=120, worker_max_inflight=2, engine_max_num_seqs=2)
    job_ids = svc.submit("normal", job_bodies(16, tag="drain", max_tokens=128, ignore_eos=True))
    worker = svc.start_worker()
    svc.wait_for("jobs running", lambda: svc.count_status(job_ids, JobStatus.RUNNING) >= 2)
    worker.process.terminate()
    running_at_term = [i for i, j in svc.jobs(job_ids).items() if j.status == JobStatus.RUNNING]
    assert worker.process.wait(120) == 0, worker.log_tail()
    assert "draining" in worker.log_tail()

    after = svc.jobs(job_ids)
    assert not any(j.status == JobStatus.RUNNING for j in after.values())
    for job_id in running_at_term:
        assert after[job_id].status == JobStatus.SUCCEEDED
    queued = [i for i, j in after.items() if j.status == JobStatus.QUEUED]
    assert queued, "the drain should leave work it had not started"
    lag = consumer_lag(svc.settings, group_id=svc.settings.consumer_group)
    assert sum(lag.values()) == len(queued)

    successor = svc.start_worker()
    done = svc.wait_terminal(job_ids)
    assert all(j.status == JobStatus.SUCCEEDED and j.attempts == 1 for j in done.values())
    assert successor.stop() == 0, successor.log_tail()


def test_a_worker_joining_mid_run_takes_over_partitions_without_duplicates(service) -> None:
    """Scale-up: the rebalance moves partitions (and their in-flight jobs) cleanly."""
    # One long job at a time, so the first worker is still busy when the second is up.
    svc = service(worker_max_inflight=1, engine_max_num_seqs=1)
    _count_completion_writes(svc)
    job_ids = [
        job_id
        for priority in ("high", "normal", "low")
        for job_id in svc.submit(
            priority,
            job_bodies(6, tag=f"scale-{priority}", max_tokens=512, ignore_eos=True),
            spread=True,  # both workers' partitions hold work
        )
    ]
    first = svc.start_worker()
    svc.wait_for(
        "the first worker to finish a job",
        lambda: svc.count_status(job_ids, JobStatus.SUCCEEDED) >= 1,
    )
    second = svc.start_worker()
    svc.wait_for(
        "the second worker to get partitions",
        lambda: "partitions assigned" in second.log_tail(),
        timeout=120,
    )
    # However fast the first worker got through the jobs above, these land on every
    # partition after the rebalance, so the second worker's share is never empty.
    job_ids += [
        job_id
        for priority in ("high", "normal", "low")
        for job_id in svc.submit(
            priority,
            job_bodies(3, tag=f"scale-late-{priority}", max_tokens=64, ignore_eos=True),
            spread=True,
        )
    ]

    done = svc.wait_terminal(job_ids, timeout=300)
    assert all(j.status == JobStatus.SUCCEEDED and j.result for j in done.values())
    with svc.sessions() as session:
        writes = dict(
            session.execute(
                sa.text("SELECT job_id, count(*) FROM completion_writes GROUP BY job_id")
            ).all()
        )
    assert set(writes) == set(job_ids) and set(writes.values()) == {1}
    by_worker = Counter(j.worker_id for j in done.values())
    assert len(by_worker) == 2, f"{by_worker}\n{first.log_tail()}\n{second.log_tail()}"
    # The first worker, with no live peer, began its group join before its load was done;
    # the second joined only once loaded, so the first kept serving through that load.
    first_log, second_log = first.log_path.read_text(), second.log_path.read_text()
    assert (-1 < first_log.find("joining the group while the engine loads")
            < first_log.find("serving ") < first_log.find("joined while loading")), first_log
    assert "while the engine loads" not in second_log, second_log
    assert "partitions assigned" in second_log, second_log
    assert first.stop() == 0, first.log_tail()
    assert second.stop() == 0, second.log_tail()
    assert sum(consumer_lag(svc.settings, group_id=svc.settings.consumer_group).values()) == 0


def test_a_high_job_starts_at_once_on_a_worker_full_of_low_ones(service) -> None:
    """The in-flight bound counts only jobs at least as urgent: a worker holding its bound
    in low jobs starts a high one before any of them finishes (it used to wait for one)."""
    svc = service(worker_max_inflight=2, engine_max_num_seqs=2)
    worker = svc.start_worker()
    # Long for the tiny model (0.5 s at 2 sequences on a quiet Zen 4): at 400 tokens a low
    # job could finish in the same store as the high one.
    low = svc.submit("low", job_bodies(6, tag="full", max_tokens=900, ignore_eos=True))
    svc.wait_for(
        "the worker to hold its bound in low jobs",
        lambda: svc.count_status(low, JobStatus.RUNNING) == 2,
        timeout=120,
    )
    running_low = [i for i, j in svc.jobs(low).items() if j.status == JobStatus.RUNNING]
    high = svc.submit("high", job_bodies(1, tag="urgent", max_tokens=4, ignore_eos=True))
    done = svc.wait_terminal(low + high)
    assert all(j.status == JobStatus.SUCCEEDED for j in done.values())
    high_job = done[high[0]]
    first_low_finish = min(done[i].finished_at for i in running_low)  # type: ignore[type-var]
    assert high_job.started_at is not None and first_low_finish is not None
    assert high_job.started_at < first_low_finish
    assert high_job.finished_at is not None and high_job.finished_at < first_low_finish
    assert worker.stop() == 0, worker.log_tail()
