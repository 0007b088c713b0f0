"""Which partitions to pause so that higher-priority topics are drained first.

Responsible for the decision only; the worker applies it with `consumer.pause/resume`
after every poll and after every rebalance (a rebalance forgets pauses, so an assignment
always starts unpaused and must be re-decided).

Rules, in order:
1. The worker is full (in-flight jobs at the bound): pause everything. Polls continue,
   keeping the group membership alive, but fetch nothing.
2. Otherwise find the most urgent priority with a backlog on an assigned partition;
   pause every partition of a strictly lower priority. Partitions of that priority and
   above stay fetchable, so new urgent work is seen at once.
3. No backlog anywhere (or backlog unknown): pause nothing, whatever arrives is taken.

Example: assigned high/0, normal/0, low/0 with backlogs 3, 0, 500 → pause normal/0 and
low/0; once high/0's backlog is 0 the most urgent backlog is low's, nothing is paused.
"""

from __future__ import annotations

from collections.abc import Mapping

from kafka import TopicPartition


def partitions_to_pause(
    assigned: set[TopicPartition],
    backlog: Mapping[TopicPartition, int | None],
    topic_rank: Mapping[str, int],
    *,
    is_full: bool,
) -> set[TopicPartition]:
    """The partitions to keep paused now (see the module docstring for the rules).

    `backlog` maps a partition to its unread record count (None: not known yet);
    `topic_rank` maps a topic to its priority rank (0 is most urgent).
    """
    if is_full:
        return set(assigned)
    ranks_with_backlog = [
        topic_rank[tp.topic]
        for tp in assigned
        if tp.topic in topic_rank and (backlog.get(tp) or 0) > 0
    ]
    if not ranks_with_backlog:
        return set()
    most_urgent = min(ranks_with_backlog)
    return {tp for tp in assigned if topic_rank.get(tp.topic, most_urgent) > most_urgent}
