"""The job state machine: every allowed move, and refusals that name both states."""

from __future__ import annotations

import itertools

import pytest

from storage.models import JobStatus
from storage.states import IllegalTransition, can_transition, check_transition, sources_of

Q, R, S, F, C, X = (
    JobStatus.QUEUED,
    JobStatus.RUNNING,
    JobStatus.SUCCEEDED,
    JobStatus.FAILED,
    JobStatus.CANCELLED,
    JobStatus.EXPIRED,
)
ALLOWED = {(Q, R), (Q, F), (Q, C), (Q, X), (R, Q), (R, R), (R, S), (R, F), (R, C), (R, X)}


@pytest.mark.parametrize("old,new", sorted(ALLOWED))
def test_allowed_transitions_pass(old: JobStatus, new: JobStatus) -> None:
    check_transition(old, new)
    assert can_transition(old, new)


@pytest.mark.parametrize("old,new", sorted(set(itertools.product(JobStatus, JobStatus)) - ALLOWED))
def test_every_other_transition_is_refused_naming_both_states(
    old: JobStatus, new: JobStatus
) -> None:
    assert not can_transition(old, new)
    with pytest.raises(IllegalTransition) as caught:
        check_transition(old, new)
    message = str(caught.value)
    assert f"{old.value} → {new.value}" in message
    assert (caught.value.old, caught.value.new) == (old, new)
    assert isinstance(caught.value, ValueError)


def test_queued_cannot_jump_to_succeeded() -> None:
    with pytest.raises(IllegalTransition, match="queued → succeeded"):
        check_transition(Q, S)


def test_terminal_states_say_nothing_follows() -> None:
    for terminal in (S, F, C):
        assert terminal.is_terminal
        with pytest.raises(IllegalTransition, match="may only become nothing"):
            check_transition(terminal, R)


def test_sources_of_matches_the_table() -> None:
    assert sources_of(R) == {Q, R}
    assert sources_of(S) == {R}
    assert sources_of(F) == {Q, R}
    assert sources_of(C) == {Q, R}
    assert sources_of(Q) == {R}
