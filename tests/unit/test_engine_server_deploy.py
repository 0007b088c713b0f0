"""The engine-server variants of docker-compose.yml and deploy/ parse as settings and CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cli.main import build_parser
from core.settings import Settings
from workers.inference import liveness

ROOT = Path(__file__).resolve().parents[2]


def _settings(env: dict[str, Any]) -> Settings:
    return Settings(**{name.removeprefix("BATCHINFER_").lower(): value
                       for name, value in env.items() if name.startswith("BATCHINFER_")})


def test_compose_worker_drives_the_vllm_service() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    worker = services["worker-engine-server"]
    args = build_parser().parse_args(worker["command"])
    assert args.engine_url == ["http://vllm:8000/v1"]
    assert _settings(worker["environment"]).engine_url_send_priority
    served = services["vllm"]["command"]
    assert served[served.index("--served-model-name") + 1] == args.model
    assert worker["profiles"] == services["vllm"]["profiles"] == ["engine-server"]


def test_kubernetes_engine_server_worker() -> None:
    (deployment,) = yaml.safe_load_all(
        (ROOT / "deploy" / "kubernetes" / "worker-engine-server.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    build_parser().parse_args(container["command"][1:])
    settings = _settings({v["name"]: v["value"] for v in container["env"] if "value" in v})
    assert len(settings.engine_urls) == 2 and settings.engine_url_send_priority
    # The images deploy/Dockerfile builds: this worker runs no model, so the CPU one.
    assert container["image"] == "batchinfer:cpu"
    # Probed like the model workers: a frozen loop is restarted, its partitions move.
    assert str(settings.worker_liveness_file).startswith("/data/")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/data"]]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:3] == ["python", "-m", "workers.inference.liveness"], probe
        liveness.parser(settings).parse_args(command[3:])
    alive = container["livenessProbe"]
    assert alive["exec"]["command"][3:] == []
    assert alive["periodSeconds"] * alive["failureThreshold"] <= 60
