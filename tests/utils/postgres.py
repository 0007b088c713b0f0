"""A throwaway PostgreSQL cluster for integration tests (initdb + pg_ctl, loopback only).

PostgreSQL refuses to run as root, so under root the cluster belongs to the `postgres`
system user (created by Debian's package) or, failing that, a `batchinfer-test` user made
here. Its data lives in a temporary directory that is removed on stop.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from scheduler.embedded_services import free_port

logger = logging.getLogger(__name__)

_FALLBACK_USER = "batchinfer-test"


def postgres_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin holding initdb, or None."""
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not candidates:
        found = shutil.which("initdb")
        return Path(found).parent if found else None
    newest = max(candidates, key=lambda p: int(Path(p).parent.parent.name))
    return Path(newest).parent


def _service_user() -> str | None:
    """The unprivileged user to run PostgreSQL as, or None when not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", _FALLBACK_USER):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    _FALLBACK_USER], check=True)
    return _FALLBACK_USER


class PostgresCluster:
    """initdb a cluster in a temp dir, start it on a free loopback port, stop and delete it."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.user = _service_user()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="batchinfer-pg-"))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "sock"

    @property
    def admin_url(self) -> str:
        """SQLAlchemy URL of the `postgres` database as superuser (trust auth)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        subprocess.run(argv, check=True, user=self.user, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, cwd=self.root)

    def start(self) -> None:
        """Create and start the cluster; returns once it accepts connections."""
        self.socket_dir.mkdir()
        if self.user:
            info = pwd.getpwnam(self.user)
            for path in (self.root, self.socket_dir):
                os.chown(path, info.pw_uid, info.pw_gid)
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                  "--auth=trust", "--encoding=UTF8", "--no-sync")
        options = (f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=200")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l",
                  str(self.root / "postgres.log"), "-o", options, "-w", "-t", "60", "start")
        self._wait_ready()
        logger.info("PostgreSQL test cluster on port %d (%s)", self.port, self.root)

    def pg_ctl(self, *args: str) -> None:
        """Run `pg_ctl` on this cluster (`"-m", "immediate", "stop"` crashes it)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args)

    def start_durable(self) -> None:
        """Start the stopped cluster with PostgreSQL's durable defaults (fsync on), so a
        crash keeps every committed transaction; returns once it accepts connections."""
        options = (f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 "
                   "-c max_connections=200")
        self.pg_ctl("-l", str(self.root / "postgres.log"), "-o", options, "-w", "-t", "60",
                    "start")

    def _wait_ready(self, timeout: float = 30.0) -> None:
        engine = sa.create_engine(self.admin_url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    with engine.connect() as conn:
                        conn.execute(sa.text("SELECT 1"))
                    return
                except sa.exc.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            engine.dispose()

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its files."""
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast",
                      "-w", "stop")
        except subprocess.CalledProcessError as e:
            logger.warning("pg_ctl stop failed: %s", e.stdout)
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(admin_url: str, prefix: str = "test") -> str:
    """Create a fresh empty database next to admin_url's and return its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _run_outside_transaction(admin_url, f'CREATE DATABASE "{name}"')
    return str(sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False))


def drop_database(admin_url: str, url: str) -> None:
    """Drop the database of url, closing whatever connections a test left open."""
    name = sa.make_url(url).database
    _run_outside_transaction(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _run_outside_transaction(admin_url: str, statement: str) -> None:
    # CREATE and DROP DATABASE refuse to run inside a transaction block.
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(statement))
    finally:
        engine.dispose()
