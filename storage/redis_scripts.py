"""Pipelines that call Lua scripts, without asking Redis first whether each is loaded.

redis-py's pipeline sends SCRIPT EXISTS for the scripts it calls before every execute: a
second round trip for each pipelined cache write (the result cache's and its ledger's,
once per worker step). `execute` runs the pipeline as it stands, its script calls as
EVALSHA; only where Redis answers NOSCRIPT (it restarted, or its scripts were flushed)
does it load those scripts and run those calls again, by themselves. Every command runs
exactly once either way, and the replies are what `pipe.execute()` would give.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import NoScriptError


def execute(pipe: redis.client.Pipeline, *, raise_on_error: bool = True) -> list[Any]:
    """`pipe.execute()` of a pipeline without a transaction, without the SCRIPT EXISTS
    round trip; raises the first error reply as it would, or with `raise_on_error=False`
    leaves each error reply in its command's place (a lost connection still raises)."""
    if pipe.transaction is True:  # the flag Pipeline sets, not Redis.transaction()
        raise ValueError("a transaction's NOSCRIPT aborts all of it: use pipe.execute()")
    scripts = {script.sha: script for script in pipe.scripts}
    stack = list(pipe.command_stack)
    pipe.scripts = set()  # nothing to check before sending
    replies = pipe.execute(raise_on_error=False)
    missing = [i for i, reply in enumerate(replies)
               if isinstance(reply, NoScriptError) and stack[i][0][1] in scripts]
    if missing:
        for sha in {stack[i][0][1] for i in missing}:
            scripts[sha].registered_client.script_load(scripts[sha].script)
        again = scripts[stack[missing[0]][0][1]].registered_client.pipeline(transaction=False)
        for i in missing:
            args, options = stack[i]
            again.execute_command(*args, **options)
        for i, reply in zip(missing, again.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, redis.RedisError):
                raise reply
    return replies
