"""docker-compose.yml and deploy/ agree with each other and with the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from core.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
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
        command = services[name].get("command")
        if command is None:  # the worker pulls its model first, through a shell
            entrypoint = " ".join(services[name]["entrypoint"])
            assert "batchinfer worker" in entrypoint
            continue
        parser.parse_args(command)


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
