"""Settings are documented where users look for them."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_lists_every_setting() -> None:
    """Each field has a row `BATCHINFER_<NAME>` in docs/configuration.md's table."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields
               if f"| `BATCHINFER_{name.upper()}` |" not in readme]
    assert not missing, f"docs/configuration.md lacks rows for {missing}"
