"""Runs tests/unit/engine/interpreted/ under Triton's interpreter, in a child process.

TRITON_INTERPRET=1 has to be set before the kernels are defined and must not reach the
other tests (kernels defined under it stay interpreted), hence the child. The child's
tests are ordinary pytest tests; this one passes only if all of them ran and passed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests.utils.budget import within_budget

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter computes with numpy

# Before 3.7 the interpreter cannot run the kernels: a loop bound computed from a loaded
# value stays a one-element array, which range() refuses (seen with 3.6; 3.7-3.9 pass).
# torch's CUDA wheels pin their own Triton (3.6 with torch 2.11); there the compiled
# kernels run in the `gpu` tests instead.
MIN_INTERPRETER = Version("3.7")
if Version(triton.__version__) < MIN_INTERPRETER:
    pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the kernels; "
                f"needs >= {MIN_INTERPRETER}", allow_module_level=True)

INTERPRETED = Path(__file__).parent / "interpreted"
ROOT = Path(__file__).parents[3]


def test_triton_kernels_pass_under_the_interpreter() -> None:
    """Kernels vs references (fp32, fp16, bf16), backend, graph replay, torch.compile."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=within_budget(600),
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    summary = re.search(r"(\d+) passed", result.stdout)
    assert summary and int(summary.group(1)) >= 15, report
    assert not re.search(r"\d+ (failed|skipped|error)", result.stdout), report
