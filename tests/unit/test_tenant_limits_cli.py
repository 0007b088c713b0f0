"""`batchinfer tenants set-limits|show` on SQLite, and the budgets a job counts against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import main
from core.settings import get_settings
from storage.models import TenantLimit
from storage.tenant_limits import Budget, budgets_of
from storage.token_budget import estimate_tokens


@pytest.fixture
def sqlite_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Settings pointing at a migrated SQLite file with tenant `acme`."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", url)
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    assert main(["db", "upgrade"]) == 0
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    yield url
    get_settings.cache_clear()


def test_set_limits_then_show(sqlite_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Budgets for all models and for one model, a weight; 0 removes a budget."""
    capsys.readouterr()
    assert main(["tenants", "set-limits", "--tenant", "acme", "--tokens-per-minute", "20000",
                 "--tokens-per-day", "1000000", "--weight", "2"]) == 0
    assert main(["tenants", "set-limits", "--tenant", "acme", "--model", "tiny",
                 "--tokens-per-minute", "500"]) == 0
    capsys.readouterr()
    assert main(["tenants", "show", "--tenant", "acme"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["TENANT", "ID", "MODEL", "TOKENS/MIN", "TOKENS/DAY", "WEIGHT"]
    assert lines[1].split()[2:] == ["*", "20,000", "1,000,000", "2"]
    assert lines[2].split()[2:] == ["tiny", "500", "-", "-"]
    assert main(["tenants", "set-limits", "--tenant", "acme", "--tokens-per-day", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[2:] == ["*", "20,000", "-", "2"]


def test_set_limits_refuses_bad_input(sqlite_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown tenant, negative budget, nothing to set, a weight per model: exit 2, a message."""
    capsys.readouterr()
    assert main(["tenants", "set-limits", "--tenant", "nobody", "--weight", "1"]) == 2
    assert "no tenant named 'nobody'" in capsys.readouterr().err
    assert main(["tenants", "set-limits", "--tenant", "acme", "--tokens-per-minute", "-5"]) == 2
    assert "tokens_per_minute must be 0 (no limit) to 2147483647" in capsys.readouterr().err
    # Past what the column holds (an OverflowError traceback once).
    assert main(["tenants", "set-limits", "--tenant", "acme", "--tokens-per-day",
                 "99999999999999999999999"]) == 2
    assert "tokens_per_day must be 0 (no limit) to" in capsys.readouterr().err
    # A weight the engine refuses would have failed every job of the tenant.
    for weight in ("inf", "nan", "0"):
        assert main(["tenants", "set-limits", "--tenant", "acme", "--weight", weight]) == 2
        assert "weight must be a finite number above 0" in capsys.readouterr().err
    assert main(["tenants", "set-limits", "--tenant", "acme"]) == 2
    assert "give --tokens-per-minute" in capsys.readouterr().err
    assert main(["tenants", "set-limits", "--tenant", "acme", "--model", "m",
                 "--weight", "3"]) == 2
    assert "set it without --model" in capsys.readouterr().err


def test_budgets_of_picks_the_tenant_and_model_rows() -> None:
    """A job counts against the "*" budgets and its own model's, not another model's."""
    rows = [TenantLimit(tenant_id="t", model="*", tokens_per_minute=100, tokens_per_day=None),
            TenantLimit(tenant_id="t", model="a", tokens_per_minute=None, tokens_per_day=50),
            TenantLimit(tenant_id="t", model="b", tokens_per_minute=10, tokens_per_day=None)]
    assert budgets_of(rows, model="a") == [Budget("*", 60, 100), Budget("a", 86_400, 50)]
    assert [b.name for b in budgets_of(rows, model="b")] == [
        "tokens_per_minute", "tokens_per_minute for model b"]


def test_estimate_counts_prompt_characters_and_max_tokens() -> None:
    """~4 characters a prompt token, plus max_tokens or the default output."""
    assert estimate_tokens({"prompt": "x" * 40, "max_tokens": 7},
                           default_completion_tokens=256) == 17
    assert estimate_tokens({"messages": [{"role": "user", "content": "y" * 9}]},
                           default_completion_tokens=100) == 103
    # n choices: the prompt once, the output n times, as usage counts them.
    assert estimate_tokens({"prompt": "x" * 40, "max_tokens": 7, "n": 3},
                           default_completion_tokens=256) == 10 + 21
