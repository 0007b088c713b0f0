"""The engine's C++ CPU kernels: built on this machine at first use, then loaded from cache.

`kernels/cpu_paged_attention.cpp` (decode attention over the paged pool),
`kernels/cpu_pointwise.cpp` (SwiGLU, rotary, residual add + RMSNorm),
`kernels/cpu_int4_gemm.cpp` (4-bit projections, on x86-64) and `kernels/cpu_sampling.cpp`
(a token drawn over the whole vocabulary) register
`torch.ops.batchinfer_cpu.*`, built as one library. It is compiled
for the CPU it runs on (`-march=native`: AVX-512 where there is some), so the build lives in
a folder named after torch's version and this CPU's instruction-set flags, and a machine
with another CPU (a shared home folder) builds its own. The first build takes about a minute
on 2 cores (52 s on a Zen 3); later starts load the cached library in milliseconds. `python -m
workers.engine.cpu_kernels` builds ahead of time (`make up` and `make test` do).

Without a C++ compiler, or when the build fails, `load()` returns the reason and the
engine runs the pure-torch attention path, which is slower on decode but equal in output.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
_SOURCES = [KERNELS / "cpu_paged_attention.cpp", KERNELS / "cpu_pointwise.cpp",
            KERNELS / "cpu_int4_gemm.cpp", KERNELS / "cpu_sampling.cpp"]
_HEADERS = [KERNELS / "cpu_checks.h", KERNELS / "cpu_math.h"]
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
# torch's wheel ships libgomp.so.1 and loads it first, so the extension's OpenMP calls land
# in the same runtime and thread pool as torch's own ops (one team, one wait policy).
_LDFLAGS = ["-fopenmp"]
DEFAULT_BUILD_ROOT = Path.home() / ".cache" / "batchinfer" / "kernels"

# A build no process has loaded for this long is removed when another build loads: each
# change to the kernel sources, each checkout and each torch upgrade leaves one behind
# (~2 MB), and nothing else ever cleans them up.
STALE_BUILD_S = 14 * 24 * 3600

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else why not


def _cpu_tag() -> str:
    """torch version, a hash of this CPU's feature flags, of the kernel files and of where
    they lie: the build's identity (torch's own rebuild check sees the sources, not the
    headers they include). Two checkouts of the same sources get two builds: torch's
    build file names the sources by path, so sharing one made each start rebuild (40-50 s
    here) after the other had run."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256(flags.encode())
    digest.update(str(KERNELS.resolve()).encode())
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    version = torch.__version__.replace("+", "-")
    return f"torch{version}-{platform.machine()}-{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    """Where this machine's build lives."""
    return DEFAULT_BUILD_ROOT / _cpu_tag()


def compile_flags() -> list[str]:
    """The compiler flags for this machine's build."""
    flags = list(_FLAGS)
    if platform.machine() == "aarch64":
        flags = [f for f in flags if not f.startswith("-mprefer-vector-width")]
        flags = [f.replace("-march=native", "-mcpu=native") for f in flags]
    return flags


def load() -> str | None:
    """Build (once per machine) and load the CPU kernels; None when ready, else why not."""
    with _lock:
        if "error" in _state:
            return _state["error"]
        _state["error"] = _build_and_load()
        if _state["error"] is not None:
            logger.warning(
                "CPU attention kernels unavailable, using torch's SDPA path "
                "(slower decode, same output): %s",
                _state["error"],
            )
        return _state["error"]


def _build_and_load() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"no build recipe for {platform.system()} {platform.machine()}"
    if hasattr(torch.ops, "batchinfer_cpu") and hasattr(torch.ops.batchinfer_cpu, "add_rms_norm"):
        return None
    from torch.utils.cpp_extension import load as load_extension

    target = build_dir()
    flags = compile_flags()
    try:
        target.mkdir(parents=True, exist_ok=True)
        with _build_turn(target):
            load_extension(
                name="batchinfer_cpu_kernels",
                sources=[str(source) for source in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=_LDFLAGS,
                build_directory=str(target),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers, a full disk: all mean "fall back"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return f"building the CPU kernels in {target} failed: {first_line}"
    prune_stale_builds(target)
    return None


@contextmanager
def _build_turn(target: Path) -> Iterator[None]:
    """Hold this build directory's turn (an flock, which the kernel drops when its holder
    dies) and clear a lock file that torch's builder left behind.

    torch marks a build in progress with a plain file (`lock`) and waits, without end, for
    it to go away; a builder killed mid-build (a test timing out, a Ctrl-C) leaves it there
    for good, and every later start would wait silently. Builders here take their turn
    under the flock first, so whoever holds it knows any `lock` file is such a leftover.
    """
    with open(target / "build.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            stale = target / "lock"
            if stale.exists():
                logger.warning("removing %s left by a CPU kernel build that did not finish",
                               stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def prune_stale_builds(loaded: Path, *, max_age_s: float = STALE_BUILD_S) -> list[Path]:
    """Mark `loaded` as used now and remove its siblings unused for `max_age_s`; the
    directories removed. A build another process still has loaded keeps working: its
    library stays mapped until that process ends."""
    now = time.time()
    try:
        os.utime(loaded, (now, now))
        siblings = [d for d in loaded.parent.iterdir() if d.is_dir() and d != loaded]
    except OSError as exc:
        logger.debug("cannot look for stale kernel builds beside %s: %s", loaded, exc)
        return []
    removed = []
    for directory in siblings:
        try:
            if now - directory.stat().st_mtime < max_age_s:
                continue
            shutil.rmtree(directory)
        except OSError as exc:  # another process removing it too, or not ours to remove
            logger.debug("left stale kernel build %s: %s", directory, exc)
            continue
        removed.append(directory)
    if removed:
        logger.info("removed %d kernel build(s) unused for %d days from %s", len(removed),
                    max_age_s // 86400, loaded.parent)
    return removed


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    error = load()
    if error is not None:
        raise SystemExit(error)
    logger.info("CPU kernels ready in %s", build_dir())
