"""Worker ids: who a worker is (`<host>-<pid>-<token>`), and whether it is known dead.

A worker's id names its host and process id, so an operator reading the jobs table knows
where a job runs, and a process on the same host can tell that the worker is gone: no
process has that pid any more (after a crash, a SIGKILL, a power loss of the whole
stack). The token makes the id unique per process start: a pid reused by a later worker
must not make that worker the owner of the jobs its predecessor left running.

`is_known_dead` is conservative: only a worker of this host whose pid is not running is
dead for sure; a running pid (perhaps reused by another process) or another host's
worker are judged by the heartbeat timeout instead.
"""

from __future__ import annotations

import os
import re
import secrets
import socket

# `<pid>` or `<pid>-<token>` after `<host>-` (ids written before the token have none).
_PID_AND_TOKEN = re.compile(r"(\d+)(?:-[0-9a-f]+)?")


def new_worker_id() -> str:
    """This process's id as a worker: `<host>-<pid>-<6 hex digits>`."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def local_pid(worker_id: str, host: str | None = None) -> int | None:
    """The pid of a worker of `host` (default this host) named by worker_id, else None."""
    host = socket.gethostname() if host is None else host
    prefix = f"{host}-"
    if not worker_id.startswith(prefix):
        return None
    match = _PID_AND_TOKEN.fullmatch(worker_id[len(prefix):])
    return int(match.group(1)) if match else None


def is_known_dead(worker_id: str, host: str | None = None) -> bool:
    """True when worker_id names a process of this host that no longer runs."""
    pid = local_pid(worker_id, host)
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # a process of another user holds the pid now
    return False
