"""Children forked from the warm server behave as `python -m MODULE ARGS` would: their own
environment, arguments, directory, log, exit code, signals, name in ps and random state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from scheduler.supervisor import Supervisor
from scheduler.warm_start import WarmProcess, start_module

PROBE = '''
import json, os, sys, time
import torch
out = {"argv": sys.argv[1:], "env": os.environ.get("PROBE_VALUE"), "cwd": os.getcwd(),
       "name": __name__, "draw": torch.rand(4).tolist(), "preloaded": "torch" in sys.modules}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1:2] == ["sleep"]:
    time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)
'''


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module name the children can import (the parent's sys.path travels with them)."""
    package = tmp_path / "mods"
    package.mkdir()
    name = f"warm_probe_{tmp_path.name.replace('-', '_')}"
    (package / f"{name}.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(package))
    return name


def _output(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


def test_a_warm_child_runs_the_module_with_its_own_env_args_cwd_and_log(
        probe_module: str, tmp_path: Path) -> None:
    logs = [tmp_path / f"child-{i}.log" for i in range(2)]
    children = [start_module(probe_module, ["7", "x"], env={"PROBE_VALUE": f"v{i}"},
                             log_path=logs[i], cwd=tmp_path, new_session=False)
                for i in range(2)]
    assert all(isinstance(c, WarmProcess) for c in children)
    assert [c.wait(120) for c in children] == [7, 7]
    first, second = (_output(path) for path in logs)
    assert first["argv"] == ["7", "x"] and first["name"] == "__main__"
    assert (first["env"], second["env"]) == ("v0", "v1")
    assert first["cwd"] == str(tmp_path) and first["preloaded"]
    assert first["draw"] != second["draw"]  # each child reseeds, none repeats the server's
    assert "to stderr" in logs[0].read_text()


def test_stderr_can_go_apart_and_the_fallback_is_a_plain_process(probe_module: str,
                                                                 tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    child = start_module(probe_module, [], log_path=out, stderr_path=err, new_session=False)
    assert child.wait(120) == 0
    assert "to stderr" not in out.read_text() and err.read_text() == "to stderr\n"
    cold = start_module(probe_module, ["3"], log_path=tmp_path / "cold", warm=False,
                        env={"PYTHONPATH": ":".join(sys.path)})
    assert isinstance(cold, subprocess.Popen) and cold.wait(120) == 3


def test_a_warm_child_answers_like_popen_and_names_its_module_in_ps(probe_module: str,
                                                                    tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    child = start_module(probe_module, ["sleep"], log_path=log)
    try:
        deadline = time.monotonic() + 120
        while not log.exists() or "to stderr" not in log.read_text():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc = psutil.Process(child.pid)
        assert " ".join(proc.cmdline()).strip() == f"{sys.executable} -m {probe_module} sleep"
        assert os.getsid(child.pid) == child.pid  # its own session, as the supervisor asks
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM and child.returncode == -signal.SIGTERM
    finally:
        child.kill()  # a no-op once it has ended


def test_the_supervisor_restarts_a_warm_child_that_exits(probe_module: str,
                                                         tmp_path: Path) -> None:
    sup = Supervisor([sys.executable, "-m", probe_module, "5"], num_workers=1,
                     log_dir=tmp_path, min_backoff_s=0.1, warm_start=True)
    sup.start()
    try:
        deadline = time.monotonic() + 120
        while not sup.slots[0].exit_codes or sup.slots[0].process is None:
            assert time.monotonic() < deadline, sup.slots
            sup.poll()
            time.sleep(0.05)
        assert sup.slots[0].exit_codes[0] == 5
        assert isinstance(sup.slots[0].process, WarmProcess)
    finally:
        sup.stop(timeout=30)
