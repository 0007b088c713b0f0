"""Ids' random digits: from the OS, never handed out twice, not shared with a fork."""

from __future__ import annotations

import os
import re

import pytest

from core import random_hex as module
from core.random_hex import POOL_BYTES, random_hex


def test_digits_are_hex_of_the_length_asked_and_never_repeat() -> None:
    """Many pools' worth: each id is fresh hex, and none comes back."""
    taken = [random_hex(24) for _ in range(3 * POOL_BYTES)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", digits) for digits in taken)
    assert len(set(taken)) == len(taken)
    assert len(random_hex(2 * POOL_BYTES)) == 2 * POOL_BYTES


def test_digits_come_from_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh pool is read from `os.urandom` and handed out in order."""
    monkeypatch.setattr(module, "_pool", module._Pool())
    monkeypatch.setattr(module.os, "urandom", lambda n: bytes(range(256)) * (n // 256))
    assert random_hex(6) == "000102"
    assert random_hex(4) == "0304"


@pytest.mark.parametrize("num_chars", [0, -1, 2 * POOL_BYTES + 1])
def test_an_impossible_length_is_refused(num_chars: int) -> None:
    with pytest.raises(ValueError, match="num_chars"):
        random_hex(num_chars)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_digits() -> None:
    """The child draws its own pool: what it hands out next differs from the parent's."""
    random_hex(2)  # the parent's pool is filled and has digits left
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next digits and leave at once
        os.write(write, random_hex(64).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 64 and child != random_hex(64)
