"""Records kafka-python parked for a paused partition, released once it may be fetched again.

Why this exists: kafka-python 3.0.12 (the newest release) can stop fetching a partition
for good after a pause and resume, while the partition holds records. A worker whose
partitions stall this way sits idle with a backlog; its committed offsets stop
mid-partition and a fresh consumer gets the records at once.

How it happens. The fetcher hands out one partition's parsed records at a time from an
in-line slot (`_next_partition_records`). When that partition is paused mid-way (the
worker pauses a partition whose prefetch is full, and lower priorities while a higher one
has a backlog), its remaining records are parked in `_paused_partition_records`, and the
partition is left out of every fetch request while they are parked. After a resume the
fetcher restores parked records only into an *empty* slot, and only when the slot is
`None`: once it has handed out a batch the slot keeps the exhausted batch (falsy, not
`None`) until something else is parked. Worked example, one topic with partitions 0 and 1,
`max_poll_records=100`, 300 records each:

    poll                → 100 of p0; p0's other 200 wait in the slot
    pause(p0), poll     → p0's 200 parked; 100 of p1; p1's other 200 in the slot
    pause(p1), poll     → p1's 200 parked; slot None; parked {p0, p1}
    resume(p0, p1), poll→ p0's parked records move into the slot; p1 stays parked
    ... p0 drains       → the slot keeps p0's exhausted batch; p1 is never restored,
                          and never fetched again: 200 records stuck behind offset 100.

The fix: before every poll, parked records of a partition that may be fetched again (not
paused, or no longer assigned) are dropped. They were never returned, so the partition's
position still points at the first of them, and the next fetch reads them again from the
broker: nothing is lost, at the cost of one re-fetch. Raw (unparsed) parked fetches are
left alone: the fetcher restores those correctly.
"""

from __future__ import annotations

import logging

from kafka import KafkaConsumer, TopicPartition

logger = logging.getLogger(__name__)


def release_parked_records(
    consumer: KafkaConsumer, partitions: set[TopicPartition] | None = None
) -> set[TopicPartition]:
    """Drop parked records of fetchable partitions (or of `partitions`); the ones dropped.

    With `partitions` given, their parked records are dropped whether paused or not (the
    caller is about to seek them). Safe to call before every poll: it only looks at a
    dictionary when nothing is parked.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    parked: dict[TopicPartition, object] | None = getattr(
        fetcher, "_paused_partition_records", None
    )
    if not parked:
        return set()
    if partitions is None:
        paused = consumer.paused()
        assigned = consumer.assignment()
        released = {tp for tp in parked if tp not in paused or tp not in assigned}
    else:
        released = set(parked) & partitions
    for tp in released:
        records = parked.pop(tp)
        drain = getattr(records, "drain", None)
        if drain is not None:
            drain()  # its sensors count it as consumed and it releases its memory
    if released:
        logger.debug("released parked records of %s", sorted(f"{tp.topic}/{tp.partition}"
                                                              for tp in released))
    return released
