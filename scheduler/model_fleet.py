"""The served models of `batchinfer up`: each prepared, with its own workers and autoscaler.

Responsible for:
- preparing every model in a child process (`batchinfer models prepare`: known names are
  pulled, paths taken as they are), forked from the warm server the workers then start
  from (scheduler/warm_start), so this process never imports torch, and keeping the
  card each prints (resolved path, kind, context length, weights revision);
- the settings the API and the workers need: every served name, which are embedding
  models, and per worker process the model directory and the name it is served under;
- one Supervisor of worker processes per model, and with a maximum, one autoscaler per
  model reading only that model's lag (readings on one thread, scaling on the main one).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from core.kafka import TopicLag
from core.settings import Settings
from core.topics import model_slug
from scheduler.autoscale_loop import AutoscaleLoop, LagReader, MainThreadScaler
from scheduler.autoscaler import AutoscalePolicy, Autoscaler
from scheduler.deadline_floor import DeadlineFloor
from scheduler.periodic import Periodic
from scheduler.supervisor import Supervisor
from scheduler.warm_start import Child, start_module

logger = logging.getLogger(__name__)

# Model name → its lag reading (topic → lag and partitions); LagReader by default.
LagSource = Callable[[str], Callable[[], Mapping[str, TopicLag]]]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model of this deployment: what was asked for, its name, and its card."""

    model: str
    name: str
    path: str
    kind: str
    context_length: int | None
    revision: str
    # Engine servers its workers drive instead of loading it (docs/engine-servers.md).
    engine_urls: tuple[str, ...] = ()

    @property
    def is_embedding(self) -> bool:
        """True for an encoder served at /v1/embeddings."""
        return self.kind == "embedding"


def prepare_model(model: str, name: str, models_dir: Path,
                  engine_urls: list[str] | None = None, *, warm: bool = False) -> ServedModel:
    """Pull (known names) or check (paths) one model in a child process (forked from the
    warm server with `warm`, which the workers then start from); its card.

    A model behind engine servers is neither: its workers describe it once they reach them.
    RuntimeError naming the child's reason (its last line on stderr, which is passed
    through as it comes: a long pull narrates its progress) when the model cannot be served.
    """
    if engine_urls:
        return ServedModel(model=model, name=name, path=model, kind="chat",
                           context_length=None, revision="on its engine servers",
                           engine_urls=tuple(engine_urls))
    args = ["models", "prepare", model, "--served-model-name", name,
            "--models-dir", str(models_dir)]
    with tempfile.TemporaryDirectory(prefix="batchinfer-prepare-") as tmp:
        card_path, errors_path = Path(tmp, "card"), Path(tmp, "stderr")
        errors_path.touch()
        child = start_module("cli", args, log_path=card_path, stderr_path=errors_path,
                             new_session=False, warm=warm)
        last_line = _relay_lines(child, errors_path)
        stdout = card_path.read_text() if card_path.exists() else ""
    if child.returncode != 0:
        # The child says "batchinfer models prepare: <reason>"; keep only the reason.
        reason = last_line.removeprefix("batchinfer models prepare: ")
        raise RuntimeError(reason or f"could not prepare model {model!r} "
                                     f"(exit code {child.returncode})")
    card = json.loads(stdout.strip().splitlines()[-1])
    return ServedModel(model=model, name=name, path=card["path"], kind=card["kind"],
                       context_length=card.get("context_length"), revision=card["revision"])


def _relay_lines(child: Child, path: Path) -> str:
    """Copy what the child writes to `path` onto our stderr as it comes (a long pull
    narrates its progress) until it exits; its last non-empty line."""
    last_line, pending = "", b""
    with path.open("rb") as lines:
        while True:
            ended = child.poll() is not None
            pending += lines.read()
            *complete, pending = pending.split(b"\n")
            if ended and pending:
                complete, pending = [*complete, pending], b""
            for raw in complete:
                line = raw.decode(errors="replace")
                sys.stderr.write(line + "\n")
                last_line = line.strip() or last_line
            if ended:
                return last_line
            time.sleep(0.1)


def served_settings(models: list[ServedModel]) -> dict[str, str]:
    """The BATCHINFER_* values (without the prefix) that make the API serve `models`."""
    return {"served_models": ",".join(m.name for m in models),
            "embedding_models": ",".join(m.name for m in models if m.is_embedding),
            "model": models[0].path, "served_model_name": models[0].name}


