"""Turn a Settings object into `BATCHINFER_*` variables for a subprocess under test."""

from __future__ import annotations

import json
import os

from core.settings import Settings


def settings_env(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment (os.environ or base, plus every setting) that reproduces settings."""
    env = dict(os.environ if base is None else base)
    for name, value in settings.model_dump().items():
        if value is None:
            env.pop(f"BATCHINFER_{name.upper()}", None)
            continue
        if isinstance(value, list | dict):
            text = json.dumps(value)
        else:
            text = str(value)
        env[f"BATCHINFER_{name.upper()}"] = text
    return env
