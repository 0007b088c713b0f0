"""Scheduler: budgets, chunked prefill, preemption, stop conditions — no model needed."""

from __future__ import annotations

import random

import pytest

from tests.unit.engine.scheduler_driver import (
    EOS,
    Requests,
    SchedulerDriver,
    make_scheduler,
    synthetic_token,
)
from workers.engine.sampler import SampledToken
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence, SequenceStatus


@pytest.mark.parametrize(
    ("block_size", "chunked", "caching"),
    [(1, True, True), (4, True, False), (16, True, True), (4, False, True), (16, False, False)],
)
def test_randomized_run_keeps_invariants_on_every_step(
    block_size: int, chunked: bool, caching: bool
) -> None:
    """Random arrivals, priorities, shared prefixes and a small pool: every step is sound."""
    rng = random.Random(block_size * 10 + chunked * 2 + caching)
    sched = make_scheduler(
        num_blocks=-(-400 // block_size),
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=320,
        chunked=chunked,
        caching=caching,
        watermark=0.02,
    )
    driver = SchedulerDriver(sched)
    reqs = Requests()
    shared = [rng.randrange(3, 1000) for _ in range(64)]
    all_seqs: list[Sequence] = []
    for _ in range(4000):
        if len(all_seqs) < 60 and rng.random() < 0.3:
            n = rng.randint(1, 300)
            prompt = shared[: rng.randint(0, 64)] + [rng.randrange(3, 1000) for _ in range(n)]
            prompt = prompt[: rng.randint(1, 300)]
            seq = reqs.add(sched, prompt, priority=rng.randint(0, 3), max_tokens=rng.randint(1, 40))
            all_seqs.append(seq)
        if not sched.has_unfinished() and len(all_seqs) >= 60:
            break
        if sched.has_unfinished():
            driver.step()
    else:
        pytest.fail("not finished after 4000 steps")
    assert sched.num_preemptions > 0, "the pool was meant to force preemptions"
    for seq in all_seqs:
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert seq.num_output_tokens == seq.params.max_tokens
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


def test_outputs_do_not_depend_on_preemption() -> None:
    """Preempted sequences recompute and continue exactly where they were."""
    tight, roomy = make_scheduler(num_blocks=12), make_scheduler(num_blocks=200)
    results = []
    for sched in (tight, roomy):
        reqs = Requests()
        seqs = [reqs.add(sched, [5 + i] * 9, max_tokens=12) for i in range(5)]
        SchedulerDriver(sched).run()
        results.append([s.output_token_ids for s in seqs])
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert results[0] == results[1]
    expected_first = [synthetic_token(Sequence("req-0", [], SamplingParams()))]
    assert results[0][0][:1] == expected_first


def test_chunked_prefill_splits_long_prompts_and_mixes_with_decode() -> None:
    """A 100-token prompt under a 32-token budget runs as 31+32+32+5 beside a decode."""
    sched = make_scheduler(max_num_batched_tokens=32)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    short = reqs.add(sched, [7, 8], max_tokens=10)
    driver.step()  # short's prefill; it now decodes one token per step
    long = reqs.add(sched, list(range(3, 103)), max_tokens=2)
    chunks = []
    while long.num_output_tokens == 0:
        out, updated = driver.step()
        assert out.seqs[0] is short and out.num_scheduled_tokens[0] == 1
        chunks.append(out.num_scheduled_tokens[1])
        assert (long in updated) == (sum(chunks) == 100)
    assert chunks == [31, 31, 31, 7]


def test_chunked_prefill_off_runs_each_prompt_whole() -> None:
    """Without chunking a prompt waits until the whole of it fits one step's budget."""
    sched = make_scheduler(max_num_batched_tokens=40, chunked=False)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = reqs.add(sched, list(range(3, 33)), max_tokens=5)  # 30 tokens
    b = reqs.add(sched, list(range(100, 120)), max_tokens=5)  # 20 tokens: 30 + 20 > 40
    out, _ = driver.step()
    assert out.seqs == [a] and out.num_scheduled_tokens == [30]
    out, _ = driver.step()
    assert out.seqs == [a, b] and out.num_scheduled_tokens == [1, 20]
    with pytest.raises(ValueError, match="prompt"):
        reqs.add(sched, list(range(3, 50)), max_tokens=1)


def test_out_of_blocks_preempts_least_urgent_newest_which_keeps_its_place() -> None:
    """Growth beyond the pool recompute-preempts the least urgent, newest sequence."""
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    urgent = reqs.add(sched, [3, 4, 5], priority=0, max_tokens=8)
    older = reqs.add(sched, [6, 7, 8], priority=1, max_tokens=8)
    newer = reqs.add(sched, [9, 10, 11], priority=1, max_tokens=8)
    driver.step()  # all three: 2 blocks each, pool full
    assert sched.block_manager.num_free_blocks == 0
    driver.step()  # position 3 fits the second block of each
    out, _ = driver.step()  # position 4 needs a third block each: preempt newest low-priority
    assert out.preempted[0] is newer and newer.status is SequenceStatus.WAITING
    late = reqs.add(sched, [12], priority=1, max_tokens=1)
    assert sched.waiting == [newer, late]  # original place in line, ahead of later arrivals
    assert urgent.num_preemptions == 0
    driver.run()
    assert urgent.num_output_tokens == older.num_output_tokens == newer.num_output_tokens == 8


def test_equal_priorities_never_ping_pong() -> None:
    """Among equals only the newest is ever preempted; older ones run undisturbed."""
    sched = make_scheduler(num_blocks=10, block_size=2, max_num_batched_tokens=64)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    seqs = [reqs.add(sched, [3 + i, 4, 5, 6], max_tokens=12) for i in range(3)]
    driver.run()
    assert sched.num_preemptions > 0
    assert seqs[0].num_preemptions == 0
    # Each preemption of a newer sequence never flipped back onto an older one.
    assert seqs[1].num_preemptions <= seqs[2].num_preemptions or seqs[2].num_preemptions == 0
    for out in driver.outputs:
        assert seqs[0] not in out.preempted


def test_watermark_holds_back_admission_but_not_a_lone_request() -> None:
    """New work may not take the last free blocks while others run; alone it may."""
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)  # keep 2 free
    driver = SchedulerDriver(sched)
    reqs = Requests()
    first = reqs.add(sched, list(range(3, 35)), max_tokens=2)  # 32 tokens: 8 blocks
    out, _ = driver.step()
    assert out.seqs == [first]
    second = reqs.add(sched, [3, 4, 5], max_tokens=1)  # 1 block would leave 1 < 2 free
    out, _ = driver.step()
    assert out.seqs == [first] and second.status is SequenceStatus.WAITING
    driver.run()
    assert second.num_output_tokens == 1


