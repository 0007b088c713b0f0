"""The prefix KV tier in real Redis: budget and TTL, tenant isolation, outages, and a
worker that loads a prefix another worker computed, seen through `GET /v1/cache/stats`."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from scheduler.embedded_services import free_port
from storage.cache_stats import read_cache_stats
from tests.utils.api import make_tenant_key
from tests.utils.service import running_api
from tests.utils.worker_service import Service
from workers.engine import LLM, SamplingParams
from workers.inference.kv_tier import RedisKVTier

BLOCK = 16


def make_tier(url: str, namespace: str, **overrides: Any) -> RedisKVTier:
    """A tier on its own namespace, with short client timeouts."""
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    values: dict[str, Any] = {"prefix": namespace, "model": "tiny", "revision": "r1",
                              "ttl_s": 600, "max_bytes": 1 << 30}  # fmt: skip
    values.update(overrides)
    return RedisKVTier(client, **values)


def make_llm(model_dir: Path) -> LLM:
    """A CPU fp32 engine on the tiny model, 16-token blocks."""
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK,
               num_kv_blocks=128, skip_tokenizer_init=True)  # fmt: skip


def greedy(salt: str) -> SamplingParams:
    """Six greedy tokens, chained from `salt`."""
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)


def test_budget_evicts_oldest_and_blocks_carry_the_ttl(redis_url: str) -> None:
    """25 bytes of budget hold two 10-byte blocks; the first stored goes, counted once."""
    tier = make_tier(redis_url, f"t{random.getrandbits(40):x}", ttl_s=60, max_bytes=25)
    tier.store([(b"a", b"x" * 10), (b"b", b"y" * 10)])
    tier.store([(b"b", b"y" * 10), (b"c", b"z" * 10)])  # b again: refreshed, not re-counted
    tier.wait_written()
    assert tier.load([b"b", b"c"]) == [b"y" * 10, b"z" * 10]
    assert tier.load([b"a", b"b"]) == [None, None]  # only the leading run counts as hits
    stats = tier.snapshot()
    assert (stats.num_hits, stats.num_misses, stats.num_evictions) == (2, 2, 1)
    assert stats.num_stored_bytes == 30 and tier.resident_bytes() == 20
    assert 0 < tier.client.ttl(tier.block_key(b"c")) <= 60
    assert tier.client.exists(tier.block_key(b"a")) == 0  # deleted once evicted
    tier.close()
    with pytest.raises(ValueError, match="kv_tier_max_bytes"):
        make_tier(redis_url, "x", max_bytes=0)


def test_a_block_stored_again_before_its_eviction_is_deleted_stays(redis_url: str) -> None:
    """The store script evicts (off the books), another store brings the block back before
    the delete script runs: it stays, counted once."""
    tier = make_tier(redis_url, f"t{random.getrandbits(40):x}", max_bytes=15)
    a, b = tier.block_key(b"a"), tier.block_key(b"b")
    now = time.time()
    _, evicted = tier._store_script(keys=[*tier._keys, a, b], args=[now, 60, 15, b"x" * 10,
                                                                   b"y" * 10])
    assert evicted == [a.encode()] and tier.resident_bytes() == 10
    tier._store_script(keys=[*tier._keys, a], args=[now + 1, 60, 25, b"x" * 10])
    assert tier._delete_script(keys=[tier._keys[0], a]) == 0
    assert tier.load([b"a", b"b"]) == [b"x" * 10, b"y" * 10]
    assert tier.resident_bytes() == 20
    tier.close()


def test_tenants_never_read_each_others_kv(redis_url: str, tiny_model: Path) -> None:
    """Same prompt, two tenants: B misses A's blocks in Redis; A on a cold engine hits them,
    and its greedy output equals an engine's without any tier."""
    namespace = f"t{random.getrandbits(40):x}"
    rng = random.Random(4)
    prompt = [rng.randrange(3, 300) for _ in range(5 * BLOCK + 2)]
    reference = make_llm(tiny_model).generate([prompt], greedy("a"))[0]
    writer, tier_a = make_llm(tiny_model), make_tier(redis_url, namespace)
    writer.engine.attach_kv_tier(tier_a, write_through=True)
    writer.generate([prompt], greedy("a"))
    tier_a.wait_written()
    tier_b = make_tier(redis_url, namespace)
    b = make_llm(tiny_model)
    link_b = b.engine.attach_kv_tier(tier_b)
    theirs = b.generate([prompt], greedy("b"))[0]
    assert theirs.num_cached_tokens == 0 and link_b.counters.num_loaded_blocks == 0
    assert tier_b.snapshot().num_misses == 5
    a = make_llm(tiny_model)
    link_a = a.engine.attach_kv_tier(make_tier(redis_url, namespace))
    ours = a.generate([prompt], greedy("a"))[0]
    assert ours.num_cached_tokens == 5 * BLOCK and link_a.counters.num_loaded_blocks == 5
    assert ours.token_ids == reference.token_ids


