"""Settings are documented where users look for them."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_readme_lists_every_setting() -> None:
    """Each field has a row `BATCHINFER_<NAME>` in the README's configuration table."""
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in Settings.model_fields
               if f"| `BATCHINFER_{name.upper()}` |" not in readme]
    assert not missing, f"README's settings table lacks {missing}"