def worker_env(model: ServedModel) -> dict[str, str]:
    """The environment of one worker process of `model` (this process's, plus the model)."""
    return {**os.environ, "BATCHINFER_MODEL": model.path,
            "BATCHINFER_SERVED_MODEL_NAME": model.name,
            "BATCHINFER_ENGINE_URLS": ",".join(model.engine_urls)}


@dataclass(slots=True)
class ModelFleet:
    """Worker supervisors (and autoscalers) of every served model; main thread only."""

    models: list[ServedModel]
    num_workers: int
    # Where each worker's liveness file lies, and the age at which it is SIGKILLed as
    # frozen (see scheduler.supervisor); None: workers are replaced only when they exit.
    liveness_dir: Path | None = None
    liveness_timeout_s: float | None = None
    warm_start: bool = False
    supervisors: dict[str, Supervisor] = field(default_factory=dict)
    _scalers: list[MainThreadScaler] = field(default_factory=list)
    _readers: list[LagReader] = field(default_factory=list)
    _floors: list[DeadlineFloor] = field(default_factory=list)

    def start(self, argv: list[str]) -> None:
        """Start num_workers of `argv` per model (workers read their model from the env)."""
        for model in self.models:
            # One model keeps the plain "worker" name its logs always had.
            name = "worker" if len(self.models) == 1 else f"worker-{model_slug(model.name)}"
            supervisor = Supervisor(argv, num_workers=self.num_workers, env=worker_env(model),
                                    name=name, liveness_dir=self.liveness_dir,
                                    liveness_timeout_s=self.liveness_timeout_s,
                                    warm_start=self.warm_start)
            self.supervisors[model.name] = supervisor
            supervisor.start()

    def start_autoscalers(self, settings: Settings, stop: threading.Event) -> threading.Thread:
        """Size each model's workers by its own lag from now on; the reading thread."""
        loops = self.autoscale_loops(settings)
        return Periodic(_step_each(loops), settings.autoscale_interval_s,
                        "autoscaler").start(stop)

    def autoscale_loops(self, settings: Settings, *,
                        read_lag_of: LagSource | None = None) -> list[AutoscaleLoop]:
        """One loop per model over that model's lag (read_lag_of(model name), default a
        LagReader of its group), scaling its supervisor through apply_scaling."""
        loops = []
        for model in self.models:
            supervisor = self.supervisors[model.name]
            scaler = MainThreadScaler(supervisor.scale_to)
            if read_lag_of is None:
                reader = LagReader(settings, model=model.name)
                self._readers.append(reader)
                read_lag: Callable[[], Mapping[str, TopicLag]] = reader
            else:
                read_lag = read_lag_of(model.name)
            autoscaler = Autoscaler(AutoscalePolicy.from_settings(settings),
                                    num_workers=supervisor.num_desired)
            floor = None
            if read_lag_of is None:
                floor = DeadlineFloor(settings, model=model.name)
                self._floors.append(floor)
            loops.append(AutoscaleLoop(autoscaler, read_lag=read_lag, scale_to=scaler,
                                       job_topics=settings.job_topics_for(model.name),
                                       interval_s=settings.autoscale_interval_s,
                                       model=model.name, read_deadline_floor=floor))
            self._scalers.append(scaler)
        return loops

    def apply_scaling(self) -> None:
        """Apply the counts the autoscalers last asked for (main thread)."""
        for scaler in self._scalers:
            scaler.apply()

    def poll(self) -> None:
        """Restart crashed workers of every model."""
        for supervisor in self.supervisors.values():
            supervisor.poll()

    def hurry(self) -> None:
        """Ask draining workers to hand their unfinished jobs back now (a second Ctrl-C)."""
        for supervisor in self.supervisors.values():
            supervisor.hurry()

    def stop(self) -> None:
        """Drain and stop every model's workers."""
        for supervisor in self.supervisors.values():
            supervisor.stop()

    def close_readers(self) -> None:
        """Close the lag readers' Kafka clients (after their thread has ended)."""
        for floor in self._floors:
            floor.close()
        for reader in self._readers:
            reader.close()


def _step_each(loops: list[AutoscaleLoop]) -> Callable[[], None]:
    def step() -> None:
        for loop in loops:
            loop.step()  # a failed read is one model's problem: step() catches it

    return step
