"""Settings are documented where users look for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import Settings
from scheduler.embedded import embedded_session_timeout

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_lists_every_setting() -> None:
    """Each field has a row `BATCHINFER_<NAME>` in docs/configuration.md's table."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields
               if f"| `BATCHINFER_{name.upper()}` |" not in readme]
    assert not missing, f"docs/configuration.md lacks rows for {missing}"


def test_up_shortens_the_kafka_session_only_where_none_is_configured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded broker holds a group join for half the session timeout: `up` uses 6 s
    (a worker joins in 3 s, not 5) unless the setting is given, from the environment or
    otherwise."""
    monkeypatch.delenv("BATCHINFER_KAFKA_SESSION_TIMEOUT_MS", raising=False)
    assert embedded_session_timeout(Settings()) == {
        "kafka_session_timeout_ms": 6000}
    monkeypatch.setenv("BATCHINFER_KAFKA_SESSION_TIMEOUT_MS", "20000")
    assert embedded_session_timeout(Settings()) == {}
    assert embedded_session_timeout(Settings(kafka_session_timeout_ms=8000)) == {}
