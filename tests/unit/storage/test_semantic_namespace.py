"""The semantic cache's scopes: which requests may ever share an answer."""

from __future__ import annotations

from storage.semantic_cache import semantic_namespace

BODY = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}


def scope(**overrides: object) -> str:
    values: dict[str, object] = {"tenant_id": "t", "model": "m", "revision": "r", "body": BODY}
    values.update(overrides)
    return semantic_namespace(**values)  # type: ignore[arg-type]


def test_a_responses_job_and_a_chat_call_with_one_body_never_share_answers() -> None:
    assert scope(kind="response") != scope(kind="chat.completion")
    assert scope(kind="chat.completion") == scope()


def test_tenant_model_revision_system_and_sampling_each_split_the_scope() -> None:
    scopes = {scope(), scope(tenant_id="u"), scope(model="n"), scope(revision="s"),
              scope(system="Be terse."), scope(body=BODY | {"temperature": 0.5})}
    assert len(scopes) == 6
    # The prompt itself is what the search compares, not part of the scope.
    assert scope(body=BODY | {"messages": [{"role": "user", "content": "Hello"}]}) == scope()
