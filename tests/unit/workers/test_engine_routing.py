"""Routing across engine servers (rendezvous hashing) and the back-off of a failing one."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from core.messages import JobMessage
from workers.inference.engine_routing import (
    MAX_RETRY_AFTER_S,
    ServerState,
    backoff_s,
    parse_retry_after,
    pick_server,
)

URLS = [f"http://engine-{i}:8000/v1" for i in range(4)]


def servers(urls: list[str] = URLS) -> list[ServerState]:
    return [ServerState(url, max_concurrency=8) for url in urls]


def keys(n: int) -> list[bytes]:
    return [JobMessage(job_id=f"j{i}", tenant_id="t", priority="normal", model="m",
                       kind="chat.completion",
                       body={"messages": [{"role": "user", "content": f"prompt {i}"}]}
                       ).affinity_key() for i in range(n)]


def owner(key: bytes, fleet: list[ServerState], now: float = 0.0) -> str:
    server = pick_server(key, fleet, now)
    assert server is not None
    return server.url


def test_a_key_always_goes_to_the_same_server_and_keys_spread_over_all() -> None:
    fleet = servers()
    placed = {key: owner(key, fleet) for key in keys(400)}
    assert placed == {key: owner(key, servers()) for key in placed}  # stable across processes
    counts = Counter(placed.values())
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 400 / len(URLS) / 2  # roughly even


def test_the_order_servers_are_listed_in_does_not_matter() -> None:
    for key in keys(50):
        assert owner(key, servers()) == owner(key, servers(list(reversed(URLS))))


def test_a_server_going_away_moves_only_its_own_keys() -> None:
    before = {key: owner(key, servers()) for key in keys(400)}
    after = {key: owner(key, servers(URLS[:3])) for key in before}
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key in before if before[key] == URLS[3]}
    assert moved  # the removed server held some


def test_a_server_backing_off_is_skipped_and_gets_its_keys_back() -> None:
    fleet = servers()
    before = {key: owner(key, fleet) for key in keys(200)}
    fleet[1].failed(5.0, now=100.0)
    during = {key: owner(key, fleet, now=101.0) for key in before}
    assert URLS[1] not in during.values()
    assert all(during[k] == before[k] for k in before if before[k] != URLS[1])
    # ... each of its keys to the server a fleet without it would pick
    assert during == {key: owner(key, servers([u for u in URLS if u != URLS[1]]))
                      for key in before}
    assert {key: owner(key, fleet, now=105.0) for key in before} == before


def test_no_server_when_every_one_is_backing_off() -> None:
    fleet = servers(URLS[:2])
    for server in fleet:
        server.failed(1.0, now=0.0)
    assert pick_server(b"k", fleet, 0.5) is None
    assert pick_server(b"k", fleet, 1.0) is not None


def test_backoff_doubles_per_failure_within_its_jitter_up_to_the_cap() -> None:
    rng = random.Random(7)
    for num_failures, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (10, 30.0)]:
        draws = [backoff_s(num_failures, base_s=0.5, max_s=30.0, rng=rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in draws)
        assert max(draws) - min(draws) > ceiling / 4  # jittered, not one fixed delay


def test_retry_after_is_honoured_instead_of_the_exponential_delay() -> None:
    assert backoff_s(1, base_s=0.5, max_s=30.0, retry_after_s=7.0) == 7.0
    assert backoff_s(9, base_s=0.5, max_s=30.0, retry_after_s=0.0) == 0.0
    assert backoff_s(1, base_s=0.5, max_s=30.0, retry_after_s=1e9) == MAX_RETRY_AFTER_S


def test_a_failure_in_a_row_counts_and_a_success_resets_it() -> None:
    server = ServerState(URLS[0], max_concurrency=1)
    server.failed(2.0, now=10.0)
    server.failed(1.0, now=10.5)  # a shorter back-off never cuts a longer one short
    assert server.num_failures == 2 and server.down_until == 12.0
    server.succeeded()
    assert server.num_failures == 0


@pytest.mark.parametrize(("header", "seconds"), [
    ("3", 3.0), (" 0.5 ", 0.5), ("-4", 0.0), (None, None), ("", None), ("soon", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 12.0),
])
def test_retry_after_header(header: str | None, seconds: float | None) -> None:
    # 2015-10-21 07:27:48 UTC: twelve seconds before the date above.
    assert parse_retry_after(header, now_epoch=1445412468.0) == seconds
