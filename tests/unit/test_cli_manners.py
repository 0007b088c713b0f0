"""How the `batchinfer` command behaves off the happy path: its version, help for every
option, a missing data directory, an unreachable service, a reader that leaves early."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import build_parser, main
from core.settings import get_settings
from scheduler.embedded_services import free_port

ROOT = Path(__file__).resolve().parents[2]


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env["HOME"] = str(tmp_path)  # no settings file or models from the real home
    return env


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`--version` prints the installed distribution's version and exits 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"batchinfer {version('batchinfer')}"


def _parsers(parser: argparse.ArgumentParser, path: str) -> list[tuple[str,
                                                                        argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_option_and_argument_has_help() -> None:
    """Every option and positional of every command says what it is for."""
    missing = [f"{path}: {action.option_strings or action.dest}"
               for path, parser in _parsers(build_parser(), "batchinfer")
               for action in parser._actions
               if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
               and not action.help]
    assert missing == []


def test_keys_list_without_a_database_says_where_it_looked(tmp_path: Path) -> None:
    """In a directory where `up` never ran: exit 2, one line naming the database path and
    how to point at the right one, and no `.data/` created."""
    result = subprocess.run([sys.executable, "-m", "cli", "keys", "list"], cwd=tmp_path,
                            env={**_clean_env(tmp_path), "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"no database at {tmp_path / '.data' / 'batchinfer.db'}" in lines[0]
    assert "--data-dir" in lines[0]
    assert not (tmp_path / ".data").exists()


def test_data_dir_flag_finds_the_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--data-dir` before the command points keys at that directory's database."""
    data_dir = tmp_path / "elsewhere"
    data_dir.mkdir()
    for name in ("DATA_DIR", "DATABASE_URL"):
        monkeypatch.delenv(f"BATCHINFER_{name}", raising=False)  # restored after
    get_settings.cache_clear()
    try:
        assert main(["--data-dir", str(data_dir), "db", "upgrade"]) == 0
        assert main(["--data-dir", str(data_dir), "keys", "create", "--tenant", "t"]) == 0
        capsys.readouterr()
        assert main(["--data-dir", str(data_dir), "keys", "list"]) == 0
        assert " t " in capsys.readouterr().out
        assert (data_dir / "batchinfer.db").is_file()
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("argv", [["batch", "list"], ["jobs", "list"], ["jobs", "get", "j1"]])
def test_an_unreachable_service_is_named_with_its_setting(
        argv: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens: exit 1, one line naming the URL and where it came from."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("BATCHINFER_URL", url)
    assert main([*argv, "--api-key", "k"]) == 1
    err = capsys.readouterr().err
    assert f"batchinfer {argv[0]} {argv[1]}: cannot reach the service at {url} (from " \
           "BATCHINFER_URL)" in err
    assert main([*argv, "--api-key", "k", "--url", url + "/"]) == 1
    assert "(from --url)" in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_it_quietly(tmp_path: Path) -> None:
    """`keys list | head -1` on a long listing: no "Broken pipe", no traceback."""
    from storage.db import create_db_engine, session_factory
    from storage.migrate import upgrade
    from storage.tenants import create_api_key, create_tenant

    url = f"sqlite:///{tmp_path / 'many.db'}"
    upgrade(url)
    engine = create_db_engine(url)
    with session_factory(engine)() as session:
        tenant = create_tenant(session, name="many")
        for _ in range(1500):  # ~100 kB of listing: more than a pipe holds
            create_api_key(session, tenant_id=tenant.id)
        session.commit()
    engine.dispose()
    env = {**_clean_env(tmp_path), "PYTHONPATH": str(ROOT), "BATCHINFER_DATABASE_URL": url}
    child = subprocess.Popen([sys.executable, "-m", "cli", "keys", "list"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().startswith(b"ID")
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(120) == 1
    assert stderr == ""
