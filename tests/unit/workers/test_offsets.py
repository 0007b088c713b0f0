"""Offset tracker: commit only up to the lowest offset not yet persisted."""

from __future__ import annotations

import random

from kafka import TopicPartition

from workers.inference.offsets import OffsetTracker, PartitionOffsets

TP = TopicPartition("t.jobs.high", 0)
OTHER = TopicPartition("t.jobs.low", 1)


def tracker_with(*tps: TopicPartition) -> OffsetTracker:
    tracker = OffsetTracker()
    tracker.assign(set(tps))
    return tracker


def test_worked_example_34_35_36_40_commits_37() -> None:
    tracker = tracker_with(TP)
    for offset in range(34, 41):
        tracker.track(TP, offset)
    for offset in (34, 35, 36, 40):
        tracker.ack(TP, offset)
    assert tracker.committable() == {TP: 37}


def test_nothing_committable_until_the_first_offset_is_acked() -> None:
    tracker = tracker_with(TP)
    for offset in (10, 11, 12):
        tracker.track(TP, offset)
    tracker.ack(TP, 12)
    tracker.ack(TP, 11)
    assert tracker.committable() == {TP: 10}  # commit point equals the start: no progress
    tracker.mark_committed({TP: 10})
    assert tracker.committable() == {}
    tracker.ack(TP, 10)
    assert tracker.committable() == {TP: 13}


def test_all_acked_commits_past_the_highest_seen() -> None:
    tracker = tracker_with(TP)
    for offset in (5, 6, 7):
        tracker.track(TP, offset)
        tracker.ack(TP, offset)
    assert tracker.committable() == {TP: 8}


def test_log_holes_do_not_stall_the_commit_point() -> None:
    # Offsets 3 and 4 do not exist in the log (compaction, transaction markers): never
    # received, so never pending.
    tracker = tracker_with(TP)
    for offset in (1, 2, 5, 6):
        tracker.track(TP, offset)
    for offset in (1, 2, 5):
        tracker.ack(TP, offset)
    assert tracker.committable() == {TP: 6}
    tracker.ack(TP, 6)
    assert tracker.committable() == {TP: 7}


def test_committed_points_are_not_repeated() -> None:
    tracker = tracker_with(TP)
    tracker.track(TP, 0)
    tracker.ack(TP, 0)
    tracker.mark_committed(tracker.committable())
    assert tracker.committable() == {}
    tracker.track(TP, 1)
    assert tracker.committable() == {}  # 1 pending: the point is still 1
    tracker.ack(TP, 1)
    assert tracker.committable() == {TP: 2}


def test_partitions_are_independent_and_filterable() -> None:
    tracker = tracker_with(TP, OTHER)
    tracker.track(TP, 0)
    tracker.track(OTHER, 100)
    tracker.ack(OTHER, 100)
    assert tracker.committable() == {TP: 0, OTHER: 101}
    assert tracker.committable({OTHER}) == {OTHER: 101}
    assert tracker.num_pending() == 1


def test_revoked_partitions_ignore_late_acks_and_records() -> None:
    tracker = tracker_with(TP, OTHER)
    tracker.track(TP, 7)
    tracker.revoke({TP})
    assert not tracker.owns(TP)
    tracker.ack(TP, 7)
    tracker.track(TP, 8)
    assert TP not in tracker.committable()
    tracker.assign({TP})
    assert tracker.committable() == {}  # a fresh start after reassignment


def test_redelivery_below_the_committed_point_is_ignored() -> None:
    partition = PartitionOffsets()
    partition.track(3)
    partition.ack(3)
    partition.committed = 4
    partition.track(2)
    assert partition.pending == set()
    assert partition.commit_point == 4


def test_unknown_acks_are_ignored() -> None:
    tracker = tracker_with(TP)
    tracker.track(TP, 1)
    tracker.ack(TP, 99)
    assert tracker.committable() == {TP: 1}


def test_commit_point_is_the_lowest_pending_offset_through_any_order_of_tracks_and_acks() -> None:
    # Against the definition (min of the pending set), over random interleavings that
    # include acks out of order, repeated acks and offsets tracked again after their ack.
    rng = random.Random(7)
    for _ in range(50):
        offsets, pending = PartitionOffsets(), set()
        for _ in range(300):
            offset = rng.randrange(200)
            if rng.random() < 0.5:
                offsets.track(offset)
                pending.add(offset)
            else:
                offsets.ack(offset)
                pending.discard(offset)
            expected = min(pending) if pending else (
                None if offsets.highest_seen is None else offsets.highest_seen + 1)
            assert offsets.commit_point == expected
