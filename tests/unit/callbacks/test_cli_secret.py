"""`batchinfer keys create` prints the tenant's webhook secret next to its new key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from core.settings import get_settings
from storage.db import create_db_engine, session_factory
from storage.tenants import tenant_by_name
from storage.webhook_secrets import signing_secrets

SECRET_PREFIX = "Webhook secret: "


def test_keys_create_prints_the_webhook_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        assert main(["db", "upgrade"]) == 0
        assert main(["keys", "create", "--tenant", "acme"]) == 0
        first = capsys.readouterr()
        assert main(["keys", "create", "--tenant", "acme"]) == 0
        second = capsys.readouterr()
    finally:
        get_settings.cache_clear()
    [line] = [ln for ln in first.err.splitlines() if ln.startswith(SECRET_PREFIX)]
    secret = line[len(SECRET_PREFIX):]
    assert secret.startswith("whsec_")
    assert SECRET_PREFIX + secret in second.err.splitlines()  # a second key: same secret
    assert second.out.strip().startswith("bi_")  # stdout stays the bare key, for scripts
    engine = create_db_engine(url)
    with session_factory(engine)() as session:
        tenant = tenant_by_name(session, name="acme")
        assert tenant is not None
        assert signing_secrets(session, tenant_id=tenant.id) == [secret]
    engine.dispose()
