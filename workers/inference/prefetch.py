"""Records polled from Kafka and not yet started, handed out most urgent first and, within
a priority, shared between tenants by weight.

Why a buffer: the consumer's fetcher hands back one partition's fetched records before it
looks at the next partition's response, so a worker that polled only as many records as
it had room for would drain a whole low-priority fetch before it even saw a high-priority
record that arrived meanwhile. Polling everything that is fetched into this buffer and
starting jobs from it in priority order keeps urgent work first; per-partition limits
(applied as pauses, see `priority`) keep it small.

Fair share: within a priority, each tenant with records here has its own FIFO queue, and
records leave by deficit round robin over those queues (each job costs 1; a tenant's turn
adds its weight to its deficit, so weights 2 and 1 start jobs 2:1 while both have work).
A tenant alone gets every start; a tenant's huge batch cannot hold another tenant's jobs
back behind it once both are here. The worker passes over a tenant that holds its share
of the in-flight bound already (see intake), so the others' records start at once. What
reaches the buffer is bounded per partition, so the batch fan-out keeps each batch's
queued lines in the topics to a window (`batch_max_queued_lines`): another tenant's job
is never behind more than that window.

A buffered record is tracked as pending by the offset tracker, so the commit point never
passes it: dropping the buffer (on rebalance or shutdown) only means Kafka redelivers it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from kafka import TopicPartition

RecordT = TypeVar("RecordT")

# The smallest weight a tenant's turn adds: a weight near 0 would spin the round.
MIN_WEIGHT = 0.01


class _TenantQueues(Generic[RecordT]):
    """One priority's records: a FIFO per tenant, served by deficit round robin."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[TopicPartition, RecordT]]] = {}
        self.ring: deque[str] = deque()  # tenants with records, the one to serve first
        self.deficit: dict[str, float] = {}
        self.is_head_credited = False  # the head tenant's turn has added its weight

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def add(self, tenant: str, item: tuple[TopicPartition, RecordT]) -> None:
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = deque()
            self.ring.append(tenant)
            self.deficit[tenant] = 0.0
        queue.append(item)

    def pop(self, weight_of: Callable[[str], float],
            may_start: Callable[[str], bool] | None = None
            ) -> tuple[TopicPartition, RecordT] | None:
        num_passed = 0  # tenants passed over in a row because they may not start now
        while True:
            tenant = self.ring[0]
            if may_start is not None and not may_start(tenant):
                num_passed += 1
                if num_passed >= len(self.ring):
                    return None  # nobody here may start now
                self.ring.rotate(-1)  # its turn is passed over, its credit kept
                self.is_head_credited = False
                continue
            num_passed = 0
            if not self.is_head_credited:
                self.deficit[tenant] += max(MIN_WEIGHT, weight_of(tenant))
                self.is_head_credited = True
            if self.deficit[tenant] >= 1:
                self.deficit[tenant] -= 1
                queue = self.queues[tenant]
                item = queue.popleft()
                if not queue:  # an idle tenant keeps no credit (DRR)
                    self._forget(tenant)
                return item
            self.ring.rotate(-1)  # its turn is over: the next tenant's begins
            self.is_head_credited = False

    def drop(self, partitions: set[TopicPartition]) -> int:
        dropped = 0
        for tenant in list(self.queues):
            queue = self.queues[tenant]
            kept = [(tp, record) for tp, record in queue if tp not in partitions]
            dropped += len(queue) - len(kept)
            queue.clear()
            queue.extend(kept)
            if not queue:
                self._forget(tenant)
        return dropped

    def clear(self) -> None:
        self.is_head_credited = False
        self.queues.clear()
        self.ring.clear()
        self.deficit.clear()

    def _forget(self, tenant: str) -> None:
        if self.ring[0] == tenant:
            self.is_head_credited = False
        del self.queues[tenant]
        del self.deficit[tenant]
        self.ring.remove(tenant)


class PrefetchBuffer(Generic[RecordT]):
    """Per priority rank, per tenant FIFO queues of (partition, record)."""

    def __init__(self, topic_rank: Mapping[str, int], *,
                 tenant_of: Callable[[RecordT], str] | None = None,
                 weight_of: Callable[[str], float] | None = None) -> None:
        self._topic_rank = dict(topic_rank)
        num_ranks = max(self._topic_rank.values(), default=0) + 1
        self._ranks: list[_TenantQueues[RecordT]] = [_TenantQueues() for _ in range(num_ranks)]
        self._tenant_of = tenant_of or (lambda _record: "")
        self._weight_of = weight_of or (lambda _tenant: 1.0)
        self._counts: Counter[TopicPartition] = Counter()

    def __len__(self) -> int:
        return sum(self._counts.values())

    def add(self, tp: TopicPartition, record: RecordT) -> None:
        """Queue a record behind the others of its priority and tenant."""
        rank = self._topic_rank.get(tp.topic, len(self._ranks) - 1)
        self._ranks[rank].add(self._tenant_of(record), (tp, record))
        self._counts[tp] += 1

    def most_urgent_rank(self) -> int | None:
        """The priority rank `pop_most_urgent` would take from, or None if empty."""
        return next((rank for rank, queues in enumerate(self._ranks) if queues.ring), None)

    def tenants_waiting(self, rank: int) -> set[str]:
        """The tenants with records of this priority rank here."""
        return set(self._ranks[rank].queues) if rank < len(self._ranks) else set()

    def pop_most_urgent(self, may_start: Callable[[str], bool] | None = None
                        ) -> tuple[TopicPartition, RecordT] | None:
        """The next record of the most urgent non-empty priority (its tenants' turn by
        weight, each tenant's oldest first), or None if empty. With `may_start`, tenants
        for whom it is False are passed over (their turn comes again later); None when
        none of that priority's tenants may start."""
        rank = self.most_urgent_rank()
        if rank is None:
            return None
        item = self._ranks[rank].pop(self._weight_of, may_start)
        if item is None:
            return None
        tp, record = item
        self._counts[tp] -= 1
        if not self._counts[tp]:
            del self._counts[tp]
        return tp, record

    def counts(self) -> dict[TopicPartition, int]:
        """Partition → records it has waiting here."""
        return dict(self._counts)

    def drop(self, partitions: set[TopicPartition]) -> int:
        """Drop the records of these partitions (Kafka redelivers them); how many."""
        dropped = sum(queues.drop(partitions) for queues in self._ranks)
        for tp in partitions:
            self._counts.pop(tp, None)
        return dropped

    def clear(self) -> int:
        """Drop everything (Kafka redelivers it); how many records were dropped."""
        dropped = len(self)
        for queues in self._ranks:
            queues.clear()
        self._counts.clear()
        return dropped
