"""The Redis KV tier's scripts are Redis Cluster safe: every key a script touches is
passed in KEYS, and all of them share one hash tag, hence one slot."""

from __future__ import annotations

import re
from typing import Any

import redis
from redis.crc import key_slot

from workers.inference.kv_tier import _DELETE_SCRIPT, _STORE_SCRIPT, RedisKVTier

# Names the scripts bind to KEYS entries (`local index, ... = KEYS[1], ...`,
# `local key, payload = KEYS[i], ...`): the only things they may hand Redis as a key.
KEY_NAMES = {"index", "sizes", "total", "evictions", "key"}
# Commands whose first argument is a key, as the scripts use them.
KEY_COMMANDS = {"SET", "EXPIRE", "HSET", "HGET", "HDEL", "HEXISTS", "INCRBY", "DECRBY",
                "ZADD", "ZREM", "ZRANGE", "ZRANGEBYSCORE", "ZSCORE", "GET", "DEL", "STRLEN"}


class _Recorder:
    """Stands in for a registered script: records its KEYS and ARGV, returns `reply`."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.calls: list[tuple[list[str], list[Any]]] = []

    def __call__(self, keys: list[str], args: list[Any] | None = None) -> Any:
        self.calls.append((list(keys), list(args or [])))
        return self.reply


def _tag(key: str) -> str:
    match = re.search(r"\{([^}]*)\}", key)
    assert match is not None and match.group(1), f"{key} has no hash tag"
    return match.group(1)


def test_every_key_of_a_store_and_its_deletes_shares_one_hash_tag() -> None:
    tier = RedisKVTier(redis.Redis(), prefix="bi", model="smollm2", revision="r1:float32-bs16",
                       ttl_s=60, max_bytes=100)  # fmt: skip
    try:
        evicted = tier.block_key(b"\x00old")
        store, delete = _Recorder([20, [evicted.encode()]]), _Recorder(1)
        tier._store_script, tier._delete_script = store, delete  # type: ignore[assignment]
        tier._write([(b"\x01" * 32, b"x" * 10), (b"\x02" * 32, b"y" * 10)])
    finally:
        tier.close()
    (keys, argv), = store.calls
    assert keys[4:] == [tier.block_key(b"\x01" * 32), tier.block_key(b"\x02" * 32)]
    assert argv[3:] == [b"x" * 10, b"y" * 10]  # one payload per block key, same order
    assert keys[4] == "bi:kv:{smollm2:r1:float32-bs16}:b:" + "01" * 32
    (delete_keys, _), = delete.calls
    assert delete_keys == [keys[0], evicted.encode()]
    every_key = [*keys, *[k.decode() if isinstance(k, bytes) else k for k in delete_keys]]
    assert {_tag(k) for k in every_key} == {"smollm2:r1:float32-bs16"}
    assert len({key_slot(k.encode()) for k in every_key}) == 1
    assert tier.snapshot().num_evictions == 1 and tier.snapshot().num_stored_bytes == 20


def test_the_scripts_build_no_key_and_touch_only_keys_bound_from_keys() -> None:
    for script in (_STORE_SCRIPT, _DELETE_SCRIPT):
        assert ".." not in script  # no key (or anything) concatenated inside
        for command, first in re.findall(r"redis\.call\('(\w+)', ([\w\[\]]+)", script):
            assert command in KEY_COMMANDS, command
            assert first in KEY_NAMES or re.fullmatch(r"KEYS\[\w+\]", first), (command, first)
    assert "local index, sizes, total, evictions = KEYS[1], KEYS[2], KEYS[3], KEYS[4]" \
        in _STORE_SCRIPT
    assert "local key, payload = KEYS[i], ARGV[i - 1]" in _STORE_SCRIPT
