"""docker-compose.yml and deploy/ agree with each other, with the CLI and with settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from cli.main import build_parser
from core.settings import Settings
from core.topics import PRIORITIES

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
ROLES = ("api", "worker", "scheduler", "callbacks")


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_every_part() -> None:
    """Kafka, Redis, PostgreSQL, every role, Prometheus and Grafana are services."""
    services = set(_compose()["services"])
    assert {"kafka", "redis", "postgres", "prometheus", "grafana", *ROLES} <= services


def test_role_commands_are_cli_subcommands() -> None:
    """Each role's command parses with the `batchinfer` argument parser."""
    services = _compose()["services"]
    parser = build_parser()
    for name in (*ROLES, "migrate"):
        parser.parse_args(services[name]["command"])


def test_worker_reserves_a_gpu() -> None:
    """The worker asks the runtime for one NVIDIA GPU."""
    devices = _compose()["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_prometheus_scrapes_every_role_on_its_metrics_port() -> None:
    """Every role is a scrape job, on the port its environment turns the exporter on at."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(ROLES) <= set(jobs)
    services = _compose()["services"]
    port_settings = {"worker": "BATCHINFER_WORKER_METRICS_PORT",
                     "scheduler": "BATCHINFER_SCHEDULER_METRICS_PORT",
                     "callbacks": "BATCHINFER_WEBHOOK_METRICS_PORT"}
    for role, variable in port_settings.items():
        port = int(services[role]["environment"][variable])
        job = jobs[role]
        if "dns_sd_configs" in job:
            assert job["dns_sd_configs"][0]["port"] == port
        else:
            assert job["static_configs"][0]["targets"] == [f"{role}:{port}"]


def test_grafana_dashboard_queries_metrics_that_exist() -> None:
    """Every metric the dashboard plots is one core.metrics defines."""
    from prometheus_client import REGISTRY

    import core.metrics  # noqa: F401  (registers the metrics)

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    known = {family.name + suffix for family in REGISTRY.collect()
             for suffix in suffixes.get(family.type, ("",))}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/batchinfer.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = [w for w in _words(target["expr"]) if w.startswith("batchinfer_")]
            assert names, target["expr"]
            for name in names:
                assert name in known, f"{panel['title']}: {name} is not exported"


def _words(expr: str) -> list[str]:
    out, word = [], ""
    for ch in expr + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word:
                out.append(word)
            word = ""
    return out


def _kubernetes() -> dict[str, list[dict[str, Any]]]:
    """Kind → the objects of that kind among the kustomization's resources."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    objects: dict[str, list[dict[str, Any]]] = {}
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((KUBERNETES / name).read_text()):
            objects.setdefault(document["kind"], []).append(document)
    return objects


def _model_workers(compose: dict[str, Any]) -> list[dict[str, Any]]:
    """Compose's worker services that load their model (not those in front of an engine
    server, tests/unit/test_engine_server_deploy.py)."""
    return [s for s in compose["services"].values() if s.get("command") == ["worker"]
            and "BATCHINFER_ENGINE_URLS" not in s.get("environment", {})]


def _worker_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _config_map(objects: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (config_map,) = objects["ConfigMap"]
    return config_map


def _cluster_settings(objects: dict[str, list[dict[str, Any]]],
                      deployment: dict[str, Any] | None = None) -> Settings:
    """Settings as the ConfigMap makes them (plus a worker Deployment's env, and defaults)."""
    values = dict(_config_map(objects)["data"])
    if deployment is not None:
        values |= {v["name"]: v["value"] for v in _worker_container(deployment)["env"]
                   if "value" in v}
    return Settings(**{name.removeprefix("BATCHINFER_").lower(): value
                       for name, value in values.items()})


def _scaled_object_of(objects: dict[str, list[dict[str, Any]]],
                      deployment: dict[str, Any]) -> dict[str, Any]:
    name = deployment["metadata"]["name"]
    (scaled,) = [so for so in objects["ScaledObject"]
                 if so["spec"]["scaleTargetRef"]["name"] == name]
    return scaled


def test_every_batchinfer_variable_is_a_setting() -> None:
    """Each BATCHINFER_* name in docker-compose.yml and deploy/kubernetes/ is a setting."""
    names = set()
    for service in _compose()["services"].values():
        names |= set(service.get("environment") or {})
    objects = _kubernetes()
    names |= set(_config_map(objects)["data"])
    for deployment in objects["Deployment"]:
        names |= {variable["name"] for variable in _worker_container(deployment)["env"]}
    settings = {f"BATCHINFER_{name.upper()}" for name in Settings.model_fields}
    unknown = {name for name in names if name.startswith("BATCHINFER_")} - settings
    assert not unknown, f"not settings: {sorted(unknown)}"


def test_compose_and_kubernetes_serve_two_models_each_with_its_workers() -> None:
    """Every served model has its own worker service and Deployment; one is for embeddings."""
    compose = _compose()
    shared = Settings(**{name.removeprefix("BATCHINFER_").lower(): value for name, value
                         in compose["x-batchinfer"]["environment"].items()})
    assert len(shared.served_models) == 2
    assert shared.embedding_models and set(shared.embedding_models) < set(shared.served_models)
    workers = _model_workers(compose)
    assert sorted(w["environment"]["BATCHINFER_MODEL"] for w in workers) == sorted(
        shared.served_models)
    objects = _kubernetes()
    assert sorted(_cluster_settings(objects, d).served_model_name
                  for d in objects["Deployment"]) == sorted(shared.served_models)
    assert len(objects["ScaledObject"]) == len(objects["Deployment"])


def test_kubernetes_workers_match_the_compose_worker() -> None:
    """Same command, shared settings, metrics port and GPU as compose's worker; HPA-owned."""
    objects = _kubernetes()
    compose = _compose()
    worker = compose["services"]["worker"]
    build_parser().parse_args(["worker"])
    shared = dict(compose["x-batchinfer"]["environment"])
    shared.pop("BATCHINFER_DATABASE_URL")  # a Secret on the cluster
    config_map = _config_map(objects)
    config = config_map["data"]
    assert {name: config[name] for name in shared} == shared
    for deployment in objects["Deployment"]:
        container = _worker_container(deployment)
        assert container["command"] == ["batchinfer", *worker["command"]]
        assert container["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]
                                                          ["name"]}}]
        env = {variable["name"]: variable for variable in container["env"]}
        assert "secretKeyRef" in env["BATCHINFER_DATABASE_URL"]["valueFrom"]
        port = env["BATCHINFER_WORKER_METRICS_PORT"]["value"]
        assert port == worker["environment"]["BATCHINFER_WORKER_METRICS_PORT"]
        assert container["ports"] == [{"name": "metrics", "containerPort": int(port)}]
        assert env["BATCHINFER_ENGINE_DEVICE"]["value"] == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "replicas" not in deployment["spec"], "the ScaledObject's HPA owns the count"
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > _cluster_settings(objects, deployment).worker_drain_timeout_s


