"""Waits end before the running test's pytest timeout (`tests.utils.budget`)."""

from __future__ import annotations

import pytest

from tests.utils.budget import within_budget


@pytest.mark.timeout(20)
def test_a_wait_longer_than_the_tests_timeout_ends_before_it() -> None:
    # 20 s: a quarter (5 s) is kept for the report and the teardown.
    assert 1.0 <= within_budget(600) <= 15.0
    assert within_budget(3.0) == 3.0  # a wait that fits is left alone


def test_the_global_timeout_bounds_unmarked_tests(pytestconfig: pytest.Config) -> None:
    timeout = float(pytestconfig.getini("timeout"))
    assert within_budget(10 * timeout) <= timeout - min(30.0, timeout / 4)