def test_stop_conditions() -> None:
    """eos (unless ignored), stop token ids, max_tokens and max_model_len end a sequence."""
    sched = make_scheduler(max_model_len=6)
    reqs = Requests()
    eos = reqs.add(sched, [3], ignore_eos=False, max_tokens=5)
    ignored = reqs.add(sched, [4], ignore_eos=True, max_tokens=5)
    stop_id = reqs.add(sched, [5], stop_token_ids=[77], max_tokens=5)
    length = reqs.add(sched, [6], max_tokens=1)
    model_len = reqs.add(sched, [7, 8, 9, 10], max_tokens=5)
    out = sched.schedule()
    tokens = {eos: EOS, ignored: EOS, stop_id: 77, length: 9, model_len: 9}
    updated = sched.postprocess(out, [SampledToken(tokens[s], None) for s in out.seqs])
    assert len(updated) == 5
    assert eos.finish_reason == "stop" and stop_id.finish_reason == "stop"
    assert length.finish_reason == "length" and ignored.finish_reason is None
    assert model_len.finish_reason is None
    out = sched.schedule()
    sched.postprocess(out, [SampledToken(9, None) for _ in out.seqs])
    assert model_len.finish_reason == "length" and model_len.num_tokens == 6
    assert ignored.num_output_tokens == 2 and not ignored.is_finished


def test_finish_frees_running_and_waiting_sequences() -> None:
    """Aborting wherever a sequence is leaves no blocks held and nothing queued."""
    sched = make_scheduler(max_num_seqs=1)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    running = reqs.add(sched, list(range(3, 20)), max_tokens=50)
    waiting = reqs.add(sched, [3, 4], max_tokens=5)
    driver.step()
    assert running.status is SequenceStatus.RUNNING and running.block_table
    sched.finish(running, SequenceStatus.FINISHED_ABORTED)
    sched.finish(waiting, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_add_rejects_what_could_never_run() -> None:
    """A prompt or a prompt plus max_tokens beyond the whole pool is refused up front."""
    sched = make_scheduler(num_blocks=4, block_size=4)  # 16 positions
    reqs = Requests()
    with pytest.raises(ValueError, match="prompt"):
        reqs.add(sched, list(range(3, 20)), max_tokens=1)  # 17 tokens
    with pytest.raises(ValueError, match="max_tokens"):
        reqs.add(sched, list(range(3, 13)), max_tokens=8)  # 10 + 8 - 1 = 17 positions
    reqs.add(sched, list(range(3, 13)), max_tokens=7)  # 16 positions: fits exactly
    assert len(sched.waiting) == 1


def test_sequences_arriving_together_share_a_prefix_being_computed() -> None:
    """The second of two same-prefix requests waits one step and reuses the first's blocks."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=256)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    prefix = list(range(3, 35))  # 32 tokens = 8 blocks
    a = reqs.add(sched, [*prefix, 900], max_tokens=3)
    b = reqs.add(sched, [*prefix, 901], max_tokens=3)
    out, _ = driver.step()
    assert out.seqs == [a]
    out, _ = driver.step()
    assert out.seqs == [a, b] and out.num_scheduled_tokens == [1, 1]
    assert b.num_cached_tokens == 32 and sched.num_prefix_cache_hit_tokens == 32
    driver.run()
