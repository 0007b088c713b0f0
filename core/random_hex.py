"""Unpredictable hex digits for ids, read from the OS a few KiB at a time.

`secrets.token_hex` asks the kernel for each id (`getrandom`), and the call lets go of
the GIL: on the API's event loop, which makes every job id, each one handed the
interpreter to the writer and producer threads and waited to get it back (~7% of the
loop's samples under load). The digits come from the same source (`os.urandom`), 2 KiB
at a time, and are handed out once each. A forked child starts with an empty pool, so
parent and child never hand out the same digits.
"""

from __future__ import annotations

import os
import threading

POOL_BYTES = 2048


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.digits = ""
        self.used = 0

    def clear(self) -> None:
        self.digits, self.used = "", 0


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.clear)


def random_hex(num_chars: int) -> str:
    """`num_chars` hex digits from the OS's CSPRNG (as `secrets.token_hex(num_chars // 2)`)."""
    if not 0 < num_chars <= 2 * POOL_BYTES:
        raise ValueError(f"num_chars must be 1 to {2 * POOL_BYTES}, not {num_chars}")
    with _pool.lock:
        if _pool.used + num_chars > len(_pool.digits):
            _pool.digits, _pool.used = os.urandom(POOL_BYTES).hex(), 0
        start = _pool.used
        _pool.used = start + num_chars
        return _pool.digits[start:_pool.used]
