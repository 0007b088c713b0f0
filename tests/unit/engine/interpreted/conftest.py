"""These tests run the Triton kernels under Triton's interpreter, in their own process.

TRITON_INTERPRET=1 must be set before the kernels are defined, and must not leak into
other tests, so test_triton_interpreter.py runs this directory in a child pytest with the
variable set; a run without it collects nothing here.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore_glob = ["test_*.py"]
