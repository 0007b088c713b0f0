"""Start the service's Python processes from a warm fork server.

A worker started from nothing spends 6-10 s of CPU importing torch, transformers and the
engine before it reads a byte of its model (more on a loaded machine), and `up` paid that
again for its model check. A fork server (multiprocessing's "forkserver" start method)
imports them once; each process is then forked from it with those modules in memory and
starts at once. The server is a fresh interpreter that only imports (no CUDA, no threads
of ours), so forking it is as safe as a data loader's forked workers.

Each child is what `python -m MODULE ARGS` would be: its own environment, working
directory and log, its own session, SIGTERM when its parent dies, fresh random state.
`WarmProcess` answers like `subprocess.Popen` (pid, poll, wait, signals), so supervisors
treat both alike; `start_module` falls back to a plain `python -m` where forking is
unavailable or the setting turns it off.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from multiprocessing import forkserver
from pathlib import Path
from typing import IO

import setproctitle

from scheduler.embedded_services import die_with_parent

# What a worker imports before it serves: the engine, transformers' config machinery (a
# model config pulls in its distributed-tensor modules), torch._dynamo (building a model on
# the meta device imports it), and `cli` for `models prepare`.
PRELOAD = ("workers.inference.runner", "transformers.activations", "torch._dynamo",
           "torch.utils.cpp_extension", "cli.main")


class WarmProcess:
    """A forked child, with the parts of `subprocess.Popen` the supervisors use."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process = process
        self.args = args

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """Exit code, -N for signal N, None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        """The exit code once the child has ended, else None (never blocks)."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child ends; subprocess.TimeoutExpired after `timeout`."""
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        """Signal the child if it still runs."""
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


Child = WarmProcess | subprocess.Popen[bytes]


def warm_start_available() -> bool:
    """True where multiprocessing can fork from a server (POSIX with fd passing)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_server() -> multiprocessing.context.ForkServerContext:
    """Start the warm server now (a no-op once it runs) and return its context.

    It imports PRELOAD on its own: a caller that starts it before other work of its own
    has the imports done beside that work, and its first fork waits for them to finish.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    return context


def start_module(
    module: str,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    stderr_path: Path | None = None,
    cwd: Path | None = None,
    new_session: bool = True,
    warm: bool = True,
) -> Child:
    """Run `python -m module args` as a child (forked warm unless `warm` is False or
    forking is unavailable); stdout and stderr to `log_path` (appended) or inherited,
    stderr to `stderr_path` instead where given."""
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", module, *args]
    if not (warm and warm_start_available()):
        return start_command(argv, env=env, log_path=log_path, stderr_path=stderr_path,
                             cwd=cwd, new_session=new_session)
    context = start_server()
    # Daemonic: should this process exit without stopping it, multiprocessing's exit hook
    # sends SIGTERM (a worker drains) rather than waiting on it forever.
    process = context.Process(
        target=_run_module, name=module, daemon=True,
        args=(module, list(args), env, _str(log_path), _str(stderr_path), _str(cwd),
              new_session))
    process.start()
    return WarmProcess(process, argv)


def start_command(argv: list[str], *, env: Mapping[str, str] | None, log_path: Path | None,
                  stderr_path: Path | None = None, cwd: Path | None = None,
                  new_session: bool = True) -> subprocess.Popen[bytes]:
    """Run argv as a plain child process (exec), its output to `log_path` or inherited
    (stderr to `stderr_path` where given)."""
    with ExitStack() as files:
        log: IO[bytes] | None = None
        if log_path is not None:
            log = files.enter_context(log_path.open("ab"))
        errors: IO[bytes] | int | None = subprocess.STDOUT if log else None
        if stderr_path is not None:
            errors = files.enter_context(stderr_path.open("ab"))
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=errors,
                                env=env, cwd=cwd, start_new_session=new_session,
                                preexec_fn=die_with_parent)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _run_module(module: str, args: list[str], env: dict[str, str], log_path: str | None,
                stderr_path: str | None, cwd: str | None, new_session: bool) -> None:
    """In the forked child: become `python -m module args` and run it."""
    # First: it finds the room for the title next to the environment it is about to lose.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    if new_session:
        os.setsid()
    die_with_parent()
    if log_path is not None:
        _redirect(log_path, 1, 2)
    if stderr_path is not None:
        _redirect(stderr_path, 2)
    # A log is read while the process runs, as PYTHONUNBUFFERED would make it.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    _forget_parent_state()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _redirect(path: str, *fds: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in fds:
        os.dup2(fd, target)
    os.close(fd)


def _forget_parent_state() -> None:
    """What the server computed before the fork that must be this child's own."""
    settings = sys.modules.get("core.settings")
    if settings is not None:
        settings.get_settings.cache_clear()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # every child would otherwise sample the same "random" tokens
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
