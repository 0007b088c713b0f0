"""The liveness check the Kubernetes probes run: fresh file alive, old or missing not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _check(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATCHINFER_WORKER_LIVENESS_FILE": str(path),
           "BATCHINFER_WORKER_HEARTBEAT_TIMEOUT_S": "600"}
    return subprocess.run([sys.executable, "-m", "workers.inference.liveness", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_fresh_file_is_alive_an_old_or_missing_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "worker.alive"
    missing = _check(path)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    path.touch()
    assert _check(path).returncode == 0
    # Ages far from the limits: starting Python on a loaded machine takes seconds.
    stamped = time.time() - 1200
    os.utime(path, (stamped, stamped))
    stale = _check(path)
    assert stale.returncode == 1 and "stalled" in stale.stderr
    assert _check(path, "--max-age-s", "3600").returncode == 0
