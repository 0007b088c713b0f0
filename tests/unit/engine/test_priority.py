"""Priority scheduling, step by step: order, displacement, place in line, no ping-pong."""

from __future__ import annotations

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver, make_scheduler
from workers.engine.sequence import SequenceStatus


def test_admission_order_is_priority_then_arrival() -> None:
    """Lower priority value first; equal priorities in arrival order."""
    sched = make_scheduler(max_num_seqs=1)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    late_low = reqs.add(sched, [3], priority=5, max_tokens=1)
    first_high = reqs.add(sched, [4], priority=1, max_tokens=1)
    second_high = reqs.add(sched, [5], priority=1, max_tokens=1)
    order = [driver.step()[0].seqs[0] for _ in range(3)]
    assert order == [first_high, second_high, late_low]


def test_more_urgent_request_displaces_least_urgent_when_the_cap_is_full() -> None:
    """Cap 2 full of priority-5 work: a priority-0 arrival runs at the very next step."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=256)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    low_a = reqs.add(sched, [3, 4, 5], priority=5, max_tokens=30)
    low_b = reqs.add(sched, [6, 7, 8], priority=5, max_tokens=30)
    driver.step()
    driver.step()
    assert sched.running == [low_a, low_b]

    high = reqs.add(sched, [9, 10], priority=0, max_tokens=3)
    out, _ = driver.step()
    # Step 1 after arrival: the newest least urgent one leaves, the urgent one is admitted.
    assert out.preempted == [low_b]
    assert high in out.seqs and low_b not in out.seqs
    assert sorted(sched.running, key=id) == sorted([low_a, high], key=id)
    assert low_b.status is SequenceStatus.WAITING and low_b.block_table == []

    # A later equal-priority arrival queues behind the displaced one.
    low_c = reqs.add(sched, [11, 12], priority=5, max_tokens=2)
    assert sched.waiting == [low_b, low_c]
    while not high.is_finished:
        out, _ = driver.step()
        assert low_b not in out.seqs  # no bouncing back while the cap is taken
    out, _ = driver.step()
    assert low_b in out.seqs and low_c not in out.seqs  # original place in line
    driver.run()
    assert low_b.num_output_tokens == 30 and low_b.num_preemptions == 1
    assert low_a.num_preemptions == 0


def test_victim_is_the_least_urgent_not_merely_the_newest() -> None:
    """Among running priorities 1, 7 and 3, the priority-7 one is displaced."""
    sched = make_scheduler(max_num_seqs=3)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    p1 = reqs.add(sched, [3], priority=1, max_tokens=20)
    p7 = reqs.add(sched, [4], priority=7, max_tokens=20)
    p3 = reqs.add(sched, [5], priority=3, max_tokens=20)
    driver.step()
    reqs.add(sched, [6], priority=2, max_tokens=20)
    out, _ = driver.step()
    assert out.preempted == [p7]
    assert p1.status is p3.status is SequenceStatus.RUNNING


def test_equal_or_lower_priority_never_displaces() -> None:
    """A waiting request no more urgent than the running ones waits for a free seat."""
    sched = make_scheduler(max_num_seqs=2)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    running = [reqs.add(sched, [3 + i], priority=4, max_tokens=6) for i in range(2)]
    driver.step()
    same = reqs.add(sched, [9], priority=4, max_tokens=1)
    lower = reqs.add(sched, [10], priority=9, max_tokens=1)
    while any(not s.is_finished for s in running):
        out, _ = driver.step()
        assert not out.preempted
        assert same not in out.seqs and lower not in out.seqs
    driver.run()
    assert sched.num_preemptions == 0
    assert same.num_output_tokens == lower.num_output_tokens == 1


def test_more_urgent_request_displaces_when_the_kv_pool_is_full() -> None:
    """With seats free but no blocks, an urgent arrival still gets in at once."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    hog = reqs.add(sched, list(range(3, 31)), priority=5, max_tokens=4)  # 28 tokens: 7 blocks
    driver.step()
    urgent = reqs.add(sched, list(range(40, 48)), priority=0, max_tokens=2)  # 2 blocks
    out, _ = driver.step()
    assert out.preempted == [hog] and out.seqs == [urgent]
    driver.run()
    assert hog.num_output_tokens == 4 and urgent.num_output_tokens == 2


def test_no_displacement_when_it_could_not_free_enough_blocks() -> None:
    """Victims are not dropped for nothing: equal-priority holders keep the pool."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    peer = reqs.add(sched, list(range(3, 27)), priority=0, max_tokens=4)  # 6 blocks
    small_low = reqs.add(sched, [50, 51, 52], priority=5, max_tokens=4)  # 1 block
    driver.step()
    urgent = reqs.add(sched, list(range(60, 72)), priority=0, max_tokens=1)  # 3 blocks
    out, _ = driver.step()
    # Freeing small_low's one block leaves 2 < 3: it is not displaced; urgent waits.
    assert not out.preempted and urgent.status is SequenceStatus.WAITING
    assert small_low.status is SequenceStatus.RUNNING
    driver.run()
    assert peer.num_output_tokens == 4 and urgent.num_output_tokens == 1


def test_priority_displacement_does_not_ping_pong_over_many_steps() -> None:
    """A stream of urgent work displaces each low job at most once per urgent arrival."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=512)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = [reqs.add(sched, [3 + i, 4], priority=9, max_tokens=40) for i in range(2)]
    driver.step()
    urgent = []
    for k in range(3):
        urgent.append(reqs.add(sched, [20 + k], priority=0, max_tokens=2))
        for _ in range(4):
            driver.step()
    driver.run()
    assert sched.num_preemptions == 3
    assert sum(s.num_preemptions for s in lows) == 3
    assert all(u.num_preemptions == 0 for u in urgent)
    assert all(s.num_output_tokens == 40 for s in lows)