def test_keda_watches_each_models_group_on_its_job_topics() -> None:
    """Per model, one Kafka trigger per priority: its group, its topic, the cluster's broker."""
    objects = _kubernetes()
    for deployment in objects["Deployment"]:
        settings = _cluster_settings(objects, deployment)
        triggers = _scaled_object_of(objects, deployment)["spec"]["triggers"]
        assert [trigger["name"] for trigger in triggers] == list(PRIORITIES)
        for trigger in triggers:
            metadata = trigger["metadata"]
            assert trigger["type"] == "kafka"
            assert metadata["bootstrapServers"] == settings.kafka_bootstrap_servers
            assert metadata["consumerGroup"] == settings.consumer_group
            assert metadata["topic"] == settings.job_topics[trigger["name"]]
            # Workers start a group that never committed at the earliest offset.
            assert metadata["offsetResetPolicy"] == "earliest"
            assert metadata["allowIdleConsumers"] == "false"
            weight = settings.autoscale_weights[trigger["name"]]
            assert float(metadata["lagThreshold"]) == settings.autoscale_lag_threshold / weight


def test_keda_scales_by_the_autoscale_settings() -> None:
    """Weights, threshold, limits, interval and cooldown are the BATCHINFER_AUTOSCALE_* ones."""
    objects = _kubernetes()
    for deployment in objects["Deployment"]:
        settings = _cluster_settings(objects, deployment)
        spec = _scaled_object_of(objects, deployment)["spec"]
        assert spec["minReplicaCount"] == settings.autoscale_min_workers
        assert spec["maxReplicaCount"] == settings.autoscale_max_workers
        assert spec["maxReplicaCount"] <= settings.topic_partitions
        assert spec["pollingInterval"] == settings.autoscale_interval_s
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert behavior["scaleUp"]["policies"][0]["value"] >= settings.autoscale_max_workers
        assert (behavior["scaleDown"]["stabilizationWindowSeconds"]
                == settings.autoscale_cooldown_s)
        modifiers = spec["advanced"]["scalingModifiers"]
        weights = {}
        for term in modifiers["formula"].split("+"):
            weight, name = (part.strip() for part in term.split("*"))
            weights[name] = float(weight)
        assert weights == settings.autoscale_weights