def test_redis_down_bypasses_the_tier(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens: a warning, an error counted, and the prompt computed as usual."""
    before = REGISTRY.get_sample_value("batchinfer_kv_tier_errors_total") or 0.0
    tier = make_tier(f"redis://127.0.0.1:{free_port()}/0", "down")
    llm = make_llm(tiny_model)
    llm.engine.attach_kv_tier(tier, write_through=True)
    prompt = list(range(3, 3 + 3 * BLOCK + 1))
    with caplog.at_level(logging.WARNING, logger="workers.inference.kv_tier"):
        got = llm.generate([prompt, prompt[:-1] + [7]], greedy("a"))
    plain = make_llm(tiny_model).generate([prompt, prompt[:-1] + [7]], greedy("a"))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert tier.snapshot().num_errors >= 1
    assert (REGISTRY.get_sample_value("batchinfer_kv_tier_errors_total") or 0.0) > before
    assert any("bypassing Redis" in r.getMessage() for r in caplog.records)


def test_a_new_worker_loads_a_prefix_another_worker_computed(service) -> None:
    """Worker 1 reuses a long prefix (so it goes to Redis) and stops; worker 2, cold, loads
    it: same greedy text, and kv hits in GET /v1/cache/stats. The exact-result cache keeps
    nothing (ttl 0), so the repeated job reaches the engine; `cache.mode: "off"` would
    bypass the KV tier as well."""
    svc = service(kv_tier_enabled=True, cache_stats_interval_s=0.5, result_cache_ttl_s=0)
    system = "You answer in one word. " * 12

    def body(question: str) -> dict[str, Any]:
        return {"prompt": system + question, "max_tokens": 6, "temperature": 0}

    tokenizer = AutoTokenizer.from_pretrained(svc.settings.model)
    q1, q2 = (tokenizer(system + q).input_ids for q in ("Q1?", "Q2?"))
    num_shared = next(i for i, (a, b) in enumerate(zip(q1, q2, strict=False)) if a != b)
    # Blocks worker 1 shared (and so offloaded) and worker 2 can use (its last token runs).
    num_blocks = min(num_shared // BLOCK, (len(q2) - 1) // BLOCK)
    assert num_blocks >= 10
    first = svc.start_worker()
    texts_1 = [j.result["choices"][0]["text"]
               for j in svc.run_succeeded([body("Q1?"), body("Q2?")])]
    first.stop()
    svc.start_worker()
    (again,) = svc.run_succeeded([body("Q2?")])
    assert again.result["choices"][0]["text"] == texts_1[1]
    key = make_tenant_key(svc.sessions, "stats-reader")
    # Every worker's counters are a service-wide view: an admin tenant's.
    admin = svc.settings.model_copy(update={"admin_tenants": ["stats-reader"]})
    with running_api(admin) as url, httpx.Client(base_url=url, headers=key.headers,
                                                        timeout=30) as client:  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            stats = client.get("/v1/cache/stats").json()
            kv = stats["totals"]["kv"]
            if kv["hits"] >= num_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert kv["hits"] == num_blocks, stats
    assert kv["loaded_bytes"] > 0 and kv["resident_bytes"] > 0
    assert stats["semantic_backend"] == "exact"  # the test Redis has no vector search
    (worker,) = [w for w in stats["workers"] if w["caches"]["kv"]["hits"]]
    assert worker["caches"]["kv"]["hit_rate"] > 0
    assert set(stats["totals"]) == {"exact", "semantic", "kv"}


def test_a_worker_never_serves_one_tenants_prefix_to_another(service) -> None:
    """Tenant B's job with tenant A's long prompt computes it all (pool and tier miss);
    A's next job with it finds it cached (the exact-result cache keeps nothing: ttl 0)."""
    svc = service(kv_tier_enabled=True, kv_tier_write_through=True, result_cache_ttl_s=0)
    prompt = "A long shared instruction for isolation. " * 8
    svc.start_worker()
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    (first,) = svc.run_succeeded([body])
    tenant_a = svc.tenant_id
    svc.tenant_id = make_tenant_key(svc.sessions, "other-tenant").tenant_id
    (theirs,) = svc.run_succeeded([body])
    svc.tenant_id = tenant_a
    (ours,) = svc.run_succeeded([body])
    assert first.cached_tokens == 0 and theirs.cached_tokens == 0
    assert ours.cached_tokens >= BLOCK
    assert theirs.result["choices"][0]["text"] == ours.result["choices"][0]["text"]


def _num_tier_blocks(svc: Service) -> int:
    client = redis.Redis.from_url(svc.settings.redis_url)
    return sum(1 for _ in client.scan_iter(match=f"{svc.settings.topic_prefix}:kv:*:b:*"))


def _kv_lookups_published_after(svc: Service, worker_id: str | None, since: float,
                                timeout: float = 30.0) -> int:
    """The worker's tier lookups (hits + misses) in the first counters it publishes after
    `since` (a wall-clock time, as the publisher stamps them)."""
    assert worker_id is not None
    client = redis.Redis.from_url(svc.settings.redis_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            entry = read_cache_stats(client, prefix=svc.settings.topic_prefix).get(worker_id)
            if entry is not None and entry["updated_at"] > since:
                kv = entry["caches"]["kv"]
                return int(kv.get("hits", 0) + kv.get("misses", 0))
            assert time.monotonic() < deadline, f"{worker_id} published nothing after the job"
            time.sleep(0.05)
    finally:
        client.close()


def test_a_job_with_cache_off_neither_reads_nor_writes_the_tier(service) -> None:
    """`cache: {"mode": "off"}` on a write-through tier: its blocks never reach Redis; a
    cold worker computes its whole prompt and asks the tier nothing, though the tier holds
    it (as a cache-on job there then shows); greedy text the same throughout."""
    svc = service(kv_tier_enabled=True, kv_tier_write_through=True, result_cache_ttl_s=0,
                  cache_stats_interval_s=0.3)  # fmt: skip
    prompt = "A long instruction that every job here shares, word for word. " * 6
    off = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "cache": {"mode": "off"}}
    on = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = svc.start_worker()
    (computed_off,) = svc.run_succeeded([off])
    assert computed_off.cached_tokens == 0 and _num_tier_blocks(svc) == 0
    (computed_on,) = svc.run_succeeded([on])
    num_blocks = _num_tier_blocks(svc)
    assert num_blocks >= 4
    (pool_skipped,) = svc.run_succeeded([off])  # the pool holds the prefix now: still not used
    assert pool_skipped.cached_tokens == 0 and _num_tier_blocks(svc) == num_blocks
    first.stop()
    svc.start_worker()
    (cold_off,) = svc.run_succeeded([off])
    assert cold_off.cached_tokens == 0
    # No tier lookup at all, in the counters the cold worker published after its job ended.
    assert _kv_lookups_published_after(svc, cold_off.worker_id, time.time()) == 0
    (cold_on,) = svc.run_succeeded([on])
    assert cold_on.cached_tokens >= num_blocks * BLOCK - BLOCK
    texts = {j.result["choices"][0]["text"]
             for j in (computed_off, computed_on, pool_skipped, cold_off, cold_on)}
    assert len(texts) == 1
