"""The vector-search backend without a search-enabled server: module detection, the index
and query it sends, and the replies it reads, against a fake server speaking real replies.

The replies below are those of real servers to redis-py 8 (RESP3): `HELLO` and
`MODULE LIST` of Redis 8.0 (modules bundled) and of Debian's Redis 7.0 (none), Redis 7's
unknown-command and ACL errors, and RediSearch's answers to FT.CREATE and to FT.SEARCH
with RETURN and DIALECT 2 (a map: attributes, format, results, total_results, warning).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from scheduler.embedded_services import free_port
from storage.semantic_backends import open_semantic_cache
from storage.semantic_cache import SemanticEntry
from storage.semantic_exact import ExactSemanticCache
from storage.semantic_hnsw import HnswSemanticCache, has_vector_search, knn_query
from tests.utils.fake_redis import FakeRedisServer, array, bulk, hello, integer, resp_map

NAMESPACE = "0123456789abcdef0123456789abcdef"


def _module(name: str, version: int, path: str) -> bytes:
    return resp_map(bulk("name"), bulk(name), bulk("ver"), integer(version), bulk("path"),
                    bulk(path), bulk("args"), array())


REDIS_8_MODULE_LIST = array(
    _module("vectorset", 1, ""),
    _module("timeseries", 80000, "/usr/local/lib/redis/modules//redistimeseries.so"),
    _module("ReJSON", 80000, "/usr/local/lib/redis/modules//rejson.so"),
    _module("bf", 80000, "/usr/local/lib/redis/modules//redisbloom.so"),
    _module("search", 80000, "/usr/local/lib/redis/modules//redisearch.so"),
)
REDIS_7_MODULE_LIST = array()
NOPERM_MODULE = (b"-NOPERM User reader has no permissions to run the 'module|list' "
                 b"command\r\n")  # fmt: skip
REDIS_8 = {"HELLO": hello("8.0.2", REDIS_8_MODULE_LIST),
           "MODULE LIST": REDIS_8_MODULE_LIST, "FT.CREATE": b"+OK\r\n",
           "FT._LIST": array()}  # fmt: skip
REDIS_7 = {"MODULE LIST": REDIS_7_MODULE_LIST}


def client_of(server: FakeRedisServer) -> redis.Redis:
    """A client of the fake server that does not retry."""
    return redis.Redis.from_url(server.url, socket_timeout=2)


def test_redis_8_is_told_by_its_module_list() -> None:
    with FakeRedisServer(REDIS_8) as server:
        assert has_vector_search(client_of(server)) is True
        assert server.sent(b"FT._LIST") == []


def test_debian_redis_7_has_no_vector_search() -> None:
    """No module listed, and FT._LIST is an unknown command."""
    with FakeRedisServer(REDIS_7) as server:
        assert has_vector_search(client_of(server)) is False
        assert server.sent(b"FT._LIST") == [[b"FT._LIST"]]


def test_a_server_refusing_module_list_is_asked_ft_list() -> None:
    """An ACL may forbid MODULE LIST; the search command itself then answers."""
    with FakeRedisServer({"MODULE LIST": NOPERM_MODULE,
                          "FT._LIST": array(bulk("other-index"))}) as server:
        assert has_vector_search(client_of(server)) is True


def test_the_index_is_hnsw_cosine_float32_384_over_the_documents_prefix() -> None:
    """FT.CREATE as RediSearch expects it; an index that exists already is fine."""
    with FakeRedisServer(REDIS_8) as server:
        cache = HnswSemanticCache(client_of(server), prefix="bi")
        cache.ensure_index()
        server.replies["FT.CREATE"] = b"-Index already exists\r\n"
        cache.ensure_index()
        server.replies["FT.CREATE"] = b"-Unknown argument `DIM`\r\n"
        with pytest.raises(redis.ResponseError, match="Unknown argument"):
            cache.ensure_index()
    created = server.sent(b"FT.CREATE")
    assert created[0] == [
        b"FT.CREATE", b"bi:sem:hnsw:384", b"ON", b"HASH", b"PREFIX", b"1", b"bi:semdoc:384:",
        b"SCORE", b"1.0", b"SCHEMA", b"ns", b"TAG", b"SEPARATOR", b",",
        b"vec", b"VECTOR", b"HNSW", b"6", b"TYPE", b"FLOAT32", b"DIM", b"384",
        b"DISTANCE_METRIC", b"COSINE"]  # fmt: skip
    assert len(created) == 3


def test_the_knn_query_filters_by_scope_and_sorts_by_distance() -> None:
    query = knn_query(NAMESPACE, k=3)
    assert query.query_string() == f"(@ns:{{{NAMESPACE}}})=>[KNN 3 @vec $vec AS distance]"
    assert query.get_args() == [
        query.query_string(), "RETURN", 5, "distance", "job_id", "prompt", "expires_at",
        "result", "SORTBY", "distance", "ASC", "DIALECT", 2, "LIMIT", 0, 3]  # fmt: skip
    with pytest.raises(ValueError, match="lowercase hex"):
        knn_query("tenant} | @ns:{other")


def _doc(key: str, distance: str, job_id: str, prompt: str, expires_at: float,
         result: dict[str, object]) -> bytes:
    return resp_map(bulk("id"), bulk(key), bulk("extra_attributes"), resp_map(
        bulk("distance"), bulk(distance), bulk("job_id"), bulk(job_id), bulk("prompt"),
        bulk(prompt), bulk("expires_at"), bulk(repr(expires_at)), bulk("result"),
        bulk(json.dumps(result))), bulk("values"), array())


def _search_reply(*docs: bytes) -> bytes:
    return resp_map(bulk("attributes"), array(), bulk("format"), bulk("STRING"),
                    bulk("results"), array(*docs), bulk("total_results"), integer(len(docs)),
                    bulk("warning"), array())


def test_a_search_reply_gives_the_best_live_document_above_the_bar() -> None:
    """Docs come nearest first; an expired one (TTL not yet enforced) is passed over;
    similarity is 1 - cosine distance; the query vector travels as float32 bytes."""
    now = time.time()
    reply = _search_reply(
        _doc(f"bi:semdoc:384:{NAMESPACE}:old", "0.01", "old", "What is 2+2?", now - 5,
             {"text": "stale"}),
        _doc(f"bi:semdoc:384:{NAMESPACE}:j1", "0.0300000309944", "j1", "What's 2+2?",
             now + 60, {"text": "4"}))  # fmt: skip
    vector = np.arange(1, 385, dtype=np.float32)
    with FakeRedisServer({**REDIS_8, "FT.SEARCH": reply}) as server:
        cache = HnswSemanticCache(client_of(server), prefix="bi")
        (match,) = cache.nearest_many(NAMESPACE, [vector])
        (too_far,) = cache.nearest_many(NAMESPACE, [vector], min_similarity=0.98)
        # A client asking for RESP3 itself gets the native map from redis-py, not a Result.
        native = HnswSemanticCache(redis.Redis.from_url(server.url, protocol=3), prefix="bi")
        assert native.nearest_many(NAMESPACE, [vector]) == [match]
    assert match is not None and match.job_id == "j1" and match.result == {"text": "4"}
    assert match.prompt == "What's 2+2?" and match.similarity == pytest.approx(0.97)
    assert too_far is None
    search = server.sent(b"FT.SEARCH")[0]
    assert search[:3] == [b"FT.SEARCH", b"bi:sem:hnsw:384",
                          f"(@ns:{{{NAMESPACE}}})=>[KNN 8 @vec $vec AS distance]".encode()]
    params = search.index(b"PARAMS")
    assert search[params + 1 : params + 3] == [b"2", b"vec"]
    sent = np.frombuffer(search[params + 3], dtype=np.float32)
    np.testing.assert_allclose(sent, vector / np.linalg.norm(vector), rtol=1e-6)


def test_a_search_error_is_a_miss_and_a_lost_index_is_created_again() -> None:
    """A Redis restarted without persistence lost the index: searches miss, and it is
    created again (once per interval, not per search)."""
    with FakeRedisServer({**REDIS_8, "FT.SEARCH": b"-bi:sem:hnsw:384: no such index\r\n"}
                         ) as server:
        cache = HnswSemanticCache(client_of(server), prefix="bi")
        assert cache.nearest_many(NAMESPACE, [np.ones(384), np.ones(384)]) == [None, None]
    assert len(server.sent(b"FT.CREATE")) == 1


def test_an_entry_is_one_hash_document_with_its_ttl_and_a_ledger_line() -> None:
    script_reply = array(integer(1234), integer(0))  # resident bytes, evicted
    with FakeRedisServer({**REDIS_8, "SCRIPT EXISTS": array(integer(1)),
                          "HSET": integer(6), "EXPIRE": integer(1),
                          "EVALSHA": script_reply}) as server:
        cache = HnswSemanticCache(client_of(server), prefix="bi")
        cache.add_many([
            SemanticEntry(NAMESPACE, "j1", "What's 2+2?", np.ones(384), {"text": "4"}, 60),
            SemanticEntry(NAMESPACE, "j2", "skipped", np.ones(384), {}, 0),
            SemanticEntry(NAMESPACE, "j3", "wrong size", np.ones(16), {}, 60)])
    (hset,) = server.sent(b"HSET")
    key = f"bi:semdoc:384:{NAMESPACE}:j1".encode()
    fields = dict(zip(hset[2::2], hset[3::2], strict=True))
    assert hset[1] == key
    assert fields[b"ns"] == NAMESPACE.encode() and fields[b"job_id"] == b"j1"
    assert np.allclose(np.frombuffer(fields[b"vec"], np.float32), 1 / np.sqrt(384))
    assert json.loads(fields[b"result"]) == {"text": "4"}
    assert server.sent(b"EXPIRE") == [[b"EXPIRE", key, b"60"]]
    (evalsha,) = server.sent(b"EVALSHA")
    assert evalsha[-5:] == [b"set", f"{NAMESPACE}:j1".encode(),
                            str(384 * 4 + len(b"What's 2+2?") + len(b'{"text":"4"}')).encode(),
                            b"1", b"60"]


def test_the_backend_is_chosen_by_what_the_server_has(
        caplog: pytest.LogCaptureFixture) -> None:
    with FakeRedisServer(REDIS_8) as server:
        with caplog.at_level(logging.INFO, logger="storage.semantic_backends"):
            chosen = open_semantic_cache(client_of(server), prefix="bi")
        assert chosen.backend == "hnsw" and len(server.sent(b"FT.CREATE")) == 1
        assert "HNSW" in caplog.text
        assert open_semantic_cache(client_of(server), prefix="bi",
                                   backend="exact").backend == "exact"
    with FakeRedisServer(REDIS_7) as server:
        assert isinstance(open_semantic_cache(client_of(server), prefix="bi"),
                          ExactSemanticCache)
        with pytest.raises(ValueError, match="no search module"):
            open_semantic_cache(client_of(server), prefix="bi", backend="hnsw")
    nothing = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    assert open_semantic_cache(nothing, prefix="bi").backend == "exact"
    with pytest.raises(ValueError, match="semantic_cache_backend"):
        open_semantic_cache(nothing, prefix="bi", backend="faiss")
