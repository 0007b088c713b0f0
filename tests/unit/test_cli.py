"""The `batchinfer` command line: parsing, and the operator commands on SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import build_parser, main
from core.settings import get_settings


@pytest.fixture
def sqlite_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Settings pointing at a SQLite file in tmp_path."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", url)
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    yield url
    get_settings.cache_clear()


def test_up_options_parse() -> None:
    """`up` takes port, workers, data dir and model; a fixed worker count by default."""
    args = build_parser().parse_args(
        ["up", "--port", "9000", "--workers", "2", "--data-dir", "/tmp/x", "--model", "m"])
    assert (args.port, args.workers, args.data_dir, args.served) == (9000, 2, "/tmp/x",
                                                                      [("m", None)])
    assert args.max_workers is None
    args = build_parser().parse_args(["up", "--workers", "0", "--max-workers", "4"])
    assert (args.workers, args.max_workers) == (0, 4)


def test_up_refuses_max_workers_below_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--max-workers under --workers exits 2 with a message, before anything starts."""
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))  # restored after
    assert main(["up", "--workers", "3", "--max-workers", "2",
                 "--data-dir", str(tmp_path / "data")]) == 2
    assert "--max-workers must be at least 1 and at least --workers (3)" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_unknown_command_is_refused() -> None:
    """argparse rejects an unknown subcommand with exit status 2."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve"])
    assert exc.value.code == 2


def test_db_upgrade_keys_create_and_downgrade(sqlite_env: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Migrate up, mint two keys for one tenant (printed once each), migrate down."""
    from storage.db import create_db_engine, session_factory
    from storage.tenants import tenant_by_name, tenant_for_api_key

    assert main(["db", "upgrade"]) == 0
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert first != second
    engine = create_db_engine(sqlite_env)
    with session_factory(engine)() as session:
        tenant = tenant_by_name(session, name="acme")
        assert tenant is not None
        for key in (first, second):
            found = tenant_for_api_key(session, key=key)
            assert found is not None and found.id == tenant.id
    engine.dispose()
    assert main(["db", "downgrade"]) == 0


def test_user_errors_exit_2_with_a_message(sqlite_env: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A bad value (empty tenant name) exits 2 and says why, no traceback."""
    assert main(["db", "upgrade"]) == 0
    assert main(["keys", "create", "--tenant", "  "]) == 2
    assert "tenant name must not be empty" in capsys.readouterr().err


def test_keys_list_and_revoke_by_id_prefix_or_key(sqlite_env: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Keys are listed without their secret and revoked by any of the three names an
    operator has; a revoked key authenticates no more, the others still do."""
    from storage.db import create_db_engine, session_factory
    from storage.tenants import tenant_for_api_key

    assert main(["db", "upgrade"]) == 0
    keys = []
    for tenant in ("acme", "acme", "acme", "globex"):
        assert main(["keys", "create", "--tenant", tenant]) == 0
        captured = capsys.readouterr()
        key_id = captured.err.split("key id: ")[1].split()[0]
        keys.append((key_id, captured.out.strip().splitlines()[-1]))
    assert main(["keys", "list", "--tenant", "acme"]) == 0
    listed = capsys.readouterr().out
    assert all(key_id in listed for key_id, _ in keys[:3]) and keys[3][0] not in listed
    assert not any(key in listed for _, key in keys)  # never the secret
    assert listed.count(" live") == 3

    (by_id, _), (_, by_key), (_, third), (_, other) = keys
    for ref in (by_id, by_key, third[:12]):
        assert main(["keys", "revoke", ref]) == 0
        assert "revoked key_" in capsys.readouterr().out
    assert main(["keys", "revoke", by_id]) == 0  # again: says so, changes nothing
    assert "already revoked" in capsys.readouterr().out
    assert main(["keys", "revoke", "key_nope"]) == 2
    assert "no API key matches 'key_nope'" in capsys.readouterr().err
    assert main(["keys", "revoke", "acme"]) == 2
    assert "names no key" in capsys.readouterr().err

    engine = create_db_engine(sqlite_env)
    with session_factory(engine)() as session:
        assert [tenant_for_api_key(session, key=k) is None for _, k in keys] == [
            True, True, True, False]
    engine.dispose()
    assert main(["keys", "list"]) == 0
    assert capsys.readouterr().out.count("revoked 20") == 3