def _dockerfile_stages() -> dict[str, str]:
    """Stage name → its text, from `FROM ... AS name` to the next FROM."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    stages = {}
    for chunk in text.split("\nFROM ")[1:]:
        header = chunk.splitlines()[0].split()
        stages[header[header.index("AS") + 1]] = "FROM " + chunk
    return stages


def test_worker_image_has_cuda_and_a_compiler_and_the_others_are_cpu_only() -> None:
    """The worker stage starts from a CUDA image and installs gcc and Python's headers
    (Triton builds its launcher with them on the GPU); the cpu stage takes torch's CPU
    build. Compose builds workers from the worker stage and every other role from cpu."""
    stages = _dockerfile_stages()
    assert set(stages) == {"cpu", "worker"}
    assert stages["worker"].startswith("FROM nvidia/cuda:")
    assert all(package in stages["worker"].split() for package in ("gcc", "python3-dev"))
    assert "download.pytorch.org/whl/cpu" in stages["cpu"]
    assert "nvidia" not in stages["cpu"]
    compose = _compose()
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        # A worker in front of an engine server runs no model: the CPU image serves it.
        expected = "worker" if service in _model_workers(compose) else "cpu"
        assert service["build"]["target"] == expected, name
        assert service["image"] == f"batchinfer:{expected}", name


def test_models_are_prepared_once_before_any_worker_starts() -> None:
    """Compose: one one-shot service prepares every served model into the shared volume and
    every worker waits for it to succeed; no worker prepares anything itself. Kubernetes:
    each worker pod prepares its own model in an init container, into its own volume."""
    compose = _compose()
    services = compose["services"]
    shared = Settings(**{name.removeprefix("BATCHINFER_").lower(): value for name, value
                         in compose["x-batchinfer"]["environment"].items()})
    prepare = " ".join(services["models"]["entrypoint"])
    assert all(f"batchinfer models prepare {m}" in prepare for m in shared.served_models)
    assert services["models"]["restart"] == "no"
    assert "batchinfer-models:/models" in services["models"]["volumes"]
    for worker in _model_workers(compose):
        assert worker["depends_on"]["models"] == {"condition": "service_completed_successfully"}
        assert "batchinfer-models:/models" in worker["volumes"]
        assert "entrypoint" not in worker
    objects = _kubernetes()
    for deployment in objects["Deployment"]:
        spec = deployment["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        model = _cluster_settings(objects, deployment).model
        assert init["command"] == ["batchinfer", "models", "prepare", model]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == "/models"]
        assert "emptyDir" in volumes[mount["name"]]  # this pod's own: no replica shares it
        worker_mounts = {m["mountPath"]: m["name"] for m in _worker_container(deployment)
                         ["volumeMounts"]}
        assert worker_mounts["/models"] == mount["name"]


def test_kubernetes_workers_are_probed_by_their_liveness_file() -> None:
    """Each worker names a liveness file and is probed by the check that reads it: alive
    while it is younger than the heartbeat timeout, ready while it is fresher still."""
    from workers.inference import liveness

    objects = _kubernetes()
    for deployment in objects["Deployment"]:
        settings = _cluster_settings(objects, deployment)
        container = _worker_container(deployment)
        assert settings.worker_liveness_file is not None
        assert str(settings.worker_liveness_file).startswith("/data/"), "a writable volume"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "workers.inference.liveness"], probe
            assert liveness.parser(settings).parse_args(command[3:]) is not None
        alive = container["livenessProbe"]
        assert alive["exec"]["command"][3:] == [], "judged by the heartbeat timeout"
        # A stall is acted on within a minute or so of the timeout, not never.
        assert alive["periodSeconds"] * alive["failureThreshold"] <= 60
        ready_args = liveness.parser(settings).parse_args(
            container["readinessProbe"]["exec"]["command"][3:])
        assert (settings.worker_heartbeat_interval_s < ready_args.max_age_s
                <= settings.worker_heartbeat_timeout_s)
