"""Pipelines calling Lua scripts without SCRIPT EXISTS first (storage.redis_scripts)."""

from __future__ import annotations

import uuid

import pytest
import redis

from storage import redis_scripts


def _new_script(redis_client: redis.Redis) -> redis.commands.core.Script:
    """A script Redis has never seen (its text is new), so its first EVALSHA is NOSCRIPT."""
    return redis_client.register_script(
        f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")


def test_a_script_redis_lacks_is_loaded_and_its_call_runs_once(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"t{uuid.uuid4().hex[:10]}"
    script = _new_script(redis_client)
    checks: list[int] = []
    real_load = redis.client.Pipeline.load_scripts

    def counted(self: redis.client.Pipeline) -> None:
        checks.append(1)
        real_load(self)

    monkeypatch.setattr(redis.client.Pipeline, "load_scripts", counted)
    pipe = redis_client.pipeline(transaction=False)
    pipe.set(f"{key}:a", "x")
    script(keys=[f"{key}:n"], args=[5], client=pipe)
    pipe.get(f"{key}:a")
    assert redis_scripts.execute(pipe) == [True, 5, b"x"]
    assert redis_client.get(f"{key}:n") == b"5"  # once, though its first call was refused
    again = redis_client.pipeline(transaction=False)
    script(keys=[f"{key}:n"], args=[2], client=again)
    assert redis_scripts.execute(again) == [7]
    assert checks == []  # never a SCRIPT EXISTS round trip
    redis_client.delete(f"{key}:a", f"{key}:n")


def test_an_error_reply_raises_as_execute_would(redis_client: redis.Redis) -> None:
    key = f"t{uuid.uuid4().hex[:10]}"
    pipe = redis_client.pipeline(transaction=False)
    pipe.set(key, "not a number")
    _new_script(redis_client)(keys=[key], args=[1], client=pipe)
    with pytest.raises(redis.ResponseError, match="not an integer"):
        redis_scripts.execute(pipe)
    assert redis_client.get(key) == b"not a number"
    redis_client.delete(key)


def test_a_transaction_is_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="transaction"):
        redis_scripts.execute(redis_client.pipeline(transaction=True))
